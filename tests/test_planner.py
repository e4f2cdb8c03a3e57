"""The memory plan never plans a take past the budget, counts what is held, and an OOM is counted loudly."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.job import Job
from tests.conftest import tiny_config
from worker.engine import Engine
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.memory import MIB, RESERVE_BYTES, SAFETY_FACTOR

# Spare bytes that leave the tiny model rows beside the prefill's chunk and its held hidden states (what the rows'
# prompts pad to, up to a group: 32,768 tokens x 528 bytes in float32, ~17 MiB), and few enough that the plan is
# below its row cap.
ROOM = 30 * MIB


@pytest.fixture(scope="module")
def engine(tiny_models: Path) -> Engine:
    return Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static")


@pytest.mark.parametrize("spare_mib", [0, 1, 3, 8, 40])
def test_no_plan_passes_a_small_budget(engine: Engine, spare_mib: int) -> None:
    """Across prompt and answer lengths, and for generation as for scoring (new tokens = choice tokens): the
    planned rows' KV and per-row costs, plus the prefill chunk reserved up front, stay inside the budget left
    after what is resident and the reserve."""
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + spare_mib * MIB
    try:
        for model in ("kev", "laya"):
            for inputs in (1, 7, 64, 300, 512):
                for new in (1, 12, 48, 200):
                    plan = engine.plan(model, input_tokens=inputs, new_tokens=new)
                    left = engine.memory.total_bytes - engine.memory.resident_bytes - RESERVE_BYTES
                    assert plan.free_bytes <= left
                    assert plan.max_rows * plan.bytes_per_row <= max(0, plan.free_bytes), (model, inputs, new)
            if spare_mib == 0:
                assert engine.plan(model, input_tokens=64, new_tokens=12).max_rows == 0
    finally:
        engine.memory.total_bytes = None


@pytest.mark.parametrize("spare_mib", [0, 1, 3, 8, 40])
def test_no_scoring_plan_passes_a_small_budget(engine: Engine, spare_mib: int) -> None:
    """Rows scored inside the prefill, across prompt and choice lengths: a take of the planned rows stays inside
    the budget left after what is resident and the reserve (none where the chunk and a group do not fit)."""
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + spare_mib * MIB
    try:
        for inputs in (1, 7, 64, 300, 512):
            for choices in (1, 12, 48):
                plan = engine.plan("laya", input_tokens=inputs, new_tokens=choices, scoring=True)
                left = engine.memory.total_bytes - engine.memory.resident_bytes - RESERVE_BYTES
                assert plan.free_bytes <= left
                assert plan.take_bytes(plan.max_rows) <= max(0, plan.free_bytes), (inputs, choices)
                if spare_mib == 0:
                    assert plan.max_rows == 0
    finally:
        engine.memory.total_bytes = None


@pytest.mark.parametrize(("chunk_tokens", "group_tokens"), [(None, None), (64, 160)])
def test_a_scoring_plan_sets_aside_what_its_groups_hold(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, chunk_tokens: int | None, group_tokens: int | None
) -> None:
    """Rows scored inside the prefill hold their prompts' and choices' states (and the choices' masks and
    indices) while their group runs: the plan's held figure for the take covers what the prefill measured a
    group held -- one group, and several small ones."""
    from worker.fastpath import ScoreRow

    decoder = engine.decoders[engine.config.models["laya"].base]
    if chunk_tokens is not None:
        monkeypatch.setattr(decoder.prefill, "tokens", chunk_tokens)
        monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    choices = ((11, 12, 2), (13, 2), (14, 15, 16, 17, 2))
    rows = [ScoreRow(ids=[5 + i % 7] * (24 + i % 9), choices=choices[: 1 + i % 3], adapter=None) for i in range(20)]
    plan = engine.plan("laya", input_tokens=32, new_tokens=10, scoring=True)
    assert plan.max_rows >= len(rows)
    assert decoder.score(rows, pad_id=0) is not None
    groups = decoder.prefill.layer_groups(rows, tails=[r.choice_tokens for r in rows])
    assert (len(groups) == 1) == (chunk_tokens is None)
    assert 0 < decoder.prefill.held_bytes <= min(plan.held_cap_bytes, len(rows) * plan.held_row_bytes)


@pytest.mark.parametrize(("chunk_tokens", "group_tokens"), [(None, None), (256, 512)])
def test_the_plan_sets_aside_what_the_layer_major_prefill_holds(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, chunk_tokens: int | None, group_tokens: int | None
) -> None:
    """The static loop's prefill holds one group of chunks' hidden states between layers: the plan sets aside
    what the take's rows pad to, up to one group's worth (a fixed cost past that), at least as many bytes as the
    prefill measured a group held -- with the defaults (one group here) and with chunks of 4 rows in groups of
    2 chunks (3 groups)."""
    from worker.fastpath import DecodeRow
    from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
    from worker.loading import select_adapters
    from worker.memory import DTYPE_BYTES, plan_batch

    decoder = engine.decoders[engine.config.models["kev"].base]
    if chunk_tokens is not None:
        monkeypatch.setattr(decoder.prefill, "tokens", chunk_tokens)
        monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    base = engine.base_for("kev")
    shape, dtype_bytes = base.shape, DTYPE_BYTES[base.spec.compute_dtype]
    fixed = max(decoder.prefill_group_tokens, decoder.prefill_tokens, 64) * shape.prefill_held_bytes_per_token(
        dtype_bytes
    )
    budget = engine.memory.resident_bytes + RESERVE_BYTES + 30 * MIB + fixed
    engine.memory.total_bytes = budget
    try:
        plan = engine.plan("kev", input_tokens=64, new_tokens=12)
    finally:
        engine.memory.total_bytes = None
    unheld = plan_batch(
        shape,
        budget_bytes=budget,
        resident_bytes=engine.memory.resident_bytes,
        input_tokens=64,
        new_tokens=12,
        dtype_bytes=dtype_bytes,
        prefill_chunk_tokens=decoder.prefill_tokens,
        cache_tokens=128,
        flash_prefill=True,
        choice_chunk_rows=CHOICE_CHUNK_ROWS,
    )
    per_row = 64 * shape.prefill_held_bytes_per_token(dtype_bytes)
    assert (plan.bytes_per_row, plan.free_bytes) == (unheld.bytes_per_row, unheld.free_bytes)
    for rows in {1, plan.max_rows // 2, plan.max_rows, plan.max_rows + 50}:
        assert plan.take_bytes(rows) - unheld.take_bytes(rows) == min(fixed, rows * per_row), rows
    assert plan.max_rows > 0 and plan.take_bytes(plan.max_rows) <= plan.free_bytes
    rows = min(plan.max_rows, 24)
    batch = [DecodeRow(ids=[5 + i % 7] * (64 - i % 5), max_new=1, adapter=base.adapters["kev"]) for i in range(rows)]
    groups = len(decoder.prefill.layer_groups(batch))
    assert groups == (1 if chunk_tokens is None else 3)
    decoder.decode(batch, stop_ids=[-1], pad_id=0, select=lambda names: select_adapters(base, names))
    assert 0 < decoder.prefill.held_bytes <= min(fixed, rows * per_row)
    if chunk_tokens is not None:  # two chunks of 4 rows of at most 64 tokens: a group's, not the take's
        assert decoder.prefill.held_bytes <= 2 * 4 * 64 * shape.prefill_held_bytes_per_token(dtype_bytes)


def test_memory_already_held_is_planned_around(engine: Engine) -> None:
    """What the allocator holds beyond the KV pool (graphs' pool, cached tensors: measured on CUDA) shrinks
    the plan by as much."""
    engine.loops.release()  # no KV pool left by earlier tests: on CUDA it would be part of the held figure
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + ROOM
    try:
        free = engine.plan("kev", input_tokens=64, new_tokens=12)
        engine.memory.held_bytes = engine.memory.resident_bytes + 5 * MIB
        held = engine.plan("kev", input_tokens=64, new_tokens=12)
        assert held.max_rows < free.max_rows
        assert held.free_bytes == free.free_bytes - 5 * MIB
        assert 0 < held.max_rows * held.bytes_per_row <= held.free_bytes
    finally:
        engine.memory.total_bytes = None
        engine.memory.held_bytes = None


def test_sampled_rows_are_planned_as_a_few_sampler_slots(engine: Engine) -> None:
    """Sampled rows draw in sampler slots (their count bucketed), a fixed cost: a plan with a few of them keeps
    nearly all its rows, and stays inside the budget."""
    from worker.fastpath.decoder import sampler_slots
    from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
    from worker.memory import SAFETY_FACTOR

    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + ROOM
    try:
        greedy = engine.plan("kev", input_tokens=64, new_tokens=12)
        sampled = engine.plan("kev", input_tokens=64, new_tokens=12, sampled_rows=3)
        shape = engine.base_for("kev").shape
        slots = sampler_slots(3) * shape.sampling_bytes_per_slot()
        # The rest of the choice is greedy's (a chunk of rows in float32 at a time): only the slots differ.
        assert slots < greedy.free_bytes - sampled.free_bytes < 2 * slots  # the slots, with the margin
        assert greedy.bytes_per_row == sampled.bytes_per_row
        assert 0 < sampled.max_rows <= greedy.max_rows
        assert sampled.max_rows * sampled.bytes_per_row <= sampled.free_bytes
        # Rows reporting logprobs are planned as though every row's logits went to float32: more per row.
        reporting = engine.plan("kev", input_tokens=64, new_tokens=12, sampled_rows=1, logprob_rows=3)
        chunk = int(shape.choice_chunk_bytes(CHOICE_CHUNK_ROWS) * SAFETY_FACTOR)
        assert reporting.bytes_per_row > greedy.bytes_per_row
        assert reporting.free_bytes > greedy.free_bytes + chunk - 2 * sampler_slots(1) * shape.sampling_bytes_per_slot()
    finally:
        engine.memory.total_bytes = None


def test_a_take_that_cannot_fit_still_runs_a_row_at_a_time(engine: Engine) -> None:
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES  # nothing left: plans of 0 rows
    try:
        jobs = [Job(custom_id=str(i), model="laya", prompt=f"case {i}") for i in range(3)]
        outs = engine.run(jobs)
    finally:
        engine.memory.total_bytes = None
    assert all(o.error is None for o in outs)


def test_an_out_of_memory_error_is_counted_and_logged_loudly(
    tiny_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def tight(phase: str, rows: int) -> None:
        if phase == "generate" and rows > 2:
            raise torch.OutOfMemoryError("simulated")

    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", fault_hook=tight)
    assert engine.stats().oom == 0
    with caplog.at_level(logging.ERROR, logger="kevlaya.engine"):
        outs = engine.run([Job(custom_id=str(i), model="laya", prompt=f"case {i}") for i in range(4)])
    assert all(o.error is None for o in outs)
    assert engine.stats().oom == 1  # 4 rows failed once, then split into 2 + 2
    assert "OUT OF MEMORY at 4 rows" in caplog.text and "planning bug" in caplog.text


@pytest.mark.parametrize("pool_share", [1.0, 0.8, 0.2])
def test_a_pool_that_leaves_few_rows_room_is_released_before_the_take(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, pool_share: float
) -> None:
    """A take whose cache the KV pool holds reuses the pool, so it is planned beside the whole pool. Where that
    leaves no row (what is held grew since), or far fewer rows than releasing it would (a pool sized for other
    lengths), the engine releases the pool and plans the take on what that leaves; a pool that costs the take
    little stays, and so does one that leaves room for the rows there are. A fake allocator on the CPU: the
    held figure is the weights plus the pool, as CUDA measures it. Sizing a take (`may_release=False`) only
    looks: it plans as though the pool were released, and leaves it."""
    from worker.engine import RELEASE_GAIN

    decoder = engine.decoders[engine.config.models["kev"].base]
    memory = engine.memory

    def refresh() -> None:
        memory.held_bytes = memory.resident_bytes + decoder.pool.nbytes

    monkeypatch.setattr(memory, "refresh", refresh)
    memory.total_bytes = memory.resident_bytes + RESERVE_BYTES + ROOM
    try:
        engine.loops.release()
        engine.refresh_memory()
        fresh = engine.plan("kev", input_tokens=64, new_tokens=12)
        assert fresh.max_rows > 0 and fresh.kv_pool_bytes == 0
        length = 1024  # longer than the take's cache: the pool holds its rows, at a cost to the room beside it
        rows = max(1, int(ROOM * pool_share) // decoder.pool.bytes_for(1, length))
        decoder.pool.views(rows, length)
        engine.refresh_memory()
        assert memory.held_bytes == memory.resident_bytes + decoder.pool.nbytes
        base = engine.base_for("kev")
        common = dict(input_tokens=64, new_tokens=12, sampled_rows=0, max_rows=engine.max_batch_rows, decoder=decoder)
        kept = memory.plan(base, **common)  # beside the pool, as it is
        released = kept.max_rows * RELEASE_GAIN < fresh.max_rows
        assert released == (pool_share > 0.5)  # the cases say what they test
        if kept.max_rows:  # a sub-batch of no more rows than fit beside the pool keeps it
            enough = engine.plan("kev", input_tokens=64, new_tokens=12, rows_wanted=kept.max_rows)
            assert decoder.pool.buffer is not None and enough.max_rows == kept.max_rows
        look = engine.plan("kev", input_tokens=64, new_tokens=12, may_release=False)  # sizing a take: a look only
        assert decoder.pool.buffer is not None
        assert look.max_rows == (fresh.max_rows if released else kept.max_rows)
        assert look.released == released  # a plan that holds only once the pool is gone says so
        planned = engine.plan("kev", input_tokens=64, new_tokens=12)
        assert (decoder.pool.buffer is None) == released
        assert planned.max_rows == (fresh.max_rows if released else kept.max_rows)
        assert not planned.released  # planned on what the release left: it holds as it is
    finally:
        memory.total_bytes = None
        memory.held_bytes = None
        engine.loops.release()


class FakeAllocatorPeak:
    """torch.cuda's peak statistic: the most allocated since its last reset."""

    def __init__(self) -> None:
        self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)

    def max_memory_allocated(self, device: object = None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = 0


def test_each_take_has_its_own_peak_and_the_engine_and_a_marked_window_keep_the_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every take resets torch's peak to log its own (`take_peak`), yet the engine's peak stays the process's
    most and a benchmark's `mark` window (several takes) gets the most of its takes."""
    from worker.planner import MemoryBudget

    stat = FakeAllocatorPeak()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", stat.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stat.reset_peak_memory_stats)
    budget = MemoryBudget(torch.device("cuda"), 6 * 1024 * MIB)
    budget.outside_allocator_bytes = 512 * MIB
    stat.allocate(900 * MIB)  # before the benchmark's window: the warm-up, say
    budget.mark()
    for peak_mib in (300, 700, 200):
        budget.take_started()
        stat.allocate(peak_mib * MIB)
        take = budget.take_peak()
        assert take is not None and take.peak_bytes == peak_mib * MIB
        assert take.headroom_bytes == (6 * 1024 - 512 - peak_mib) * MIB
    assert budget.peak_since_mark() == 700 * MIB
    assert budget.peak_bytes() == 900 * MIB


class FakeAllocator:
    """torch.cuda's live and held figures: what tensors hold and what the allocator holds (cached pieces too)."""

    def __init__(self, allocated: int, reserved: int) -> None:
        self.allocated = allocated
        self.reserved = reserved

    def memory_allocated(self, device: object = None) -> int:
        return self.allocated

    def memory_reserved(self, device: object = None) -> int:
        return self.reserved


def test_a_chunk_grows_only_into_memory_no_cached_piece_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The room a prefill chunk may grow into counts every piece the allocator holds cached now as taken, not
    only what it held at the last refresh: pieces left by a take's own staging did not hold a larger chunk's
    transients (the H100 edge workloads' out-of-memory errors); with nothing cached the room is the free
    budget, and a refresh's figure is never undercut."""
    from tests.test_memory import QWEN_1_5B
    from worker.memory import ModelShape, prefill_chunk_tokens_within
    from worker.planner import MemoryBudget

    shape = ModelShape.from_dict(QWEN_1_5B)
    fake = FakeAllocator(allocated=3 * 1024 * MIB, reserved=3 * 1024 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", fake.memory_reserved)
    budget = MemoryBudget(torch.device("cuda"), 6 * 1024 * MIB)
    budget.outside_allocator_bytes = 512 * MIB

    def room() -> int | None:
        return budget.prefill_chunk_room(shape, 32768, dtype_bytes=2)

    def within(free: int) -> int:
        return prefill_chunk_tokens_within(shape, free, held_tokens=32768, dtype_bytes=2)

    free = 6 * 1024 * MIB - 512 * MIB - budget.reserve_bytes - 3 * 1024 * MIB
    assert room() == within(free) > 0
    fake.reserved += 1024 * MIB  # a gigabyte cached in pieces since the refresh
    assert room() == within(free - 1024 * MIB) < within(free)
    fake.reserved -= 1024 * MIB
    budget.pooled_bytes = 512 * MIB  # the refresh saw the graphs' pool: still counted with nothing else cached
    assert room() == within(free - 512 * MIB)
    assert MemoryBudget(torch.device("cpu"), None).prefill_chunk_room(shape, 0, dtype_bytes=2) is None


def test_a_take_capturing_into_a_fresh_graphs_pool_sets_aside_what_the_pool_held_past_its_rows(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop keeps what a greedy capture into a fresh pool grew it by (a sampled or logprob graph's slots, and
    a capture beside earlier graphs, say nothing of a fresh step's). The plan of a take that will capture into a
    fresh pool sets aside the reading's part past the plan's own terms for a step (its rows' estimate, the
    float32 choice chunk); a take beside a held pool does not (the pool is in what is held). A fake allocator
    on the CPU, as CUDA measures it."""
    from worker.fastpath.graphs import Ends, GraphKey

    decoder = engine.decoders[engine.config.models["laya"].base]
    memory = engine.memory
    key = GraphKey(rows=64, length=128, adapters=("laya",), mixed=False, ends=Ends(end_id=1, pad_id=0, stops=(1,)))
    monkeypatch.setattr(decoder, "pool_readings", {})

    def capture(key: GraphKey, grew: int, *, fresh: bool = True) -> None:
        monkeypatch.setattr(decoder.graphs, "pool_captures", 1 if fresh else 2)
        monkeypatch.setattr(decoder.graphs, "last_pool_growth_bytes", grew)
        decoder._read_pool(key)

    capture(key, 6 * MIB)
    capture(replace(key, samplers=8), 90 * MIB)
    capture(replace(key, logprob_slots=8), 90 * MIB)
    capture(replace(key, rows=128), 90 * MIB, fresh=False)
    assert decoder.pool_readings == {64: 6 * MIB}
    capture(key, 4 * MIB)
    assert decoder.pool_readings == {64: 4 * MIB}  # the latest capture into a fresh pool at those rows

    def refresh() -> None:
        memory.held_bytes = memory.resident_bytes

    monkeypatch.setattr(memory, "refresh", refresh)
    memory.total_bytes = memory.resident_bytes + RESERVE_BYTES + ROOM
    try:
        engine.refresh_memory()
        base = engine.base_for("laya")
        common = dict(input_tokens=32, new_tokens=8, sampled_rows=0, max_rows=engine.max_batch_rows, decoder=decoder)
        monkeypatch.setattr(decoder, "pool_readings", {})
        plain = memory.plan(base, **common)
        step = plain.decode_row_bytes
        assert step > 0
        chunk = int(base.shape.choice_chunk_bytes(CHOICE_CHUNK_ROWS) * SAFETY_FACTOR)  # the greedy step's, planned
        monkeypatch.setattr(decoder, "pool_readings", {64: 64 * step + chunk + 5 * MIB})
        fresh = memory.plan(base, **common)
        assert fresh.free_bytes == plain.free_bytes - 5 * MIB
        assert fresh.max_rows < plain.max_rows
        monkeypatch.setattr(type(decoder), "graph_rows", property(lambda self: 64))
        beside = memory.plan(base, **common)
        assert beside.free_bytes == plain.free_bytes  # the held pool is counted in what is held, not again
        assert memory.plan(base, released=True, **common).free_bytes == plain.free_bytes - 5 * MIB
    finally:
        memory.total_bytes = None
        memory.held_bytes = None
