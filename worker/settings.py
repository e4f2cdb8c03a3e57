"""The worker's settings: keyword-only, units in every name, derived intervals in one place."""

from __future__ import annotations

import re
import socket
import uuid
from dataclasses import dataclass

from shared.errors import ConfigError
from shared.keys import DEFAULT_PREFIX
from shared.store import DEFAULT_BATCH_TTL_S


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    burst: bool = False
    max_wait_ms: int = 10000
    bulk_every_takes: int = 4  # bulk gets the next take after this many interactive takes in a row (worker.lanes)
    paced_take_ms: int = 600  # bulk takes' target length while interactive work is live (worker.pace; 0: off)
    interactive_window_s: float = 3.0  # interactive work is live this long after one was last seen
    heartbeat_interval_s: float = 3.0
    job_heartbeat_ttl_s: float = 20.0
    worker_ttl_s: int = 20
    idle_poll_s: float = 0.1
    recovery_interval_s: float = 5.0
    result_ttl_s: int = DEFAULT_BATCH_TTL_S
    followup_retries: int = 3
    mixed_tails: bool = True
    # While the engine runs a take, a helper thread writes the take before it and takes the next one (worker.ahead).
    # For a GPU's idle host; on a CPU the helper's Python shares the cores the engine computes on.
    take_ahead: bool = True
    batch_time_limit_s: float = 900.0
    name: str | None = None
    prefix: str = DEFAULT_PREFIX
    metrics_port: int | None = None  # serve /metrics, /healthz, /readyz here (0: any free port)
    notify_allow: tuple[str, ...] = ()  # URL prefixes completion notices may be POSTed to

    @classmethod
    def with_heartbeat_ttl(cls, job_heartbeat_ttl_s: float, **kw: object) -> WorkerSettings:
        """Settings whose heartbeat interval and worker TTL follow the job heartbeat TTL: beat four times
        per TTL (at most every 3 s), and a worker is dead once a TTL passes without a beat."""
        return cls(
            job_heartbeat_ttl_s=job_heartbeat_ttl_s,
            heartbeat_interval_s=min(3.0, job_heartbeat_ttl_s / 4),
            worker_ttl_s=max(2, int(job_heartbeat_ttl_s)),
            **kw,  # type: ignore[arg-type]
        )


def take_ahead_on(device_type: str) -> bool:
    """`--take-ahead auto`: the helper thread where the engine runs on a GPU, whose host otherwise idles; not on a
    CPU, where its Python takes the cores the engine computes on."""
    return device_type == "cuda"


NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def worker_name(name: str | None) -> str:
    """The given --name (letters, digits, '_', '.', '-': it is part of every started-registry entry, where ':'
    separates fields), or host + random suffix with other characters replaced."""
    if name is not None:
        if not NAME_RE.match(name):
            raise ConfigError(f"--name {name!r}: use 1-128 letters, digits, '_', '.' or '-'")
        return name
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:80]
    return f"kevlaya-{host}-{uuid.uuid4().hex[:8]}"
