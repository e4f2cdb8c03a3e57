"""How several workers on one Redis share the tail of a queue (`kevlaya worker --gpus`, `--scale worker=N`).

While a queue holds a full take for everyone, each worker takes its full take. Near the end, one worker taking
a full take while another sits idle makes the drain wait for that one batch; so a take is split with the
workers that are between takes right now (each about to take too): `ceil(depth / (1 + idle peers))`.

Busy peers are not counted, on purpose: sizing by the queue's depth alone (`ceil(depth / N)` for N workers)
halves the rest at every take -- 300 rows left become takes of 150, 75, 38, ... while a decode batch costs
nearly the same for 40 rows as for 256 -- which simulated 1.45x, not 2x, for two workers over 4,000 jobs.
Counting idle peers never halves behind a busy worker: it takes what it can, and the peer that frees up
next takes the rest.

The rule is applied where the take happens, in the take's Lua script (worker.rqcompat.scripts), with the queue's
depth and the idle set as they are at that instant; taking rows leaves the idle set in that same step. This
function stays the rule's one definition: the script mirrors it, and tests/test_supervisor.py checks they agree.
"""

from __future__ import annotations


def tail_take(capacity: int, depth: int, *, idle_peers: int) -> int:
    """Rows to take from a queue of `depth` with `capacity` rows a take, sharing with `idle_peers` workers."""
    if capacity <= 0 or idle_peers <= 0 or depth >= capacity * (1 + idle_peers):
        return capacity
    return max(1, -(-depth // (1 + idle_peers)))
