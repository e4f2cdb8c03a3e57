"""The Redis ACL rules of a producer: what a service that submits, follows, exports and cancels may touch.

A producer may read everything of kevlaya's and RQ's, and write only: its batches' keys, the batch index,
kevlaya's RQ queues, RQ job hashes and RQ's queue set, and the quarantine (it moves a key of the wrong
type aside before it enqueues) and the notices outbox. Its only pub/sub channels are kevlaya's events
channel and its queued channel (a submit wakes idle workers). It cannot write RQ's started/finished/failed
registries, worker registrations, kevlaya's worker keys (suspect groups, worker index, stats, counters),
flush, reconfigure or shut Redis down, or publish RQ worker commands. Redis ACLs cannot scope a key to "this
producer's own batch", so a producer can still write any batch's keys, any job hash and any queue entry: the
worker treats every byte it reads as untrusted (README, "Security").
"""

from __future__ import annotations

from shared.keys import DEFAULT_PREFIX


def producer_acl_rules(password: str, *, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Arguments for `ACL SETUSER <name> ...` (one list element per rule)."""
    return [
        "on",
        f">{password}",
        "resetkeys",
        f"%R~{prefix}*",
        "%R~rq:*",
        f"~{prefix}batch:*",
        f"~{prefix}batches",
        f"~{prefix}notices",
        f"~{prefix}w:quarantine*",
        f"~{prefix}w:counter:quarantined",
        f"~rq:queue:{prefix}*",
        "~rq:job:*",
        "~rq:queues",
        "resetchannels",
        f"&{prefix}events",
        f"&{prefix}queued",
        "-@all",
        "+@read",
        "+@write",
        "+@transaction",
        "+@scripting",
        "-@dangerous",
        "-@admin",
        "-@pubsub",
        "+ping",
        "+info",
        "+subscribe",
        "+unsubscribe",
        "+publish",  # a cancel that completes a batch announces it (inside the result-writing script)
    ]
