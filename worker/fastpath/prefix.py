"""A prompt prefix every row of a take shares, run through the layers once instead of once per row.

A model's chat template puts the same tokens before every prompt -- its system part: ~20 tokens of Laya's, ~45 of
Kev's -- ~8-11% of a take's prompt tokens. Where every row of a take starts with the same tokens (at least
`MIN_TOKENS`, all rows on one adapter), prefill runs those tokens once, as a one-row chunk in each layer, and the
rows only from where they differ: each chunk's attention reads the prefix's keys and values before its own (a
causal mask aligned to the bottom right: a row's token at suffix position s sees the prefix and the suffix up to
s), and a generation take's cache gets the prefix's K/V in every row's columns, as though each row had run it.

A prefix once made is kept (`PrefixCache`, a few per prefill, ~28 KiB a token for a Qwen2.5-1.5B shape): the next
takes with the same one run only their rows' own tokens, and not even the prefix's ~15 launches a layer. What a
take's rows have in common may run past the template ("Case 1" of rows numbered 100-199): a new prefix is cut
back to what it shares with a kept one of its adapter where that is `MIN_TOKENS` or more, and a kept one serving
the rows is used unless theirs is `MIN_TOKENS` longer, so takes settle on the template's part after a take or
two instead of making one prefix each. The weights a prefix was made on are the loop's, which do not change
after it is built.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

log = logging.getLogger("kevlaya.fastpath")

# The fewest shared tokens worth a prefix pass: fewer save less than its own layer steps cost on the host.
MIN_TOKENS = 16
# The least share of a take's prompt tokens a prefix must be to be run once: below it a chunk seldom runs fewer
# row blocks (prefill's matmuls run at multiples of 256 rows) while each layer step still copies the prefix's K/V
# before its own (Kev's 44 tokens before 1,024-token prompts, ~4%, ran 3% slower on the H200).
MIN_SHARE = 0.05
# Prefixes kept per prefill (least recently used dropped): one per model template and adapter, and a few more;
# at most `KEPT_TOKENS` tokens together: their K/V sit outside the memory plan (~28 KiB a token for a
# Qwen2.5-1.5B shape: ~28 MiB at most, within the allocator headroom every take keeps).
KEPT = 8
KEPT_TOKENS = 1024
# The most tokens a prefix holds (the rows run the rest of what they share themselves).
MAX_TOKENS = 512


class Row(Protocol):
    @property
    def ids(self) -> Sequence[int]: ...

    @property
    def adapter(self) -> str | None: ...


@dataclass(frozen=True)
class Suffix:
    """A row's tokens after the shared prefix: what prefill chunks and pads."""

    ids: Sequence[int]
    adapter: str | None


@dataclass
class SharedPrefix:
    """The shared tokens, their adapter, and per layer (filled layer by layer by the take that makes it) the
    keys after rotary and the values, each (1, kv_heads, length, head_dim). Mutable while it is being made:
    `hidden` carries its states from one layer to the next (None once made, or before its first layer)."""

    ids: tuple[int, ...]
    adapter: str | None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    hidden: tuple[torch.Tensor, torch.Tensor] | None = None  # (residual stream, next layer's normed input)

    @property
    def length(self) -> int:
        return len(self.ids)

    def made(self, layers: int) -> bool:
        return len(self.kv) == layers

    def serves(self, rows: Sequence[Row]) -> bool:
        """Whether every row is on this prefix's adapter and has it, with at least one token after it."""
        n = self.length
        return all(r.adapter == self.adapter and len(r.ids) > n and tuple(r.ids[:n]) == self.ids for r in rows)


def common_prefix(rows: Sequence[Row], min_tokens: int, most: int | None = None) -> tuple[int, ...] | None:
    """The tokens every row starts with (at most `most` of them), leaving each row at least one of its own; None
    where they are fewer than `min_tokens` or the rows are on more than one adapter."""
    if not rows or len({r.adapter for r in rows}) > 1:
        return None
    common = min(len(r.ids) for r in rows) - 1
    if most is not None:
        common = min(common, most)
    first = tuple(rows[0].ids[:common])
    for r in rows[1:]:
        if common < min_tokens:
            return None
        ids = r.ids
        if tuple(ids[:common]) != first[:common]:
            common = next(k for k in range(common) if ids[k] != first[k])
    return first[:common] if common >= min_tokens else None


class PrefixCache:
    """The prefixes made so far (least recently used dropped past `KEPT` of them or `KEPT_TOKENS` tokens), and
    which one a take's rows share."""

    def __init__(self, min_tokens: int = MIN_TOKENS, kept: int = KEPT, min_share: float = MIN_SHARE) -> None:
        self.min_tokens = min_tokens  # 0: no sharing
        self.min_share = min_share
        self.kept = kept
        self._made: OrderedDict[tuple[str | None, tuple[int, ...]], SharedPrefix] = OrderedDict()
        self.made = 0  # prefixes made so far (each one a pass through the layers: a benchmark figure)

    def for_rows(self, rows: Sequence[Row], layers: int) -> SharedPrefix | None:
        """The longest kept prefix the rows share, or a new one of what they have in common (made by the take;
        rows of two or more), or None (sharing off, too few tokens in common or too small a share of the rows'
        tokens, or several adapters)."""
        if self.min_tokens <= 0:
            return None
        prefix = self._for_rows(rows, layers)
        if prefix is None or prefix.length * len(rows) < self.min_share * sum(len(r.ids) for r in rows):
            return None
        key = (prefix.adapter, prefix.ids)
        if key in self._made:
            self._made.move_to_end(key)
        return prefix

    def _for_rows(self, rows: Sequence[Row], layers: int) -> SharedPrefix | None:
        kept = [p for p in self._made.values() if p.made(layers) and p.serves(rows)]
        best = max(kept, key=lambda p: p.length, default=None)
        common = common_prefix(rows, self.min_tokens, MAX_TOKENS) if len(rows) > 1 else None
        if common is None or (best is not None and len(common) < best.length + self.min_tokens):
            return best
        ids = self._settled(common, rows[0].adapter)
        if best is not None and len(ids) <= best.length:
            return best
        return self._made.get((rows[0].adapter, ids)) or SharedPrefix(ids=ids, adapter=rows[0].adapter)

    def _settled(self, common: tuple[int, ...], adapter: str | None) -> tuple[int, ...]:
        """`common` cut back to where it parts from a kept prefix of `adapter`, where they share `min_tokens` or
        more before that (the part every take shares, not what one take's rows happen to share beyond it)."""
        best = common
        for p in self._made.values():
            if p.adapter != adapter:
                continue
            n = next(
                (k for k, (a, b) in enumerate(zip(common, p.ids, strict=False)) if a != b), min(len(common), p.length)
            )
            if self.min_tokens <= n < min(len(best), p.length):  # where they part (one that serves is longer)
                best = common[:n]
        return best

    def keep(self, prefix: SharedPrefix, layers: int) -> None:
        """Keep a prefix a take has made through every layer (a take that failed half-way made none)."""
        if not prefix.made(layers):
            return
        prefix.hidden = None
        key = (prefix.adapter, prefix.ids)
        if key not in self._made:
            self.made += 1
            log.info(
                "prefill: made a prefix of %d tokens every row of a take shares (%s), kept for the next takes",
                prefix.length, prefix.adapter or "base",
            )  # fmt: skip
        self._made[key] = prefix
        self._made.move_to_end(key)
        while len(self._made) > self.kept or sum(p.length for p in self._made.values()) > KEPT_TOKENS:
            self._made.popitem(last=False)

    def __len__(self) -> int:
        """How many prefixes are kept (their K/V held on the device)."""
        return len(self._made)

    def clear(self) -> None:
        """Let every kept prefix go (their K/V are memory the planner does not count: handed back with the pool)."""
        self._made.clear()


def suffixes(rows: Sequence[Row], prefix: SharedPrefix | None) -> Sequence[Row]:
    """Each row's tokens after `prefix` (the rows themselves without one)."""
    if prefix is None:
        return rows
    n = prefix.length
    return [Suffix(ids=r.ids[n:], adapter=r.adapter) for r in rows]
