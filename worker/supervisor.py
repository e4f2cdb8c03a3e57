"""`kevlaya worker --gpus all|0,1`: one worker process per GPU under one parent.

Each child is the same `kevlaya worker` command without `--gpus`, started with `CUDA_VISIBLE_DEVICES` set to its
GPU (so it sees one device, `cuda`), its own name (`<name>-gpu<id>`) and, with `--metrics-port N`, port N+i. The
parent loads nothing itself. It forwards SIGTERM/SIGINT to every child (each finishes its batch in flight and
exits; a second signal kills them: recovery returns what they held), restarts a child that dies (at most
`max_restarts` times within `restart_window_s`, under the same name, so its registration is taken over at once),
and when one fails past that, stops the others and exits non-zero: a GPU that keeps failing needs a person.
A child that exits 0 (`--burst`: the queues are empty) is not restarted. How the workers share a queue's tail:
worker.tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import ConfigError

log = logging.getLogger("kevlaya.supervisor")

# An index, or a GPU/MIG UUID as CUDA_VISIBLE_DEVICES takes it. Nothing else: CUDA stops reading the list at
# an entry it cannot parse (`-1`, `a`), so such a child would see no GPU and crash through its restarts.
GPU_RE = re.compile(r"^(\d{1,4}|(GPU|MIG)-[A-Za-z0-9-]{1,60})\Z")

# The child command: the `kevlaya` CLI with the worker command added, so it runs from an install (the entry
# point) and from a source tree on PYTHONPATH (the GPU machine) alike. Tests swap it for a cheap fake.
WORKER_CMD: list[str] = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'kevlaya'; from producer.cli import cli, main; "
    "from worker.cli import worker_command; cli.add_command(worker_command); main()",
]


MAX_PORT = 65535


def cuda_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def parse_gpus(text: str, *, visible: str | None = None, count: Callable[[], int] | None = None) -> list[str]:
    """`all` or a comma list of GPU indices/UUIDs -> each child's CUDA_VISIBLE_DEVICES. Under a parent
    CUDA_VISIBLE_DEVICES (`visible`), `all` is that list and indices count within it, as CUDA counts them; else
    an index past the machine's GPUs (`count`, CUDA's device count) is refused. A count of 0 (no driver, a CPU
    machine) says nothing: such a list is left to the children."""
    count = count or cuda_count
    shown = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    text = text.strip()
    if text == "all":
        gpus = shown if shown is not None else [str(i) for i in range(count())]
        if not gpus:
            raise ConfigError("--gpus all: no CUDA device is visible")
        return gpus
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if not GPU_RE.match(t)]
    if bad:
        raise ConfigError(f"--gpus {text!r}: expected `all` or a comma list of GPU indices or UUIDs, not {bad[0]!r}")
    # Asked only where an index must be checked against it (importing torch costs the parent seconds).
    on_machine = count() if shown is None and any(t.isdigit() for t in items) else 0
    out = []
    for t in items:
        if shown is not None and t.isdigit() and int(t) >= len(shown):
            raise ConfigError(f"--gpus {text!r}: GPU {t} is not among CUDA_VISIBLE_DEVICES={visible}")
        # A child on a GPU that is not there sees no device: it would crash through its restarts.
        if shown is None and t.isdigit() and 0 < on_machine <= int(t):
            raise ConfigError(
                f"--gpus {text!r}: GPU {t} is not on this machine (it has {on_machine}: 0-{on_machine - 1})"
            )
        out.append(_resolve(t, shown))
    if len(set(out)) != len(out):  # after resolving: `0,00`, or an index and the UUID it stands for
        raise ConfigError(f"--gpus {text!r} names a GPU twice")
    return out


def _resolve(item: str, shown: list[str] | None) -> str:
    """An index within the parent's CUDA_VISIBLE_DEVICES (if set) or its canonical form (`00` is GPU 0)."""
    if not item.isdigit():
        return item
    return shown[int(item)] if shown is not None else str(int(item))


@dataclass(frozen=True, kw_only=True)
class ChildSpec:
    """One child: its GPU, worker name, command line and environment additions."""

    gpu: str
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def child_specs(
    gpus: Sequence[str],
    *,
    base_name: str,
    worker_args: Sequence[str],
    global_args: Sequence[str] = (),
    metrics_port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> list[ChildSpec]:
    """The children of `--gpus`: the same worker arguments, a name and a GPU each (and a metrics port: N+i, so
    ConfigError when the last one would pass 65535; its child would refuse it and crash through its restarts)."""
    last = metrics_port + len(gpus) - 1 if metrics_port else None
    if last is not None and last > MAX_PORT:
        raise ConfigError(
            f"--metrics-port {metrics_port} for {len(gpus)} GPUs: the last worker's would be {last}, past {MAX_PORT}; "
            f"give one of at most {MAX_PORT - len(gpus) + 1} (or 0: any free port each)"
        )
    out = []
    for i, gpu in enumerate(gpus):
        name = f"{base_name}-gpu{gpu}"
        args = [*WORKER_CMD, *global_args, "worker", *worker_args, "--name", name, "--device", "cuda"]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port + i if metrics_port else 0)]
        out.append(ChildSpec(gpu=gpu, name=name, argv=args, env={**(env or {}), "CUDA_VISIBLE_DEVICES": gpu}))
    return out


@dataclass(frozen=True, kw_only=True)
class SupervisorSettings:
    max_restarts: int = 3  # per child within restart_window_s; one more failure is permanent
    restart_window_s: float = 600.0
    restart_delay_s: float = 2.0
    poll_s: float = 0.2


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, so a killed parent leaves no orphans."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Runs the children until they have all exited; `run()` returns the parent's exit code."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        settings: SupervisorSettings | None = None,
        *,
        spawn: Callable[..., Any] = subprocess.Popen,
    ) -> None:
        self.children = list(children)
        self.settings = settings or SupervisorSettings()
        self.spawn = spawn
        self.procs: dict[str, Any] = {}  # child name -> its process, while it runs
        self.restarts: dict[str, list[float]] = {c.name: [] for c in self.children}
        self.pending: dict[str, float] = {}  # child name -> when to start it again
        self.failed: list[tuple[ChildSpec, int]] = []
        self.signals = 0
        self._wake = threading.Event()

    # ---- signals --------------------------------------------------------------------------------------------
    def install_signals(self) -> dict[int, Any]:
        """Forward SIGTERM/SIGINT from now on; returns the handlers they had (run() puts them back)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        """First signal: forward it (children finish their batch). Second: kill them."""
        self.signals += 1
        self.pending.clear()
        sig = signum if self.signals == 1 else signal.SIGKILL
        log.info("forwarding %s to %d worker(s)", signal.Signals(sig).name, len(self.procs))
        self._send(sig)
        self._wake.set()

    def _send(self, sig: int) -> None:
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    @property
    def stopping(self) -> bool:
        return self.signals > 0 or bool(self.failed)

    # ---- the loop -------------------------------------------------------------------------------------------
    def start(self, child: ChildSpec) -> None:
        env = {**os.environ, **child.env}
        proc = self.spawn(
            child.argv, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )  # its own session: a Ctrl-C reaches it once, through the parent
        self.procs[child.name] = proc
        log.info("worker %s on GPU %s (pid %s)", child.name, child.gpu, proc.pid)
        if self.stopping:  # a signal (or a failure) came while it was being spawned: it missed the forward
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM if self.signals <= 1 else signal.SIGKILL)

    def run(self) -> int:
        previous = self.install_signals()
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        for child in self.children:
            if not self.stopping:  # a signal during the first starts: start no more
                self.start(child)
        by_name = {c.name: c for c in self.children}
        while self.procs or self.pending:
            for name, proc in list(self.procs.items()):
                rc = proc.poll()
                if rc is not None:
                    del self.procs[name]
                    self._exited(by_name[name], rc)
            now = time.monotonic()
            for name, at in list(self.pending.items()):
                if now >= at and not self.stopping:
                    del self.pending[name]
                    self.start(by_name[name])
            self._wake.wait(self.settings.poll_s)
            self._wake.clear()
        if self.failed:
            child, rc = self.failed[0]
            log.error("worker %s (GPU %s) failed permanently (exit %s)", child.name, child.gpu, rc)
            return rc if rc > 0 else 1
        return 0

    def _exited(self, child: ChildSpec, rc: int) -> None:
        if self.stopping:
            log.info("worker %s exited (%s)", child.name, rc)
            return
        if rc == 0:
            log.info("worker %s finished", child.name)
            return
        now = time.monotonic()
        recent = [t for t in self.restarts[child.name] if now - t < self.settings.restart_window_s]
        if len(recent) >= self.settings.max_restarts:
            log.error(
                "worker %s (GPU %s) exited %s after %d restarts within %.0f s; stopping the others",
                child.name, child.gpu, rc, len(recent), self.settings.restart_window_s,
            )  # fmt: skip
            self.failed.append((child, rc))
            self.pending.clear()
            self._send(signal.SIGTERM)
            return
        self.restarts[child.name] = [*recent, now]
        delay = self.settings.restart_delay_s * (len(recent) + 1)
        log.warning(
            "worker %s (GPU %s) exited %s; restart %d/%d in %.0f s",
            child.name, child.gpu, rc, len(recent) + 1, self.settings.max_restarts, delay,
        )  # fmt: skip
        self.pending[child.name] = now + delay
