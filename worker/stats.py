"""What a worker counts: the one place a metrics exporter reads, published to Redis for `kevlaya status`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions
from redis import Redis

from shared.keys import Keys

log = logging.getLogger("kevlaya.worker")

STATS_TTL_S = 86400
PUBLISH_EVERY_BATCHES = 10


@dataclass(frozen=True, kw_only=True)
class BatchFacts:
    """One finished batch, as the loop saw it."""

    models: tuple[str, ...]
    jobs: int
    ran: int
    errors: int
    prompt_tokens: int
    generated_tokens: int
    wait_s: float
    engine_s: float
    total_s: float
    # The loop's own host work around the engine, the GPU idle meanwhile: taking the rows from Redis, triage
    # (decode, checks, marking them running), writing the results (with follow-ups and registries).
    take_s: float = 0.0
    triage_s: float = 0.0
    write_s: float = 0.0


@dataclass
class WorkerStats:
    batches: int = 0
    jobs: int = 0  # jobs taken (each counted once per take; a take is never handed back)
    errors: int = 0
    switches: int = 0
    escalations: int = 0
    recovered: int = 0
    crashes_survived: int = 0
    dead_lettered: int = 0
    quarantined: int = 0
    mixed_batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    engine_s: float = 0.0  # time inside the engine's run only
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (answered|escalated|error, error type)
    started_at: float = field(default_factory=time.time)
    first_job_at: float | None = None
    last_job_at: float | None = None
    peak_memory_bytes: int = 0
    out_of_memory: int = 0  # the engine's count: an out-of-memory error is a planning bug, survived and counted
    graph_captures: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)

    def record(self, facts: BatchFacts, *, peak_memory_bytes: int) -> None:
        self.batches += 1
        self.jobs += facts.jobs
        self.batch_sizes[facts.jobs] += 1
        self.mixed_batches += len(facts.models) > 1
        self.errors += facts.errors
        self.prompt_tokens += facts.prompt_tokens
        self.generated_tokens += facts.generated_tokens
        self.engine_s += facts.engine_s
        now = time.time()
        self.first_job_at = self.first_job_at or now - facts.total_s
        self.last_job_at = now
        self.peak_memory_bytes = max(self.peak_memory_bytes, peak_memory_bytes)
        log.info(
            "batch model=%s n=%d ran=%d tokens=%d wait=%.2fs engine=%.2fs total=%.2fs tok/s=%.0f "
            "(host: take %.3fs, triage %.3fs, write %.3fs)",
            "+".join(facts.models),
            facts.jobs,
            facts.ran,
            facts.generated_tokens,
            facts.wait_s,
            facts.engine_s,
            facts.total_s,
            facts.generated_tokens / max(facts.engine_s, 1e-9),
            facts.take_s,
            facts.triage_s,
            facts.write_s,
        )

    def count_engine(self, engine: Any) -> None:
        """The engine's own counters (out-of-memory errors survived, graph captures), where it keeps them."""
        engine_stats = getattr(engine, "stats", None)
        if engine_stats is not None:
            counted = engine_stats()
            self.out_of_memory, self.graph_captures = counted.oom, counted.captures

    def count_outcome(self, outcome: str, error_type: str = "") -> None:
        self.outcomes[(outcome, error_type)] += 1

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("batch_sizes", "outcomes")}
        out["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        out["outcomes"] = {f"{o}:{t}" if t else o: n for (o, t), n in sorted(self.outcomes.items())}
        return out

    def publish(self, conn: Redis, keys: Keys, name: str) -> None:
        with contextlib.suppress(redis.exceptions.RedisError):
            flat = {k: str(v) for k, v in self.to_dict().items()}
            conn.hset(keys.worker_stats(name), mapping=flat)
            conn.expire(keys.worker_stats(name), STATS_TTL_S)

    def summary(self) -> str:
        return (
            f"{self.jobs} jobs in {self.batches} batches, {self.switches} switches, {self.escalations} "
            f"escalations, {self.crashes_survived} crashes recovered, {self.quarantined} quarantined, "
            f"{self.out_of_memory} out of memory"
        )
