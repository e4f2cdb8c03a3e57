"""The process's memory as the driver sees it: what the budget bounds, and what is left of it for a take.

`--memory-budget` bounds the whole worker process as the driver reports it (what `nvidia-smi` shows): the CUDA
context, kernels loaded into it (torch.compile'd, cuBLAS, flash attention), workspaces, graph pools, the KV
pool, weights and activations. torch's allocator cap only bounds what the allocator holds, so the measured gap
between the driver's figure and the allocator's -- the part outside it -- is taken off the budget before the
cap is set (measured at start, and again after the warm-up has loaded the kernels). Without a budget, the
default is the whole GPU minus `DEFAULT_MARGIN_BYTES`.

A take is then planned from what is actually left under the cap: everything the allocator holds counts --
weights, captured graphs' pool, cached tensors, the KV pool. A take whose cache the pool holds reuses it (its
rows' KV costs nothing new, the rest of the pool is not free either); a larger one replaces it
(`worker.memory.BatchPlan.take_bytes`).
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from worker.fastpath import ROW_BUCKETS, StaticDecoder, length_bucket
from worker.fastpath.decoder import sampler_slots
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.memory import (
    DTYPE_BYTES,
    MIB,
    RESERVE_BYTES,
    BatchPlan,
    ModelShape,
    plan_batch,
    prefill_chunk_tokens_within,
)

if TYPE_CHECKING:
    from worker.loading import LoadedBase

log = logging.getLogger("kevlaya.planner")

DEFAULT_MARGIN_BYTES = 512 * MIB  # without --memory-budget: the GPU's total minus this
# Kept free under the allocator cap for fragmentation (blocks cached but not of a reusable size). The context
# and other memory outside the allocator are measured, not guessed: this is only the allocator's own slack.
ALLOCATOR_SLACK_BYTES = 256 * MIB


@dataclass(frozen=True, kw_only=True)
class ProcessMemory:
    """One reading of the process's GPU memory."""

    driver_bytes: int  # the process as the driver reports it (NVML; device-wide used memory where unavailable)
    reserved_bytes: int  # what torch's caching allocator holds
    per_process: bool  # False: `driver_bytes` is the device's used memory (other processes included)

    @property
    def outside_allocator_bytes(self) -> int:
        """Context, loaded kernels, library workspaces: the driver's figure beyond the allocator's."""
        return max(0, self.driver_bytes - self.reserved_bytes)


def driver_bytes(device: torch.device) -> tuple[int, bool]:
    """This process's GPU memory as the driver reports it, and whether the figure is per process (NVML) or the
    device's whole used memory (`cudaMemGetInfo`, when NVML is missing or cannot name this process)."""
    try:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = device.index or 0
        if visible:
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory), True
    except Exception:  # no NVML, another PID namespace, a UUID in CUDA_VISIBLE_DEVICES: the device-wide figure
        pass
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free), False


def measure(device: torch.device) -> ProcessMemory:
    torch.cuda.synchronize(device)
    used, per_process = driver_bytes(device)
    return ProcessMemory(
        driver_bytes=used, reserved_bytes=int(torch.cuda.memory_reserved(device)), per_process=per_process
    )


def default_budget(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory) - DEFAULT_MARGIN_BYTES


def set_allocator_cap(device: torch.device, cap_bytes: int) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, cap_bytes / total)), device)


def held_bytes(device: torch.device) -> int:
    """What the allocator holds that no new allocation can use: every segment still in use after the cached
    free ones are handed back -- weights, the KV pool, and the captured graphs' shared pool (the decode graphs
    capture into one pool, since only one replays at a time: it holds about the largest step's activations,
    not one set per graph, and `MAX_GRAPHS` bounds the graphs' own buffers). Handing the cache back is
    load-bearing, not tidiness: with the free segments kept cached, long-lived tensors made later (a take's
    KV pool, graph states) were placed inside large cached segments and pinned them whole (nightly-2000's Kev
    takes were planned at 120 rows instead of 186, bench/RESULTS.md, nineteenth session)."""
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


class MemoryBudget:
    """The engine's memory accounting against the whole process's budget: set up at start, looked at again
    before each take (`refresh`), read by every plan."""

    def __init__(self, device: torch.device, total_bytes: int | None) -> None:
        self.device = device
        self.total_bytes = total_bytes  # the whole process (CUDA default: the GPU's total minus a margin)
        self.outside_allocator_bytes = 0  # CUDA: context, kernels, workspaces (measured)
        self.held_bytes: int | None = None  # CUDA: what the allocator holds (KV pools included), at the last look
        # CUDA: of that, what no new allocation can use at the last look -- the decode graphs' private pool
        # (blocks a capture freed stay the graph's), free pieces of segments live tensors hold.
        self.pooled_bytes = 0
        self.resident_bytes = 0  # the loaded models (see `count_resident`)
        self._earlier_peak_bytes = 0  # CUDA: the allocator's peak before the current take's (`take_started`)
        self._marked_peak_bytes = 0  # CUDA: the same since the last `mark`
        self._retries_at_take = 0  # CUDA: the allocator's retries before the current take's

    def start(self) -> None:
        """CUDA: the context exists before the memory outside torch is measured; the allocator capped; the peak
        we report is this engine's, not a build's."""
        if self.device.type != "cuda":
            return
        torch.zeros(1, device=self.device)
        if self.total_bytes is None:
            self.total_bytes = default_budget(self.device)
        self.cap_allocator("start")
        torch.cuda.reset_peak_memory_stats(self.device)

    def count_resident(self, models: Iterable[Any]) -> None:
        """What the loaded models hold (CUDA: everything allocated now)."""
        if self.device.type == "cuda":
            self.resident_bytes = self.allocated_bytes()
        else:
            self.resident_bytes = sum(m.get_memory_footprint() for m in models)

    def cap_allocator(self, when: str) -> None:
        """The allocator's cap: the budget minus what the driver counts outside the allocator, as measured now."""
        reading = measure(self.device)
        self.outside_allocator_bytes = reading.outside_allocator_bytes
        assert self.total_bytes is not None
        cap = self.total_bytes - self.outside_allocator_bytes
        set_allocator_cap(self.device, cap)
        log.info(
            "memory (%s): budget %d MiB for the whole process; %d MiB outside torch's allocator (context, kernels, "
            "workspaces; %s); allocator capped at %d MiB",
            when, self.total_bytes // MIB, self.outside_allocator_bytes // MIB,
            "this process per NVML" if reading.per_process else "the device's used memory: NVML unavailable",
            cap // MIB,
        )  # fmt: skip

    def refresh(self) -> None:
        """Look again at what the allocator holds (CUDA), so the next plans count what is resident now: weights,
        captured graphs' pool, the KV pools, anything cached."""
        if self.device.type != "cuda":
            return
        self.held_bytes = held_bytes(self.device)
        self.pooled_bytes = max(0, self.held_bytes - self.allocated_bytes())
        # Kernels for new shapes (flash attention, cuBLAS) load into the context as batches come: the measured
        # H200 process grew past the budget by 10 MiB with the cap set only at start and after the warm-up.
        outside = measure(self.device).outside_allocator_bytes
        if outside > self.outside_allocator_bytes:
            self.cap_allocator("grown")

    @property
    def plannable_bytes(self) -> int:
        """What a plan may spend in all: the budget less what lies outside the allocator."""
        return (self.total_bytes or (1 << 62)) - self.outside_allocator_bytes

    @property
    def planned_resident_bytes(self) -> int:
        return self.held_bytes if self.held_bytes is not None else self.resident_bytes

    @property
    def reserve_bytes(self) -> int:
        return ALLOCATOR_SLACK_BYTES if self.device.type == "cuda" else RESERVE_BYTES

    def plan(
        self,
        base: LoadedBase,
        *,
        input_tokens: int,
        new_tokens: int,
        sampled_rows: int,
        max_rows: int,
        decoder: StaticDecoder | None,
        released: bool = False,
        logprob_rows: int = 0,
        scoring: bool = False,
        one_adapter: bool = False,
    ) -> BatchPlan:
        """How many rows of `input_tokens` + `new_tokens` fit what is left of the budget, `sampled_rows` of them
        sampled (their draws need memory of their own) and `logprob_rows` reporting log-probabilities, on the
        base's static loop (`decoder`) or HF's path.
        `released`: as though the loop's KV pool and graphs were released first (the graphs' memory, not
        measured apart, still counted).
        `scoring`: rows scoring `new_tokens` choice tokens inside the loop's prefill (no cache of their own).
        `one_adapter`: every row on one adapter (or none), its prefill holding one layer's weights at a time."""
        decoder = decoder if new_tokens > 0 else None
        # The KV pool and the graphs' pool are part of the held figure only where that was measured (CUDA).
        measured = decoder is not None and self.held_bytes is not None
        held_pool_bytes = decoder.pool.nbytes if measured else 0
        graph_rows = decoder.graph_rows if measured and not released else 0
        # A take that captures into a fresh pool sets aside what such a pool held past the plan's step terms.
        readings = decoder.pool_readings if measured and not graph_rows else None
        resident = self.planned_resident_bytes - (held_pool_bytes if released else 0)
        pool_bytes = 0 if released else held_pool_bytes
        plan = plan_batch(
            base.shape,
            budget_bytes=self.plannable_bytes,
            resident_bytes=resident,
            reserve_bytes=self.reserve_bytes,
            input_tokens=input_tokens,
            new_tokens=new_tokens,
            dtype_bytes=DTYPE_BYTES[base.spec.compute_dtype],
            max_rows_cap=max_rows,
            # The static loop prefills in chunks and keeps a cache of whole length buckets.
            prefill_chunk_tokens=decoder.prefill_tokens if decoder else None,
            cache_tokens=length_bucket(input_tokens + new_tokens) if decoder else None,
            flash_prefill=decoder is not None and decoder.own_prefill,
            prefill_group_tokens=decoder.prefill_group_tokens if decoder is not None and decoder.own_prefill else None,
            sampler_slots=sampler_slots(sampled_rows) if decoder else 0,
            choice_chunk_rows=CHOICE_CHUNK_ROWS if decoder else None,
            kv_pool_bytes=pool_bytes,
            graph_rows=graph_rows,
            graph_row_slack=decoder.graphs.reuse_slack if decoder else 1.0,
            logprob_rows=logprob_rows,
            scored_in_prefill=scoring and decoder is not None,
            one_adapter=one_adapter,
            pool_readings=readings,
        )
        if released:
            plan = replace(plan, released=True)
        if decoder is None or scoring or plan.max_rows in ROW_BUCKETS:
            return plan  # scored rows run in no graph: no bucket to pad to
        # Rows are padded up to a bucket: plan the largest bucket that fits, not a size padded past the plan.
        return replace(plan, max_rows=max((b for b in ROW_BUCKETS if b <= plan.max_rows), default=plan.max_rows))

    def prefill_chunk_room(self, shape: ModelShape, held_tokens: int, *, dtype_bytes: int) -> int | None:
        """CUDA: the prompt tokens a chunk of the loop's own prefill may hold now (`prefill_chunk_tokens_within`),
        in what the allocator may still take under its cap: its slack kept, and what it holds that no new
        allocation can use counted as taken: everything it holds cached now, free pieces of segments included,
        and never less than at the last `refresh` (`pooled_bytes`: the graphs' pool above all). Cached pieces
        are counted whole because a larger chunk's transients need large blocks, and the pieces left after the
        refresh by the take's own staging (its KV and logits placed among transients) did not hold them: on
        the H100 edge workloads, counting only the refresh's figure upsized Laya chunks to 8,192 tokens that
        then failed a 280 MiB allocation with ~1 GiB cached in pieces. Asked as a take's prefill starts, with
        its KV and logits allocated: the plan set aside a chunk of the loop's `prefill_tokens` for it (never
        less is run), and a take planned below the budget leaves more (the estimates carry margins; a take may
        hold fewer rows than fit). Elsewhere None."""
        if self.device.type != "cuda":
            return None
        allocated = self.allocated_bytes()
        cached = max(self.pooled_bytes, int(torch.cuda.memory_reserved(self.device)) - allocated)
        free = self.plannable_bytes - self.reserve_bytes - allocated - cached
        return prefill_chunk_tokens_within(shape, free, held_tokens=held_tokens, dtype_bytes=dtype_bytes)

    def allocated_bytes(self) -> int:
        """CUDA: what live tensors hold now (0 elsewhere)."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def process_bytes(self) -> int | None:
        """CUDA: the process now, as the driver reports it."""
        return measure(self.device).driver_bytes if self.device.type == "cuda" else None

    def peak_bytes(self) -> int:
        """Peak GPU memory allocated (CUDA), else the process's peak resident set size."""
        if self.device.type == "cuda":
            return max(self._earlier_peak_bytes, int(torch.cuda.max_memory_allocated(self.device)))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def take_started(self) -> None:
        """CUDA: the allocator's peak starts afresh for a take (`take_peak`); the engine's peak and the peak
        since the last `mark` are kept."""
        if self.device.type == "cuda":
            self._marked_peak_bytes = self.peak_since_mark()
            self._restart_peak()
            self._retries_at_take = alloc_retries(self.device)

    def mark(self) -> None:
        """CUDA: start a window for `peak_since_mark` (a benchmark's run of several takes)."""
        if self.device.type == "cuda":
            self._marked_peak_bytes = 0
            self._restart_peak()

    def _restart_peak(self) -> None:
        """torch's peak statistic reset, the engine's peak kept."""
        self._earlier_peak_bytes = self.peak_bytes()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_since_mark(self) -> int:
        """CUDA: the most allocated since `mark`, across the takes in between (0 elsewhere)."""
        if self.device.type != "cuda":
            return 0
        return max(self._marked_peak_bytes, int(torch.cuda.max_memory_allocated(self.device)))

    def take_peak(self) -> TakePeak | None:
        """CUDA: what the take since `take_started` allocated at its peak, beside the most the allocator may hold:
        a plan's honesty, take by take (a take of as many rows as planned that peaks far below the cap was
        planned too cautiously; one that needed the allocator's slack, too boldly)."""
        if self.device.type != "cuda":
            return None
        return TakePeak(
            peak_bytes=int(torch.cuda.max_memory_allocated(self.device)),
            reserved_peak_bytes=int(torch.cuda.max_memory_reserved(self.device)),
            cap_bytes=self.plannable_bytes,
            retries=alloc_retries(self.device) - self._retries_at_take,
        )


def alloc_retries(device: torch.device) -> int:
    """How many times the allocator, refused memory under the cap, handed its cached blocks back and tried again:
    each a device synchronisation (the host waits for the GPU to finish), none an error."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


@dataclass(frozen=True, kw_only=True)
class TakePeak:
    peak_bytes: int  # allocated at the take's peak (weights, pools and everything else resident included)
    reserved_peak_bytes: int  # what the allocator held at its peak (the cap applies to this: blocks, cached ones)
    cap_bytes: int  # the allocator's cap: the budget less what lies outside the allocator
    retries: int  # the allocator's retries under the cap during the take (`alloc_retries`)

    @property
    def headroom_bytes(self) -> int:
        return self.cap_bytes - self.peak_bytes
