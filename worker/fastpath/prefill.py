"""Prefill: the prompts' K/V into the static cache, by the loop's own layer code, in chunks of similar length.

Rows are grouped by prompt length into chunks of about `tokens` tokens (bounding activation memory), each
right-padded only to its own longest prompt, so causal attention needs no mask and SDPA runs its flash kernel;
K/V go straight into the cache, every row's prompt ending in the same column (`width`). A single-adapter chunk
runs with its LoRA merged into the dequantised weights. Should the loop's own prefill ever fail on a device,
the model's own forward takes over from then on (with a log line).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from worker.fastpath.graphs import KV
from worker.fastpath.ops import prefill_attention, repeat_kv
from worker.fastpath.weights import Masks, Stack

log = logging.getLogger("kevlaya.fastpath")

AdapterSelect = Callable[[Sequence[str | None]], contextlib.AbstractContextManager[dict[str, Any]]]


class PromptRow(Protocol):
    """What prefill needs of a row: its prompt's token ids and its adapter (None: the base model)."""

    @property
    def ids(self) -> Sequence[int]: ...

    @property
    def adapter(self) -> str | None: ...


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the GPU: a plain `.to("cuda")` synchronises the stream,
    so each prefill chunk's inputs would wait for the previous chunk's kernels to finish."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (1 = real token), each row left-padded to `width` (default: the longest),
    so every row's last prompt token sits in the same column."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return to_device(ids, device), to_device(mask, device)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as HF's generate derives them from the attention mask."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def adapter_mask(rows: Sequence[PromptRow], name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows, 1, 1): 1 where the row uses adapter `name`, else 0 -- multiplies that adapter's LoRA delta."""
    sel = [1.0 if r.adapter == name else 0.0 for r in rows]
    return to_device(torch.tensor(sel, dtype=dtype), device).view(-1, 1, 1)


def row_masks(part: Sequence[PromptRow], dtype: torch.dtype, device: torch.device) -> Masks:
    """LoRA selection for rows run together: no masks when every row uses one adapter (PEFT's arithmetic),
    else a 0/1 row mask per adapter."""
    names = {r.adapter for r in part}
    adapters = sorted(a for a in names if a is not None)
    if len(names) == 1:
        return [(name, None) for name in adapters]
    return [(name, adapter_mask(part, name, dtype, device)) for name in adapters]


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk: its rows of the batch (a slice, or an index tensor) and where their K/V go."""

    where: slice | torch.Tensor
    ids: torch.Tensor  # (rows, span) right-padded prompt tokens
    rows: torch.Tensor  # (rows, 1) the batch rows, for the cache writes
    columns: torch.Tensor  # (rows, span) the cache column of each token
    last: torch.Tensor  # (rows,) each row's last prompt token
    masks: Masks


class Prefill:
    """Prompts into a static cache; `run` returns each row's first-token logits (float32)."""

    def __init__(self, model: Any, stack: Stack, *, tokens: int = 4096, merge_lora: bool = True) -> None:
        self.model = model  # what the fallback calls (the PEFT wrapper, so adapters apply)
        self.stack = stack
        self.tokens = tokens  # about this many prompt tokens per chunk
        # Prefill a single-adapter chunk with its (fused) LoRA merged into the dequantised weights.
        self.merge_lora = merge_lora
        self.own = True  # False: prefill through the model's forward (after a failure, or to compare)

    def run(
        self,
        kv: KV,
        rows: Sequence[PromptRow],
        *,
        width: int,
        out_rows: int,
        pad_id: int,
        select: AdapterSelect,
    ) -> torch.Tensor:
        """The prompts' K/V into `kv` (each row's prompt ending in column `width - 1`); returns the first tokens'
        logits (out_rows, vocab) in float32 (rows past `len(rows)` stay zero)."""
        stack = self.stack
        logits = torch.zeros(out_rows, stack.head.out_features, dtype=torch.float32, device=stack.device)
        if self.own:
            try:
                with prefill_attention(stack.device):
                    self.own_layers(kv, rows, width, pad_id, logits)
                return logits
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                log.exception("fast path: the loop's own prefill failed; using the model's forward from now on")
                self.own = False
        chunk = max(1, self.tokens // max(1, width))
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            ids, mask = left_pad([r.ids for r in part], pad_id, stack.device, width)  # the whole batch's width
            where = slice(start, start + len(part))
            logits[where] = self.through_model(kv, where, part, ids, mask, select)
        return logits

    def chunks(self, rows: Sequence[PromptRow], width: int, pad_id: int) -> list[Chunk]:
        """Rows grouped by prompt length into chunks of about `tokens` tokens, each right-padded only to its own
        longest prompt: causal attention then needs no mask (a real token never sees the padding after it), so
        SDPA runs its flash kernel with grouped-query heads as they are."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
        groups: list[list[int]] = [[]]
        for i in order:  # ascending: the newcomer is the longest of its group
            if groups[-1] and (len(groups[-1]) + 1) * len(rows[i].ids) > self.tokens:
                groups.append([])
            groups[-1].append(i)
        return [self._chunk(rows, group, width, pad_id) for group in groups]

    def _chunk(self, rows: Sequence[PromptRow], group: list[int], width: int, pad_id: int) -> Chunk:
        device = self.stack.device
        lengths = [len(rows[i].ids) for i in group]
        span = max(lengths)
        ids = torch.full((len(group), span), pad_id, dtype=torch.long)
        # Where each token's K/V goes: a row's real tokens right-aligned at the batch width (where its decode
        # mask expects them), its padding into its own masked columns on the left (distinct slots, never read).
        columns = torch.empty((len(group), span), dtype=torch.long)
        steps = torch.arange(span)
        for j, (i, n) in enumerate(zip(group, lengths, strict=True)):
            ids[j, :n] = torch.tensor(rows[i].ids, dtype=torch.long)
            columns[j] = torch.where(steps < n, width - n + steps, steps - n)
        contiguous = group == list(range(group[0], group[0] + len(group)))
        index = to_device(torch.tensor(group)[:, None], device)
        return Chunk(
            where=slice(group[0], group[0] + len(group)) if contiguous else index[:, 0],
            ids=to_device(ids, device),
            rows=index,
            columns=to_device(columns, device),
            last=to_device(torch.tensor(lengths) - 1, device),
            masks=row_masks([rows[i] for i in group], self.stack.dtype, device),
        )

    def own_layers(self, kv: KV, rows: Sequence[PromptRow], width: int, pad_id: int, logits: torch.Tensor) -> None:
        """Each chunk through the decoder layers as HF computes them (same modules, same LoRA arithmetic as
        PEFT), without PEFT's per-module Python or a dynamic cache to copy from: K/V go straight into the
        static cache, and 4-bit weights are dequantised by one op instead of bitsandbytes' Python path."""
        s = self.stack
        for c in self.chunks(rows, width, pad_id):
            h = s.embed(c.ids)
            count, span = c.ids.shape
            positions = torch.arange(span, device=s.device).expand(count, span)
            cos, sin = s.rotary(h, positions)
            x = s.ops.norm(s.layers[0].norm1, h)
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(s.layers, kv, strict=True)):
                merged = layer.merged(c.masks) if self.merge_lora else None
                dense, masks = (merged, []) if merged is not None else (layer.dense(), c.masks)
                q, k, v = s.qkv(layer, x, masks, cos, sin, dense)
                # (rows, kv_heads, span, D) -> the cache's (rows, span) slots: advanced indices put those first.
                k_cache[c.rows, :, c.columns] = k.transpose(1, 2)
                v_cache[c.rows, :, c.columns] = v.transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q, repeat_kv(k, s.groups), repeat_kv(v, s.groups), is_causal=True, scale=layer.scaling
                )
                attn = out.transpose(1, 2).reshape(count, span, s.heads * s.head_dim)
                h, x = s.rest(layer, h, attn, masks, s.next_norm(i), dense)
            last = x[torch.arange(count, device=s.device), c.last]
            logits[c.where] = s.head(last).float()

    def through_model(
        self,
        kv: KV,
        where: slice,
        part: Sequence[PromptRow],
        ids: torch.Tensor,
        mask: torch.Tensor,
        select: AdapterSelect,
    ) -> torch.Tensor:
        """One chunk through the model's own forward (PEFT selects the adapters); its cache copied over."""
        with select([r.adapter for r in part]) as kwargs:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions_of(mask),
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        width = ids.shape[1]
        for (k_cache, v_cache), (keys, values) in zip(kv, cache_layers(out), strict=True):
            k_cache[where, :, :width].copy_(keys)
            v_cache[where, :, :width].copy_(values)
        return out.logits[:, -1].float()


def cache_layers(out: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a forward pass's cache, across transformers 4.5x-5.x names."""
    cache = getattr(out, "cache", None) or out.past_key_values
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            yield layer.keys, layer.values
    else:
        yield from zip(cache.key_cache, cache.value_cache, strict=True)
