"""An idle worker wakes when a submit enqueues (worker/wake.py), not at its next poll; the wait never fails."""

from __future__ import annotations

import socket
import threading
import time

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.client import Client
from shared.keys import Keys
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import wait_until
from worker.loop import BatchWorker
from worker.settings import WorkerSettings
from worker.wake import MIN_WAKE_GAP_S, Wake

CHANNEL = Keys().queued()


def _publish_later(redis: Redis, delay_s: float, count: int = 1) -> threading.Thread:
    def publish() -> None:
        time.sleep(delay_s)
        for _ in range(count):
            redis.publish(CHANNEL, "bulk")

    thread = threading.Thread(target=publish)
    thread.start()
    return thread


def test_a_message_on_the_queued_channel_ends_the_wait_and_a_burst_of_them_wakes_it_once(redis: Redis) -> None:
    wake = Wake(redis, CHANNEL, threading.Event())
    try:
        wake.wait(0.01)  # subscribed
        publisher = _publish_later(redis, 0.2, count=3)
        assert wake.wait(30) is True  # a message, not the 30 s interval
        publisher.join()
        time.sleep(0.1)  # every message delivered
        wake.wait(0.01)  # what the first wake left is drained here at the latest
        assert wake.wait(0.2) is False  # nothing pending: the interval passes
    finally:
        wake.close()


def test_a_stopped_loop_does_not_wait_and_an_unreachable_redis_falls_back_to_sleeping() -> None:
    stop = threading.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    unreachable = Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    wake = Wake(unreachable, CHANNEL, stop)
    started = time.monotonic()
    assert wake.wait(0.3) is False  # no exception: a plain sleep
    assert time.monotonic() - started >= 0.3
    stop.set()
    started = time.monotonic()
    assert wake.wait(30) is False
    assert time.monotonic() - started < 5
    wake = Wake(unreachable, CHANNEL, stop)
    assert wake.wait(30) is False  # stopped: not even a sleep


def test_an_idle_worker_takes_a_submit_before_its_poll_interval_ends(client: Client, redis: Redis) -> None:
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(name="wake1", idle_poll_s=120))
    thread = threading.Thread(target=worker.work)
    thread.start()
    try:
        wait_until(worker.ready.is_set, 60)
        time.sleep(0.5)  # idle now, in a wait of 120 s
        handle = client.submit_batch([{"custom_id": f"j{i}", "model": "laya", "prompt": "p"} for i in range(3)])
        wait_until(lambda: client.status(handle.id).complete, 60)  # the submit's message woke it
    finally:
        worker.request_stop()
        thread.join(timeout=60)
    assert not thread.is_alive()  # a stop request ends the 120 s wait too


def test_a_flood_on_the_channel_wakes_the_loop_no_more_often_than_the_least_gap(redis: Redis) -> None:
    wake = Wake(redis, CHANNEL, threading.Event())
    flooding = threading.Event()

    def flood() -> None:
        while not flooding.is_set():
            redis.publish(CHANNEL, "x")

    try:
        wake.wait(0.01)  # subscribed
        thread = threading.Thread(target=flood)
        thread.start()
        woken, started = 0, time.monotonic()
        while time.monotonic() - started < 0.5:
            woken += wake.wait(0.1)
        flooding.set()
        thread.join()
        assert 1 <= woken <= 0.5 / MIN_WAKE_GAP_S + 5
    finally:
        wake.close()
