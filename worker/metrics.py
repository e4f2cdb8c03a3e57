"""`kevlaya worker --metrics-port N`: Prometheus metrics, /healthz and /readyz on one small HTTP server.

Everything is read at scrape time from what the worker already keeps (WorkerStats, the queues, the
engine's counters): no second set of books to drift from the first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis.exceptions
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from shared.errors import ConfigError

log = logging.getLogger("kevlaya.worker")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # scrapes every few seconds: not worth a log line each
        pass


class WorkerCollector:
    """A Prometheus collector over a running BatchWorker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Any]:
        w = self.worker
        s = w.stats
        yield from self._queues()
        yield _counter("kevlaya_batches", "Batches run.", s.batches)
        yield _counter("kevlaya_jobs", "Jobs taken.", s.jobs)
        yield _counter("kevlaya_engine_seconds", "Seconds inside the engine.", s.engine_s)
        yield _counter("kevlaya_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield _counter("kevlaya_generated_tokens", "Tokens generated.", s.generated_tokens)
        yield _counter("kevlaya_escalations", "Follow-ups enqueued by escalation.", s.escalations)
        yield _counter("kevlaya_model_switches", "Switches between model queues.", s.switches)
        yield _counter("kevlaya_recovered_jobs", "Jobs taken back from dead workers.", s.recovered)
        yield _counter("kevlaya_crashes_survived", "Dead takes recovered as suspect groups.", s.crashes_survived)
        yield _counter("kevlaya_dead_lettered", "Jobs failed for killing their worker.", s.dead_lettered)
        yield _counter("kevlaya_quarantined", "Unreadable Redis entries moved aside.", s.quarantined)
        decisions = CounterMetricFamily(
            "kevlaya_decisions", "Results written, by outcome and error type.", labels=["outcome", "error_type"]
        )
        for (outcome, error_type), n in sorted(s.outcomes.items()):
            decisions.add_metric([outcome, error_type], n)
        yield decisions
        yield _row_histogram(s.batch_sizes)
        engine = w.engine
        counted = getattr(engine, "stats", lambda: None)()
        yield _counter("kevlaya_graph_captures", "CUDA graphs captured.", counted.captures if counted else 0)
        yield _counter("kevlaya_out_of_memory", "Out-of-memory errors survived.", counted.oom if counted else 0)
        memory = GaugeMetricFamily("kevlaya_gpu_memory_bytes", "GPU memory.", labels=["kind"])
        memory.add_metric(["allocator_peak"], getattr(engine, "peak_memory_bytes", lambda: 0)())
        if counted is not None and counted.process_bytes is not None:
            memory.add_metric(["process"], counted.process_bytes)
        if counted is not None and counted.budget_bytes is not None:
            memory.add_metric(["budget"], counted.budget_bytes)
        yield memory
        yield _gauge("kevlaya_model_load_seconds", "Seconds to load the models.", getattr(engine, "load_s", 0.0))
        yield _gauge("kevlaya_warmup_seconds", "Seconds of warm-up at start.", getattr(engine, "warmup_s", 0.0))
        yield _gauge("kevlaya_worker_started_timestamp_seconds", "When this worker started.", s.started_at)

    def _queues(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("kevlaya_queue_depth", "Jobs queued.", labels=["model", "lane", "kind"])
        oldest = GaugeMetricFamily(
            "kevlaya_queue_oldest_wait_seconds", "Wait of the oldest queued job.", labels=["model", "lane"]
        )
        try:
            facts = self.worker.bridge.queue_facts(move_aside=False)
        except redis.exceptions.RedisError:
            facts = {}
        now = time.time()
        for ref, f in facts.items():
            depth.add_metric([ref.model, ref.lane, "queued"], f.depth)
            depth.add_metric([ref.model, ref.lane, "suspect_groups"], f.suspect_groups)
            wait = max(0.0, now - f.oldest_enqueued_at) if f.oldest_enqueued_at else 0.0
            oldest.add_metric([ref.model, ref.lane], wait)
        yield depth
        yield oldest


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _row_histogram(sizes: Any) -> HistogramMetricFamily:
    buckets, running = [], 0
    for bound in ROW_BUCKETS:
        running = sum(n for rows, n in sizes.items() if rows <= bound)
        buckets.append((str(bound), running))
    total = sum(sizes.values())
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(
        "kevlaya_batch_rows",
        "Rows per batch.",
        buckets=buckets,
        sum_value=sum(rows * n for rows, n in sizes.items()),
    )


class HealthServer:
    """/metrics, /healthz (the process answers) and /readyz (models loaded and Redis reachable)."""

    def __init__(self, worker: Any, port: int, *, host: str = "0.0.0.0") -> None:
        self.worker = worker
        registry = CollectorRegistry()
        registry.register(WorkerCollector(worker))
        self.metrics = make_wsgi_app(registry)
        try:
            self.server: WSGIServer = make_server(host, port, self._app, handler_class=_Quiet)
        except OSError as exc:  # taken, or not ours to bind: the operator's to fix, in one line, not a traceback
            raise ConfigError(f"--metrics-port {port}: cannot serve on it ({exc.strerror or exc})") from exc
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="metrics")

    def start(self) -> HealthServer:
        self.thread.start()
        log.info("metrics and health on port %d (/metrics, /healthz, /readyz)", self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _app(self, environ: dict[str, Any], start: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _text(start, "200 OK", "ok\n")
        if path == "/readyz":
            problem = self._not_ready()
            return (
                _text(start, "503 Service Unavailable", problem + "\n")
                if problem
                else _text(start, "200 OK", "ready\n")
            )
        if path == "/metrics":
            return self.metrics(environ, start)
        # Not the metrics on every other path: a probe or scraper pointed at a wrong one must see it fail.
        return _text(start, "404 Not Found", "not found: /metrics, /healthz and /readyz are served here\n")

    def _not_ready(self) -> str | None:
        if not self.worker.ready.is_set():
            return "models loading or worker not registered yet"
        try:
            self.worker.redis.ping()
        except redis.exceptions.RedisError as exc:
            return f"redis unreachable: {exc}"
        return None


def _text(start: Callable[..., Any], status: str, body: str) -> list[bytes]:
    start(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body.encode()]
