"""`python -m bench {engine|nightly|fastpath|mixed|timeline|gaps|multigpu|kernels|variants|nf4fused|slices|nf4merge|
prefill|shapes|graphpool|submit|soak|recovery}`."""

from __future__ import annotations

import sys


def main() -> None:
    commands = {
        "engine": "bench.engine",
        "nightly": "bench.nightly",
        "submit": "bench.submit",
        "soak": "bench.soak",
        "fastpath": "bench.fastpath",
        "recovery": "bench.recovery",
        "mixed": "bench.mixed",
        "timeline": "bench.timeline",
        "gaps": "bench.gaps",
        "multigpu": "bench.multigpu",
        "kernels": "bench.kernels",
        "variants": "bench.variants",
        "nf4fused": "bench.nf4fused",
        "slices": "bench.slices",
        "nf4merge": "bench.nf4merge",
        "prefill": "bench.prefill",
        "shapes": "bench.shapes",
        "graphpool": "bench.graphpool",
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(f"usage: python -m bench {{{'|'.join(commands)}}} [--help]", file=sys.stderr)
        sys.exit(2)
    module = __import__(commands[sys.argv[1]], fromlist=["main"])
    sys.argv = [f"bench {sys.argv[1]}", *sys.argv[2:]]
    module.main()


if __name__ == "__main__":
    main()
