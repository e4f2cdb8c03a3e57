"""Every place kevlaya touches RQ's internals, in one package, so the coupling is visible and tested
(tests/test_rq_contract.py pins what we rely on; pyproject pins the RQ version).

Why not RQ's own worker loop: it takes one job at a time, forks per job (unless SimpleWorker), imports
whatever function a job names, and a malformed hash can stop it. We keep RQ's data model -- queue lists,
job hashes, the started/finished/failed registries, worker registration -- and batch over it:

- take: one Lua script pops up to N ids from a queue AND registers them in the started registry
  atomically, so a crash can never leave a popped job unregistered; the same script sizes the take as this
  worker's share of the queue's tail (worker.tail) and takes it out of the idle set, so two workers taking at
  once each see the other's take whole or not at all;
- heartbeat: while a batch runs, a thread pushes the registry scores forward (ZADD XX);
- recover: a dead worker's entries go back as suspect groups (worker.recovery), in one script per group,
  so a crash of the recovering worker can neither lose nor double them.

Everything read from Redis is untrusted: ids, members, hashes and key types are checked, and what cannot
be read is quarantined (worker.quarantine) instead of raising.
"""

from worker.rqcompat.bridge import QueueFacts, RQBridge, SharedTake, SuspectTake
from worker.rqcompat.decode import RawJob, decode_job, parse_rq_time, rq_now, valid_id
from worker.rqcompat.reclaim import Abandoned

__all__ = [
    "Abandoned",
    "QueueFacts",
    "RQBridge",
    "RawJob",
    "SharedTake",
    "SuspectTake",
    "decode_job",
    "parse_rq_time",
    "rq_now",
    "valid_id",
]
