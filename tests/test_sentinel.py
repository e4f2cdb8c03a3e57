"""Redis Sentinel: redis+sentinel:// URLs, and a failover under a running worker that loses no job (a local
primary, replica and sentinel, each a redis-server this test starts on free ports)."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.aio import AsyncClient
from producer.cli import cli
from producer.client import Client
from shared.conn import SentinelTarget, check_url, connect, redacted, sentinel_target
from shared.errors import ConfigError, StoreError
from tests.fakes import FakeEngine
from tests.worker_helpers import assert_each_item_answered_once, wait_until
from worker.loop import BatchWorker
from worker.settings import WorkerSettings
from worker.tools.embedded_redis import free_port, redis_server_binary


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("redis+sentinel://h1:26379/mymaster", SentinelTarget((("h1", 26379),), "mymaster")),
        (
            "redis+sentinel://:p%40ss@h1:26379,h2:26380/svc/3",
            SentinelTarget((("h1", 26379), ("h2", 26380)), "svc", 3, None, "p@ss"),
        ),
        ("redis+sentinel://app:pw@h1:1/svc/", SentinelTarget((("h1", 1),), "svc", 0, "app", "pw")),
    ],
)
def test_sentinel_urls(url: str, want: SentinelTarget) -> None:
    assert sentinel_target(url) == want
    assert check_url(url) == url


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+sentinel://h1:26379", "name the service"),
        ("redis+sentinel://h1:26379/svc/x", "database 'x' is not a number"),
        ("redis+sentinel://h1/svc", "sentinel 'h1' is not host:port"),
        ("redis+sentinel://h1:1,h2:x/svc", "sentinel 'h2:x' is not host:port"),
    ],
)
def test_bad_sentinel_urls_say_what_is_wrong(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        check_url(url)


def test_passwords_are_redacted_from_sentinel_urls() -> None:
    assert redacted("redis+sentinel://:secret@h1:1,h2:2/svc") == "redis+sentinel://:***@h1:1,h2:2/svc"
    assert redacted("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"


class Servers:
    """Primary, replica and one sentinel (quorum 1, fails over within a few seconds)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.primary_port, self.replica_port, self.sentinel_port = free_port(), free_port(), free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _server(self, name: str, *args: str) -> None:
        log = self.folder / f"{name}.log"
        base = [redis_server_binary(), *args]
        self.procs[name] = subprocess.Popen(
            [*base, "--logfile", str(log)] if "--sentinel" not in args else base,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._server("primary", "--port", str(self.primary_port), "--dir", str(self.folder / "p"), *common)
        replica_of = ["--replicaof", "127.0.0.1", str(self.primary_port)]
        self._server("replica", "--port", str(self.replica_port), "--dir", str(self.folder / "r"), *common, *replica_of)
        replica = Redis(port=self.replica_port)
        wait_until(lambda: _ping(replica) and replica.info("replication")["master_link_status"] == "up", 20)
        conf = self.folder / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.folder}\nlogfile {self.folder / 'sentinel.log'}\n"
            f"sentinel monitor mymaster 127.0.0.1 {self.primary_port} 1\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 3000\n"
        )
        self._server("sentinel", str(conf), "--sentinel")
        sentinel = Redis(port=self.sentinel_port, decode_responses=True)
        wait_until(lambda: _ping(sentinel) and len(sentinel.sentinel_slaves("mymaster")) == 1, 30, poll_s=0.2)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/mymaster/0"

    def primary_address(self) -> tuple[str, int]:
        host, port = Redis(port=self.sentinel_port).sentinel_get_master_addr_by_name("mymaster")
        return host if isinstance(host, str) else host.decode(), int(port)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _ping(r: Redis) -> bool:
    try:
        return bool(r.ping())
    except (RedisConnectionError, RedisTimeoutError):
        return False


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    for sub in ("p", "r"):
        (tmp_path / sub).mkdir()
    s = Servers(tmp_path)
    try:
        s.start()
        yield s
    finally:
        s.stop()


async def async_status(url: str, batch: str):
    client = AsyncClient(url=url)
    try:
        return await client.status(batch)
    finally:
        await client.aclose()


def items(prefix: str, n: int) -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "model": "laya", "prompt": f"case {i}"} for i in range(n)]


class SlowEngine(FakeEngine):
    def run(self, jobs, **kw):
        time.sleep(0.1)  # a batch takes a while: the failover happens with work in flight
        return super().run(jobs, **kw)


def submit_retrying(client: Client, jobs: list[dict], batch_id: str, timeout_s: float = 30) -> None:
    """A producer during a failover: its submit is refused until the new primary is found, then goes through
    (the same batch id: resubmitting is idempotent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.submit_batch(jobs, batch_id=batch_id, escalate=False)
            return
        except StoreError:  # refused (no primary yet), or answered READONLY by the old one's replica
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_failover_under_a_running_worker_loses_no_job(servers: Servers) -> None:
    client = Client(redis_url=servers.url)
    assert servers.primary_address() == ("127.0.0.1", servers.primary_port)
    client.submit_batch(items("a", 100), batch_id="before", escalate=False)

    engine = SlowEngine(rows=16)
    settings = WorkerSettings.with_heartbeat_ttl(3.0, name="s1", recovery_interval_s=0.5)
    worker = BatchWorker(connect(servers.url, socket_timeout_s=5), engine, engine.config, settings)
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    try:
        wait_until(lambda: client.status("before").complete, 30)
        client.submit_batch(items("b", 300), batch_id="during", escalate=False)
        primary = Redis(port=servers.primary_port)
        assert primary.execute_command("WAIT", 1, 5000) == 1  # every submitted job is on the replica
        wait_until(lambda: client.status("during").counts.done > 0, 30)
        assert not client.status("during").complete

        servers.procs["primary"].kill()  # the primary's host is gone, mid-batch
        servers.procs["primary"].wait()
        wait_until(lambda: servers.primary_address() == ("127.0.0.1", servers.replica_port), 30, poll_s=0.2)

        submit_retrying(client, items("c", 50), "after")  # the same client, now on the new primary
        for batch, n in (("before", 100), ("during", 300), ("after", 50)):
            wait_until(lambda b=batch: client.status(b).complete, 60, poll_s=0.2)
            rows = assert_each_item_answered_once(client, client.redis, batch, n)
            assert all(r.get("error") is None for r in rows), batch
        assert client.redis.connection_pool.get_master_address()[1] == servers.replica_port
        # The CLI and the asyncio client take the same URL.
        res = CliRunner().invoke(cli, ["--redis-url", servers.url, "status", "after", "--json"])
        assert res.exit_code == 0 and orjson.loads(res.stdout)["counts"]["finished"] == 50
        assert asyncio.run(async_status(servers.url, "during")).counts.finished == 300
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
