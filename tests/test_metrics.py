"""A running worker serves Prometheus metrics, /healthz and /readyz."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from producer.client import Client
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import wait_until
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_endpoint_of_a_running_worker(client: Client, redis: Redis) -> None:
    jobs = [{"custom_id": f"j{i}", "model": "laya", "prompt": "unsure" if i < 2 else "p"} for i in range(5)]
    handle = client.submit_batch(jobs)
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(metrics_port=0, name="m1"))
    thread = threading.Thread(target=worker.work)
    thread.start()
    try:
        wait_until(lambda: worker.health is not None and client.status(handle.id).complete, 30)
        port = worker.health.port
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/readyz") == (200, "ready\n")
        status, text = get(port, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        value = {f.name: f.samples[0].value for f in families.values() if len(f.samples) == 1}
        assert value["kevlaya_jobs"] == 7 and value["kevlaya_escalations"] == 2  # 5 Laya + 2 Kev follow-ups
        decisions = {
            (s.labels["outcome"], s.labels["error_type"]): s.value for s in families["kevlaya_decisions"].samples
        }
        assert decisions == {("answered", ""): 5.0, ("escalated", ""): 2.0}
        depth = {
            (s.labels["model"], s.labels["lane"], s.labels["kind"]): s.value
            for s in families["kevlaya_queue_depth"].samples
        }
        assert depth[("laya", "bulk", "queued")] == 0 and depth[("kev", "interactive", "suspect_groups")] == 0
        oldest = families["kevlaya_queue_oldest_wait_seconds"].samples
        assert {(s.labels["model"], s.labels["lane"]) for s in oldest} == {
            (m, lane) for m in ("kev", "laya") for lane in ("interactive", "bulk")
        }
        rows = families["kevlaya_batch_rows"]
        assert any(s.name == "kevlaya_batch_rows_count" and s.value == 2 for s in rows.samples)
        assert "kevlaya_generated_tokens" in families and "kevlaya_graph_captures" in families
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_rq_tools_agree_suspend_pauses_and_rq_info_counts(client: Client, redis: Redis) -> None:
    from rq.suspension import resume, suspend
    from rq.worker import SimpleWorker

    suspend(redis)
    handle = client.submit_batch([{"custom_id": f"j{i}", "model": "laya", "prompt": "p"} for i in range(3)])
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(name="rq1"))
    thread = threading.Thread(target=worker.work)
    thread.start()
    try:
        wait_until(worker.ready.is_set, 120)
        import time

        time.sleep(1.5)
        assert client.status(handle.id).counts.done == 0  # suspended: nothing taken
        (info,) = SimpleWorker.all(connection=redis)
        assert info.name == "rq1" and info.get_state() == "idle"
        resume(redis)
        wait_until(lambda: client.status(handle.id).complete, 120)
        (info,) = SimpleWorker.all(connection=redis)
        assert info.successful_job_count == 3 and info.failed_job_count == 0
    finally:
        worker.request_stop()
        thread.join(timeout=30)
