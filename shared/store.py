"""The batch record in Redis and the one way results are written to it (worker and tests alike)."""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import orjson
from redis import Redis
from redis import exceptions as redis_exceptions

from shared.errors import BAD_PAYLOAD, CANCELLED, EXPIRED, BatchNotFoundError, WrongTypeError
from shared.keys import Keys, job_id
from shared.lifecycle import batch_status
from shared.result import Result
from shared.wrongtype import expecting, is_wrong_type

DEFAULT_BATCH_TTL_S = 7 * 24 * 3600
SUBMIT_ALIVE_S = 120  # a submit that has not written for this long is taken for dead (the batch is not held open)
_READ_CHUNK = 1000

# Records one result atomically. A final result is kept only if the item has none yet (HSETNX), so a
# retried or duplicated job can never produce a second final answer; counters move only on that first write.
# An item that is not in the batch's id set (a forged job, or a batch whose keys expired) is refused (-1):
# nobody can add answers to a batch that were never asked for.
# KEYS: results, batch hash, running set, steps, id set, outbox.
# ARGV: custom_id, json, counter, now, job_id, final, follow-up ('1': this final answers an escalated item),
# batch id, events channel.
# Once every item of a batch has its final answer or error (and no submit is still writing it), announce it
# exactly once: a message on the events channel, and a notice in the outbox when the batch asked for an
# HTTP POST (workers deliver it). KEYS: batch hash, id set, outbox, submits, results. ARGV: batch id, now, events
# channel (an argument, not a key: it is no key, and ACL key patterns would refuse it). Done is the results hash's
# size, not the counters' sum (`stored_ended`): a counter some other writer changed never announced the batch.
_NOTIFY_LUA = """
local function notify_if_done(hash, ids, channel, outbox, batch, now, submits, results)
  if redis.call('TYPE', submits).ok == 'zset' and redis.call('ZCOUNT', submits, now - SUBMIT_ALIVE_S, '+inf') > 0 then
    return 0
  end
  if redis.call('TYPE', results).ok ~= 'hash' then return 0 end
  local url = redis.call('HGET', hash, 'notify_url')
  local done = redis.call('HLEN', results)
  local total = redis.call('SCARD', ids)
  if total == 0 or done < total then return 0 end
  if redis.call('HEXISTS', hash, 'notified_at') == 1 then return 0 end
  -- Every item answered, not only as many fields as items: a field no item owns (some other writer's) made the
  -- size reach the count early. Once a batch, at its end (or while such a field stands).
  for _, id in ipairs(redis.call('SMEMBERS', ids)) do
    if redis.call('HEXISTS', results, id) == 0 then return 0 end
  end
  if redis.call('HSETNX', hash, 'notified_at', now) == 0 then return 0 end
  redis.call('PUBLISH', channel, batch)
  local ot = redis.call('TYPE', outbox).ok
  if url and (ot == 'list' or ot == 'none') then
    redis.call('LPUSH', outbox, cjson.encode({batch = batch, url = url, at = now}))
  end
  return 1
end
""".replace("SUBMIT_ALIVE_S", str(SUBMIT_ALIVE_S))

# Records the results of one batch atomically, in input order (one call a batch a take: a call a result cost the
# worker ~0.1 ms of packing and parsing each). Every key is type-checked before a result's first write, and
# counters are read with tonumber() and set, so no command after a result's HSETNX can fail (a script that fails
# half-way keeps its writes). A result refused for a key of the wrong type answers its error text; the others go
# on. KEYS: as above. ARGV: now, batch id, events channel, then 6 a result: custom_id, json, counter, job_id, final,
# follow-up. Answers, a result each: 1 first of its kind, 0 not, -1 not an item of the batch, or the error text.
_RECORD_LUA = (
    _NOTIFY_LUA
    + """
local want = {'hash', 'hash', 'set', 'hash', 'set'}
-- Read once: the script's own writes only ever create these keys with the type wanted.
local types = {}
for i = 1, 5 do types[i] = redis.call('TYPE', KEYS[i]).ok end
local function bad_key(skip)
  for i = 1, 5 do
    local t = types[i]
    if i ~= skip and i ~= 3 and t ~= 'none' and t ~= want[i] then
      return 'KEVLAYA_BAD_BATCH ' .. KEYS[i] .. ' is a ' .. t
    end
  end
  return nil
end
-- The running set is bookkeeping only: of another type, it is left alone rather than costing the answer.
local running = types[3] == 'set'
local function bump(field)
  redis.call('HSET', KEYS[2], field, (tonumber(redis.call('HGET', KEYS[2], field)) or 0) + 1)
end
local now = ARGV[1]
local ttl = redis.call('PTTL', KEYS[2])
local answers, announce = {}, false
for at = 4, #ARGV, 6 do
  local cid, json, counter, job, final, followup = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4],
    ARGV[at + 5]
  local problem = bad_key(final == '1' and 4 or 1)  -- a final answer never writes the steps, a step never the results
  local first = -1
  if problem then
    first = problem
  elseif redis.call('SISMEMBER', KEYS[5], cid) == 1 then
    if final == '1' then
      first = redis.call('HSETNX', KEYS[1], cid, json)
      if first == 1 then
        bump(counter)
        redis.call('HSETNX', KEYS[2], 'first_done_at', now)
        redis.call('HSET', KEYS[2], 'last_done_at', now)
        if followup == '1' then bump('followups_done') end
        announce = true
      end
    else
      first = redis.call('HSETNX', KEYS[4], cid, json)
      if first == 1 then bump('escalated') end
    end
  end
  if not problem and running then redis.call('SREM', KEYS[3], job) end
  answers[#answers + 1] = first
end
if ttl > 0 then
  for i = 1, 4 do
    if i ~= 2 and redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], ttl) end
  end
end
if announce then
  notify_if_done(KEYS[2], KEYS[5], ARGV[3], KEYS[6], ARGV[2], tonumber(now), KEYS[7], KEYS[1])
end
return answers
"""
)

_NOTIFY_IF_DONE_LUA = (
    _NOTIFY_LUA
    + "return notify_if_done(KEYS[1], KEYS[2], ARGV[3], KEYS[3], ARGV[1], tonumber(ARGV[2]), KEYS[4], KEYS[5])\n"
)


@dataclass(frozen=True, kw_only=True)
class BatchCounts:
    total: int
    queued: int
    running: int
    finished: int
    failed: int
    escalated: int
    cancelled: int
    expired: int = 0
    followups_done: int = 0  # escalated items whose final answer exists

    @property
    def done(self) -> int:
        return self.finished + self.failed + self.cancelled + self.expired

    @property
    def awaiting_followups(self) -> int:
        """Escalated items still waiting for their follow-up's answer."""
        return max(self.escalated - self.followups_done, 0)

    def to_dict(self) -> dict[str, int]:
        return {
            "total": self.total,
            "queued": self.queued,
            "running": self.running,
            "finished": self.finished,
            "failed": self.failed,
            "escalated": self.escalated,
            "cancelled": self.cancelled,
            "expired": self.expired,
        }


@dataclass(frozen=True, kw_only=True)
class BatchRecord:
    id: str
    created_at: float
    expires_at: float
    counts: BatchCounts
    first_done_at: float | None
    last_done_at: float | None
    cancel_requested: bool
    escalate_off: bool
    window_ends_at: float | None = None  # the completion window: queued items end as `expired` after it
    cancelled_at: float | None = None
    submitting: bool = False

    @property
    def status(self) -> str:
        return batch_status(self, time.time())

    @property
    def complete(self) -> bool:
        return self.counts.done >= self.counts.total and not self.submitting

    def rate_per_s(self, now: float) -> float | None:
        """Items finalised per second since the first one, or None before two points exist."""
        if self.first_done_at is None or self.counts.done < 2:
            return None
        end = self.last_done_at if self.complete and self.last_done_at else now
        span = max(end - self.created_at, 1e-6)
        return self.counts.done / span

    def eta_s(self, now: float) -> float | None:
        rate = self.rate_per_s(now)
        if rate is None or rate <= 0:
            return None
        return max(self.counts.total - self.counts.done, 0) / rate

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "batch": self.id,
            "status": batch_status(self, now),
            "created_at": self.created_at,
            "in_progress_at": self.first_done_at,
            "completed_at": self.last_done_at if self.complete else None,
            "cancelled_at": self.cancelled_at,
            "window_ends_at": self.window_ends_at,
            "expires_at": self.expires_at,
            "complete": self.complete,
            "request_counts": {
                "total": self.counts.total,
                "completed": self.counts.finished,
                "failed": self.counts.failed + self.counts.cancelled + self.counts.expired,
            },
            "cancel_requested": self.cancel_requested,
            "counts": self.counts.to_dict(),
            "rate_per_s": self.rate_per_s(now),
            "eta_s": self.eta_s(now),
        }


def record_result(redis: Redis, keys: Keys, result: Result, *, counter: str | None = None) -> bool | None:
    """Write one job's result. Returns True if it was the item's first result of its kind, False if one
    existed already, None if the item is not part of the batch (nothing written).

    Final results go to the results hash (one per item, ever); a non-final (escalated) Laya result
    goes to the steps hash. `counter` defaults to finished/failed/cancelled from the result itself.
    """
    (outcome,) = record_results(redis, keys, [result], counter=counter)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def record_results(
    redis: Redis, keys: Keys, results: list[Result], *, counter: str | None = None
) -> list[bool | Exception | None]:
    """`record_result` for many results in one round trip (one script call a batch): per result True, False,
    None as there, or the error Redis answered for it (a batch key of the wrong type)."""
    if any(r.batch is None for r in results):
        raise ValueError("a result must name its batch")
    script = redis.register_script(_RECORD_LUA)
    now = repr(time.time())
    by_batch: dict[str, list[int]] = {}
    for i, result in enumerate(results):
        by_batch.setdefault(result.batch or "", []).append(i)
    with redis.pipeline(transaction=False) as pipe:
        for batch, members in by_batch.items():
            args = [now, batch, keys.events()]
            for i in members:
                args += _record_args(results[i], counter)
            script(keys=_record_keys(keys, batch), args=args, client=pipe)
        answers = pipe.execute(raise_on_error=False)
    out: list[bool | Exception | None] = [None] * len(results)
    for members, answer in zip(by_batch.values(), answers, strict=True):
        for i, a in zip(members, answer if isinstance(answer, list) else [answer] * len(members), strict=True):
            out[i] = _outcome(a)
    return out


def _outcome(answer: Any) -> bool | Exception | None:
    if isinstance(answer, Exception):
        return answer
    if isinstance(answer, bytes | str):
        return redis_exceptions.ResponseError(answer.decode() if isinstance(answer, bytes) else answer)
    return None if answer == -1 else bool(answer)


def _record_keys(keys: Keys, batch: str) -> list[str]:
    return [
        keys.batch_results(batch),
        keys.batch(batch),
        keys.batch_running(batch),
        keys.batch_steps(batch),
        keys.batch_item_set(batch),
        keys.outbox(),
        keys.batch_submits(batch),
    ]


def _record_args(result: Result, counter: str | None) -> list[str]:
    return [
        result.custom_id,
        result.to_json().decode(),
        counter or _counter_for(result),
        result.job_id,
        "1" if result.final else "0",
        "1" if result.escalated_from or result.not_escalated else "0",
    ]


def notify_if_done(redis: Redis, keys: Keys, batch: str) -> bool:
    """Announce the batch if it is complete and nobody has yet (a submit whose items were all answered
    before it finished writing calls this at its end)."""
    script = redis.register_script(_NOTIFY_IF_DONE_LUA)
    args = [batch, repr(time.time()), keys.events()]
    names = [
        keys.batch(batch),
        keys.batch_item_set(batch),
        keys.outbox(),
        keys.batch_submits(batch),
        keys.batch_results(batch),
    ]
    return bool(script(keys=names, args=args))


def _counter_for(result: Result) -> str:
    if result.error is None:
        return "finished"
    return result.error.type if result.error.type in (CANCELLED, EXPIRED) else "failed"


def read_batch(redis: Redis, keys: Keys, batch: str) -> BatchRecord:
    """The batch's record; its total is the size of its item set, so an item submitted twice (concurrently,
    or again after a partial failure) counts once."""
    with redis.pipeline(transaction=True) as pipe:
        queue_record_reads(pipe, keys, batch)
        raw, running, total, submits, answered, steps = pipe.execute(raise_on_error=False)
    fields = record_fields(keys, batch, raw, answered)
    ended = stored_ended(fields, answered)
    if ended is None:
        ended = recount_and_repair(redis, keys, batch)
    return batch_record(batch, fields, ended, running, total, submits, steps)


def recount_and_repair(redis: Redis, keys: Keys, batch: str) -> Counter[str]:
    """The ended items counted from the results (`recount_ended`), written back as the batch's counters where
    they then agree with the results hash (every field an item's) and no writer touched the batch, its results
    or its items meanwhile (WATCHed; else left for a later reading): counters some other writer spoiled cost one
    scan of the results, not one every status poll of a `wait`. A batch hash that is gone is not made again.
    The repair is a saving only: where it fails -- a reader that may not write (an ACL, a replica, too few
    replicas), a connection dropped while watching (which redis-py does not retry) -- the results are counted as
    before, by the client's own reads and retries."""
    record, results, items = keys.batch(batch), keys.batch_results(batch), keys.batch_item_set(batch)
    try:
        return _recount_watched(redis, record, results, items)
    except redis_exceptions.RedisError:
        return recount_ended(redis.hscan_iter(results), set(redis.sscan_iter(items)))


def _recount_watched(redis: Redis, record: str, results: str, items: str) -> Counter[str]:
    with redis.pipeline(transaction=True) as pipe:
        pipe.watch(record, results, items)
        ended = recount_ended(pipe.hscan_iter(results), set(pipe.sscan_iter(items)))
        # The record read as a hash before; gone since (HSET would make it again) or a foreign results field
        # (the counters could never agree with HLEN): nothing written.
        if pipe.type(record) != b"hash" or pipe.hlen(results) != sum(ended[n] for n in ENDED):
            return ended
        pipe.multi()
        pipe.hset(record, mapping={name: ended[name] for name in (*ENDED, "followups_done")})
        with contextlib.suppress(redis_exceptions.RedisError):  # a writer came first, or a refusal: the counts stand
            pipe.execute()
        return ended


def recount_ended(results: Iterable[tuple[bytes, bytes]], items: set[bytes]) -> Counter[str]:
    """The ended items by kind (`ended_kind`), and under "followups_done" those that count there
    (`answers_escalated`), counted from the results hash's fields of the batch's `items`: a field no item owns
    (some other writer's) counts for nothing."""
    counts: Counter[str] = Counter()
    for cid, row in results:
        if cid in items:
            stored = stored_field(cid, row)
            counts[ended_kind(stored)] += 1
            counts["followups_done"] += answers_escalated(stored)
    return counts


def queue_record_reads(pipe: Any, keys: Keys, batch: str) -> None:
    """The reads a batch record is built from, queued on a (sync or asyncio) transaction: the counters and the
    results hash they count are read at one instant, so they agree unless some other writer changed one."""
    pipe.hgetall(keys.batch(batch))
    pipe.scard(keys.batch_running(batch))
    pipe.scard(keys.batch_item_set(batch))
    pipe.zcount(keys.batch_submits(batch), time.time() - SUBMIT_ALIVE_S, "+inf")
    pipe.hlen(keys.batch_results(batch))
    pipe.hlen(keys.batch_steps(batch))


def record_fields(keys: Keys, batch: str, raw: Any, answered: Any) -> dict[str, str]:
    """The batch hash's fields as text from what `queue_record_reads` read. A record hash or results hash of another
    type is named, so the operator can move it aside (read as empty, the batch looked unanswered for good); any
    other unreadable record reads as no batch."""
    if is_wrong_type(raw):
        raise WrongTypeError(keys.batch(batch), "hash")
    if is_wrong_type(answered):
        raise WrongTypeError(keys.batch_results(batch), "hash")
    if isinstance(raw, Exception):
        raise BatchNotFoundError(f"batch {batch!r} has an unreadable record ({raw})")
    if not raw:
        raise BatchNotFoundError(f"no batch {batch!r} (never submitted, or expired)")
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}


# The counters of ended items, by how they ended (`_counter_for`). Only the results hash says what is done: one
# field an item, written once (HSETNX). The counters are its breakdown, bumped in the same script; trusted only
# while they are plain counts that add up to the hash's size. Read as written (a negative `finished`, one pushed
# past the item count, garbage or a deleted field), a batch never completed (`wait` hung) or completed early.
ENDED = ("finished", "failed", "cancelled", "expired")
_COUNT = re.compile(r"[0-9]{1,15}")  # what HINCRBY and the script's HSET write: no sign, no exponent, no spaces


def stored_ended(fields: dict[str, str], answered: int) -> dict[str, int] | None:
    """The ended-item counters when they agree with the `answered` results (HLEN); None when some other writer
    changed one: the caller counts the results instead (`ended_kind`), the one exact reading."""
    values = [fields.get(name, "0") for name in (*ENDED, "followups_done")]
    if not all(_COUNT.fullmatch(v) for v in values):
        return None
    counts = dict(zip(ENDED, map(int, values[: len(ENDED)]), strict=True))
    return counts if sum(counts.values()) == answered else None


def stored_field(field: bytes, raw: bytes) -> dict[str, Any] | None:
    """A results-hash field's stored result (`stored_result`), or None where the field or value is no result of
    an item."""
    custom_id = text_of(field)
    return None if custom_id is None else stored_result(custom_id, raw)


def ended_kind(row: dict[str, Any] | None) -> str:
    """The counter (ENDED) a stored final result (`stored_field`) counts in, as the script counted it when
    written: one no result of its item (None; `result_row` shows it as that item's `bad_payload` error) counts
    as failed."""
    if row is None:
        return "failed"
    error = row.get("error")
    if error is None:
        return "finished"
    return error["type"] if error["type"] in (CANCELLED, EXPIRED) else "failed"


def answers_escalated(row: dict[str, Any] | None) -> bool:
    """Whether a stored final result (`stored_field`) counts in `followups_done`, as the script counted it when
    written: the final answer of an item that escalated (its follow-up's, or its own answer kept when the
    follow-up was cancelled)."""
    return row is not None and bool(row.get("escalated_from") or row.get("not_escalated"))


def batch_record(
    batch: str, h: dict[str, str], ended: dict[str, int], running: Any, total: Any, submits: Any, steps: Any
) -> BatchRecord:
    """A batch's record from its fields (`record_fields`), its ended items by kind (`stored_ended`, else counted)
    and the sizes `queue_record_reads` read (a read that failed -- a key some writer gave another type -- counts
    as empty). Escalated items are the steps hash's size, which the `escalated` counter only mirrors (a forged
    one showed items still queued as `finalizing`); follow-ups done are recounted with the ended items where
    those were (`recount_ended`), else read from their counter."""
    running, total, submits, steps = (n if isinstance(n, int) else 0 for n in (running, total, submits, steps))
    finished, failed, cancelled, expired = (ended.get(name, 0) for name in ENDED)
    done = finished + failed + cancelled + expired
    running = min(int(running), max(total - done, 0))
    escalated = min(steps, total)
    counts = BatchCounts(
        total=total,
        queued=max(total - done - running, 0),
        running=running,
        finished=finished,
        failed=failed,
        escalated=escalated,
        cancelled=cancelled,
        expired=expired,
        followups_done=min(ended.get("followups_done", _num(h, "followups_done")), escalated),
    )
    return BatchRecord(
        id=batch,
        created_at=_float(h, "created_at") or 0.0,
        expires_at=_float(h, "expires_at") or 0.0,
        counts=counts,
        first_done_at=_float(h, "first_done_at"),
        last_done_at=_float(h, "last_done_at"),
        cancel_requested=h.get("cancel_requested") == "1",
        escalate_off=h.get("escalate_off") == "1",
        window_ends_at=_float(h, "window_ends_at"),
        cancelled_at=_float(h, "cancelled_at"),
        submitting=submits > 0,
    )


def _num(h: dict[str, str], name: str) -> int:
    """A count field, or 0 when it is none (negative, garbage, an exponent: some other writer's)."""
    value = h.get(name, "0")
    return int(value) if _COUNT.fullmatch(value) else 0


def _float(h: dict[str, str], name: str) -> float | None:
    """A time field, or None: NaN or an infinity some other writer left is no time (NaN compares false
    everywhere, and neither can be shown as a date)."""
    try:
        value = float(h[name]) if name in h else None
    except ValueError:
        return None
    return value if value is None or math.isfinite(value) else None


@dataclass(frozen=True)
class BatchFlags:
    cancelled: bool = False
    escalate_off: bool = False
    expired: bool = False  # its completion window has ended


def batch_flags(redis: Redis, keys: Keys, batch: str, *, now: float | None = None) -> BatchFlags:
    """What a worker must know of a batch before it runs its items, read in one round trip; all False if
    it is gone (or is not a hash: its results are then refused when written)."""
    try:
        cancel, no_escalate, window = redis.hmget(
            keys.batch(batch), ["cancel_requested", "escalate_off", "window_ends_at"]
        )
    except redis_exceptions.ResponseError:
        return BatchFlags()
    try:
        ends = float(window) if window else None
    except ValueError:
        ends = None
    now = time.time() if now is None else now
    return BatchFlags(cancel == b"1", no_escalate == b"1", ends is not None and now > ends)


def promote_step(redis: Redis, keys: Keys, batch: str, custom_id: str, *, reason: str = CANCELLED) -> bool:
    """End an item with its computed first answer when the follow-up it escalated to is cancelled or its
    batch expired (`reason`). True when the item now has a final answer (this one, or one written before);
    False when there is no readable step (the caller ends the item otherwise)."""
    try:
        raw = redis.hget(keys.batch_steps(batch), custom_id)
        if raw is None:
            return False
        step = Result.from_json(raw)
        final = replace(step, final=True, escalated_to=None, not_escalated=reason)
        return record_result(redis, keys, final) is not None
    except (orjson.JSONDecodeError, TypeError, ValueError, redis_exceptions.ResponseError):
        return False


# Reopens an item whose final result is a failure of this job, so the job's next run is recorded: the
# failure removed and uncounted, the batch to be announced again when it completes again. Cancelled and
# expired items stay closed. KEYS: results hash, batch hash. ARGV: custom_id, job id.
# The batch hash's type is checked before the first write and its counters are read with tonumber() and set (as
# `_RECORD_LUA`'s bump), so nothing after the HDEL can fail: a script that fails half-way keeps its writes, and
# HINCRBY refused any value that is no integer to Redis (the failure was gone, yet still counted). A missing counter
# stays missing (read as 0), so a batch hash that expired is not made again.
_REOPEN_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local ok, row = pcall(cjson.decode, raw)
if not ok or type(row) ~= 'table' or row['job_id'] ~= ARGV[2] then return 0 end
local err = row['error']
if type(err) ~= 'table' or err['type'] == 'cancelled' or err['type'] == 'expired' then return 0 end
local t = redis.call('TYPE', KEYS[2]).ok
if t ~= 'hash' and t ~= 'none' then return redis.error_reply('KEVLAYA_BAD_BATCH ' .. KEYS[2] .. ' is a ' .. t) end
local function drop(field)
  local v = redis.call('HGET', KEYS[2], field)
  if not v then return end
  local n = tonumber(v) or 0
  redis.call('HSET', KEYS[2], field, n >= 1 and n - 1 or 0)  -- never below zero; NaN fails n >= 1 too
end
redis.call('HDEL', KEYS[1], ARGV[1])
drop('failed')
if type(row['escalated_from']) == 'string' then drop('followups_done') end
redis.call('HDEL', KEYS[2], 'notified_at')
return 1
"""


def reopen_failed(redis: Redis, keys: Keys, batch: str, custom_id: str, job_id: str) -> bool:
    """Take back the failure `job_id` recorded for its item (it was requeued to run again: `rq requeue`).
    True if there was one; False if the item's result is not this job's failure (nothing changes)."""
    script = redis.register_script(_REOPEN_LUA)
    return bool(script(keys=[keys.batch_results(batch), keys.batch(batch)], args=[custom_id, job_id]))


def trim_indexes(redis: Redis, keys: Keys, *, batch_age_s: float, worker_age_s: float) -> None:
    """Drop batches from the index long after their keys expired, and workers long unseen. An expired batch
    stays listed for one more TTL, so a resubmit into it is refused as expired rather than starting over."""
    now = time.time()
    with contextlib.suppress(redis_exceptions.ResponseError):
        redis.zremrangebyscore(keys.batches(), "-inf", now - 2 * batch_age_s)
    with contextlib.suppress(redis_exceptions.ResponseError):
        redis.zremrangebyscore(keys.workers(), "-inf", now - worker_age_s)


def batch_state(redis: Redis, keys: Keys, batch: str) -> str:
    """'new', 'open', 'cancelled' or 'expired' (listed in the index, but its keys are gone)."""
    try:
        with redis.pipeline(transaction=False) as pipe:
            pipe.hget(keys.batch(batch), "cancel_requested")
            pipe.exists(keys.batch(batch))
            pipe.zscore(keys.batches(), batch)
            cancel, exists, listed = pipe.execute()
    except redis_exceptions.ResponseError:
        return "open"  # a wrong-typed key: the writes will say so
    if exists:
        return "cancelled" if cancel == b"1" else "open"
    return "expired" if listed is not None else "new"


def quarantine_summary(redis: Redis, keys: Keys, n: int = 5) -> dict[str, Any]:
    """How many entries workers moved aside as unreadable, and the newest few (for `kevlaya status`)."""
    try:
        total = int(redis.get(keys.counter("quarantined")) or 0)
        rows = redis.lrange(keys.quarantine(), 0, n - 1)
    except (redis_exceptions.ResponseError, ValueError):
        return {"total": 0, "recent": []}
    recent = []
    for row in rows:
        try:
            entry = orjson.loads(row)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict):  # producer-writable: any other JSON value is left out, not shown
            recent.append(entry)
    return {"total": total, "recent": recent}


def iter_export(redis: Redis, keys: Keys, batch: str) -> Iterator[dict[str, Any]]:
    """One dict per submitted item, in input order: its final result, or a pending marker.

    An escalated item carries its Laya step under `chain`, so the export shows who answered what.
    """
    read_batch(redis, keys, batch)  # raises BatchNotFoundError early
    start = 0
    while True:
        with expecting(redis, {keys.batch_items(batch): "list"}):
            ids = redis.lrange(keys.batch_items(batch), start, start + _READ_CHUNK - 1)
        if not ids:
            return
        with redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.batch_results(batch), ids)
            pipe.hmget(keys.batch_steps(batch), ids)
            finals, steps = pipe.execute(raise_on_error=False)
        if is_wrong_type(finals):  # read as no answers, every item would be exported as pending for good
            raise WrongTypeError(keys.batch_results(batch), "hash")
        # Steps of another type only lose the escalation chains; the answers are whole.
        finals, steps = (r if isinstance(r, list) else [None] * len(ids) for r in (finals, steps))
        for cid, final, step in zip(ids, finals, steps, strict=True):
            # No submit writes an id that is not UTF-8: one there is some other writer's, shown as read.
            yield _export_row(batch, cid.decode("utf-8", "replace"), final, step)
        start += _READ_CHUNK


def _export_row(batch: str, custom_id: str, final: bytes | None, step: bytes | None) -> dict[str, Any]:
    if final is None:
        row: dict[str, Any] = {"custom_id": custom_id, "pending": True}
    else:
        row = result_row(batch, custom_id, final)
    laya = None if step is None else stored_result(custom_id, step)
    if laya is not None and laya.get("job_id") != row.get("job_id"):  # not the step itself, promoted on cancel
        row["chain"] = [laya]
    return row


def text_of(raw: bytes) -> str | None:
    """`raw` as text, or None when it is not UTF-8 (no submit writes such an id or field: some other writer's)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def answers_item(batch: str, custom_id: str, answering: Any) -> bool:
    """Whether `answering` is a job id that may answer this item: its own, or a follow-up's (keys.followup_id)."""
    own = job_id(batch, custom_id)
    return isinstance(answering, str) and (answering == own or answering.startswith(f"{own}-"))


def stored_result(custom_id: str, raw: bytes) -> dict[str, Any] | None:
    """An item's stored result (or step) as a dict, or None when it is no result of this item (not UTF-8 or
    JSON, another shape, another item's): every byte in Redis is untrusted, and the readers index into these
    rows."""
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(row, dict) or row.get("custom_id") != custom_id or not isinstance(row.get("job_id"), str):
        return None
    error = row.get("error")
    if error is not None and not (
        isinstance(error, dict) and isinstance(error.get("type"), str) and isinstance(error.get("message"), str)
    ):
        return None
    if any(not isinstance(row.get(name, {}), dict) for name in ("usage", "model_version", "timing")):
        return None
    if any(not isinstance(row.get("usage", {}).get(n, 0), int) for n in ("prompt_tokens", "completion_tokens")):
        return None
    return row


def result_row(batch: str, custom_id: str, raw: bytes) -> dict[str, Any]:
    """`stored_result`, or when that is unreadable the item's `bad_payload` error, naming what was found (the
    worker's HSETNX never writes over it: this is the item's one final answer)."""
    row = stored_result(custom_id, raw)
    if row is not None:
        return row
    message = f"its stored result is unreadable ({len(raw)} bytes: {raw[:60]!r})"
    return Result.failure(
        custom_id=custom_id,
        model="",
        job_id=job_id(batch, custom_id),
        batch=batch,
        error_type=BAD_PAYLOAD,
        message=message,
    ).to_dict()
