"""RQ's cron scheduler drives `kevlaya schedule`: the producer's one door to RQ besides shared.enqueue.

rq 2.12's `CronScheduler` keeps the time: it sleeps until the next slot is due, stops on SIGTERM/SIGINT, and
registers and heartbeats itself in `rq:cron_schedulers` (its jobs listed in `rq:cron_scheduler:<name>`), so RQ's
tools see it. A stock `CronJob` would enqueue an RQ job under RQ's default serializer (pickle) for some RQ
worker to import and run; kevlaya runs no such job (no pickle anywhere; the worker runs only allowlisted
functions), so `SlotJob.enqueue` calls the scheduled function, `producer.schedule.run_slot` with JSON
arguments, in the scheduler itself. Slots come from the schedule's cadence (producer.schedule.Cadence): the
same ones in every scheduler of a schedule, counted from the epoch for `--every`.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from functools import partial

from redis import Redis
from redis import exceptions as redis_exceptions
from redis.client import Pipeline
from rq import cron_job_registry, cron_scheduler_registry
from rq.cron import CronJob, CronScheduler
from rq.defaults import DEFAULT_CRON_SCHEDULER_TTL
from rq.utils import now

from producer.client import Client
from producer.schedule import ScheduleSpec, SlotRunner, run_slot, stamp
from shared.errors import RedisUnavailableError

log = logging.getLogger("kevlaya.schedule")


class SlotJob(CronJob):
    """One schedule as an RQ cron job whose "enqueue" runs the slot due now (see the module docstring)."""

    def __init__(self, runner: SlotRunner, queue_label: str) -> None:
        spec = runner.spec
        super().__init__(
            queue_name=queue_label,  # shown by RQ's tools; nothing is enqueued on it
            func=run_slot,
            args=(spec.to_dict(),),
            cron=spec.cron,
            interval=spec.every_s,
            name=f"kevlaya-schedule-{spec.name}",
        )
        self.runner = runner
        self.cadence = spec.cadence
        self.next_enqueue_time = self.cadence.next_after(now())  # never "run at once on start" (RQ's interval rule)

    def should_run(self) -> bool:
        return self.next_enqueue_time is not None and now() >= self.next_enqueue_time

    def get_next_enqueue_time(self) -> datetime:
        return self.cadence.next_after(now())  # a late wake-up skips nothing it could still run

    def enqueue(self, connection: Redis) -> None:  # type: ignore[override]
        slot = self.cadence.at_or_before(now())
        try:
            self.func(*self.args, stamp(slot), runner=self.runner)  # type: ignore[misc]
            cron_job_registry.add(self.name, connection, enqueue_timestamp=slot.timestamp())
        except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, RedisUnavailableError) as exc:
            # Raising here would leave the slot due, and RQ's loop would retry it without sleeping. Unclaimed,
            # the next slot reports it missed; claimed, its record says how far it got.
            log.error("schedule %s: slot %s not run, redis unavailable (%s)", self.runner.spec.name, stamp(slot), exc)


class KevlayaCron(CronScheduler):
    """RQ's cron scheduler, carrying on through a Redis outage: its heartbeat and save are retried at the
    next pass of its loop instead of ending the process (its registration comes back with the heartbeat)."""

    def heartbeat(self) -> None:
        try:
            super().heartbeat()
        except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError) as exc:
            log.warning("cron scheduler %s: heartbeat failed, redis unavailable (%s)", self.name, exc)

    def save(self, pipeline: Pipeline | None = None) -> None:
        try:
            super().save(pipeline)
        except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError) as exc:
            log.warning("cron scheduler %s: could not save its state, redis unavailable (%s)", self.name, exc)


def alive(redis: Redis, scheduler: str) -> bool:
    """Whether the RQ cron scheduler of that name has sent a heartbeat within RQ's scheduler TTL."""
    score = redis.zscore(cron_scheduler_registry.get_registry_key(), scheduler)
    return score is not None and time.time() - score < DEFAULT_CRON_SCHEDULER_TTL


def scheduler_for(client: Client, spec: ScheduleSpec) -> tuple[CronScheduler, SlotRunner]:
    """An RQ cron scheduler carrying the schedule, and its slot runner (named after the scheduler)."""
    scheduler = KevlayaCron(client.redis)
    runner = SlotRunner(client, spec, owner=scheduler.name, alive=partial(alive, client.redis))
    # CronScheduler.register builds plain CronJobs only; its loop reads this list (pinned rq==2.12.0).
    scheduler._cron_jobs.append(SlotJob(runner, f"{client.keys.prefix}schedule:{spec.name}"))
    return scheduler, runner


def run_schedule(client: Client, spec: ScheduleSpec) -> None:
    """Run the schedule until SIGTERM/SIGINT: report missed slots, take over dead schedulers' unfinished runs,
    then one run per slot (claimed in Redis; another scheduler of the schedule may run it instead)."""
    scheduler, runner = scheduler_for(client, spec)
    runner.start()
    scheduler.start()
