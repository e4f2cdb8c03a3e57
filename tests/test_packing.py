"""Sub-batches of a group of rows: each fits the plan at its rows' real lengths, and where the rows need several
they are of even size (no sub-batch decodes the full answer length for a small tail)."""

from __future__ import annotations

from typing import Any

import pytest

from shared.job import Job
from worker.memory import BatchPlan
from worker.packing import even_share, pack
from worker.rows import Item


def items(lengths: list[int]) -> list[Item]:
    return [
        Item(index=i, job=Job(custom_id=f"r{i}", model="kev", prompt="x"), ids=[1] * n, max_new=8, adapter="kev")
        for i, n in enumerate(lengths)
    ]


def plan_of(rows_for: Any) -> Any:
    """A fake `Engine.plan`: `rows_for(input_tokens)` rows fit."""

    def plan(model: str, *, input_tokens: int, **_: Any) -> BatchPlan:
        return BatchPlan(max_rows=rows_for(input_tokens), kv_bytes_per_token=1, bytes_per_row=1, free_bytes=1)

    return plan


def sizes(group: list[Item], rows_for: Any) -> list[int]:
    parts = pack(group, scoring=False, on_loop=True, plan=plan_of(rows_for), choice_tokens=lambda job: 0)
    return [len(p) for p in parts]


@pytest.mark.parametrize(
    ("cap", "wanted", "share"),
    [(80, 200, 67), (80, 80, 80), (80, 50, 80), (80, 81, 41), (1, 5, 1), (256, 512, 256), (100, 301, 76)],
)
def test_even_share_splits_into_as_few_even_parts_as_the_cap_allows(cap: int, wanted: int, share: int) -> None:
    assert even_share(cap, wanted) == share
    parts = -(-wanted // cap)
    assert -(-wanted // even_share(cap, wanted)) == parts  # never more sub-batches than greedy packing


def test_rows_past_one_plan_are_split_evenly() -> None:
    assert sizes(items([100] * 200), lambda n: 80) == [67, 67, 66]
    assert sizes(items([100] * 80), lambda n: 80) == [80]
    assert sizes(items([100] * 81), lambda n: 80) == [41, 40]


def test_every_sub_batch_still_fits_its_plan_when_longer_rows_fit_fewer() -> None:
    """Sorted by length, later rows are longer and their plan smaller: even sizes never exceed it."""
    lengths = [50 + i for i in range(300)]
    rows_for = lambda n: 120 if n < 200 else 70  # noqa: E731
    parts = list(pack(items(lengths), scoring=False, on_loop=True, plan=plan_of(rows_for), choice_tokens=lambda j: 0))
    assert sum(len(p) for p in parts) == 300
    for part in parts:
        assert len(part) <= rows_for(max(len(it.ids) for it in part))


def test_no_even_cut_where_the_longest_rows_to_come_fit_fewer_than_an_even_share() -> None:
    """100 short rows under a plan of 100 and one long row under a plan of 49: 2 sub-batches; cutting the short rows
    evenly (51 + 50) would leave the long row needing a third. Where the plan's own cut comes, the rows before it are
    balanced against the rows after it as far as those fit (52 + 49, not 100 + 1)."""
    lengths = [100] * 100 + [900]
    rows_for = lambda n: 100 if n < 500 else 49  # noqa: E731
    assert sizes(items(lengths), rows_for) == [52, 49]
    probes = 0

    def plan(model: str, *, input_tokens: int, **kw: Any) -> BatchPlan:
        nonlocal probes
        probes += kw.get("may_release") is False and "rows_wanted" not in kw
        return plan_of(rows_for)(model, input_tokens=input_tokens)

    list(pack(items(lengths), scoring=False, on_loop=True, plan=plan, choice_tokens=lambda j: 0))
    assert probes == 1  # asked once (the balance at the cut asks the same), not again for every row after it


@pytest.mark.parametrize("scoring", [False, True])
def test_rows_that_all_fit_are_one_sub_batch_after_one_look_at_the_plan(scoring: bool) -> None:
    """Where every row fits as they are (the longest prompt, all the rows' figures), one sub-batch after one plan,
    asked without releasing anything -- not one plan per prompt length."""
    calls: list[dict[str, Any]] = []

    def plan(model: str, *, input_tokens: int, **kw: Any) -> BatchPlan:
        calls.append({"input_tokens": input_tokens, **kw})
        return BatchPlan(max_rows=300, kv_bytes_per_token=1, bytes_per_row=1, free_bytes=1)

    lengths = [50 + i for i in range(300)]
    parts = list(pack(items(lengths), scoring=scoring, on_loop=True, plan=plan, choice_tokens=lambda j: 3))
    assert [len(p) for p in parts] == [300]
    assert [it.index for it in parts[0]] == list(range(300))
    assert len(calls) == 1
    assert calls[0]["input_tokens"] == 349 and calls[0]["may_release"] is False and calls[0]["rows_wanted"] == 300


def test_rows_that_fit_only_with_the_pool_released_are_packed_as_before() -> None:
    """A plan that holds every row only as though the KV pool were released is not taken as it is: the rows are
    packed row by row, whose plans release the pool where that gains."""
    released_at: list[int] = []

    def plan(model: str, *, input_tokens: int, **kw: Any) -> BatchPlan:
        looking = kw.get("may_release") is False
        if not looking:
            released_at.append(input_tokens)
        rows = 300 if looking else 120
        return BatchPlan(max_rows=rows, kv_bytes_per_token=1, bytes_per_row=1, free_bytes=1, released=looking)

    parts = list(pack(items([100] * 300), scoring=False, on_loop=True, plan=plan, choice_tokens=lambda j: 0))
    assert [len(p) for p in parts] == [100, 100, 100]
    assert released_at  # the rows were planned by the plans that may release


@pytest.mark.parametrize(
    ("lengths", "rows_for", "expected"),
    [
        # The plan shrinks by a few rows past a cache bucket: 189 + 3 left the 3 decoding alone on a graph of theirs.
        ([300] * 189 + [420] * 3, lambda n: 192 if n < 400 else 189, [96, 96]),
        # The rows after the cut fit only a few more than they are: the cut moves only as far as they fit.
        ([100] * 150 + [900] * 10, lambda n: 150 if n < 500 else 20, [140, 20]),
        # Rows after the cut as many as before it: nothing to balance.
        ([100] * 50 + [900] * 50, lambda n: 100 if n < 500 else 50, [50, 50]),
    ],
)
def test_a_cut_where_the_plan_shrinks_is_balanced_against_the_rows_after_it(
    lengths: list[int], rows_for: Any, expected: list[int]
) -> None:
    parts = list(pack(items(lengths), scoring=False, on_loop=True, plan=plan_of(rows_for), choice_tokens=lambda j: 0))
    assert [len(p) for p in parts] == expected
    assert [it.index for p in parts for it in p] == list(range(len(lengths)))  # every row once, in length order
    for part in parts:
        assert len(part) <= rows_for(max(len(it.ids) for it in part))


def test_the_probe_for_the_rows_to_come_releases_nothing() -> None:
    """Sizing the even cut asks the plan about the longest rows still to come without releasing the KV pool."""
    calls: list[dict[str, Any]] = []

    def plan(model: str, *, input_tokens: int, **kw: Any) -> BatchPlan:
        calls.append(kw)
        return BatchPlan(max_rows=80, kv_bytes_per_token=1, bytes_per_row=1, free_bytes=1)

    parts = list(pack(items([100] * 200), scoring=False, on_loop=True, plan=plan, choice_tokens=lambda j: 0))
    assert [len(p) for p in parts] == [67, 67, 66]
    probes = [kw for kw in calls if "rows_wanted" not in kw]
    assert probes and all(kw.get("may_release") is False for kw in probes)


@pytest.mark.parametrize(
    ("adapters", "one"), [(["kev"], True), ([None], True), (["kev", "laya"], False), (["kev", None], False)]
)
@pytest.mark.parametrize("scoring", [False, True])
def test_rows_of_one_adapter_are_planned_as_such_and_a_mixed_take_never_is(
    adapters: list[str | None], one: bool, scoring: bool
) -> None:
    """The plan learns whether every row of the take runs on one adapter (its prefill then holds one layer's
    weights, the LoRA merged in place), for every sub-batch and probe: a take topped up with another model's rows
    (or bare base rows beside adapter rows) is planned with the second layer's copy."""
    calls: list[dict[str, Any]] = []

    def plan(model: str, *, input_tokens: int, **kw: Any) -> BatchPlan:
        calls.append(kw)
        return BatchPlan(max_rows=40, kv_bytes_per_token=1, bytes_per_row=1, free_bytes=1)

    group = [
        Item(index=i, job=Job(custom_id=f"r{i}", model="kev", prompt="x"), ids=[1] * 10, max_new=8, adapter=a)
        for i, a in enumerate(adapters * 50)
    ]
    parts = list(pack(group, scoring=scoring, on_loop=True, plan=plan, choice_tokens=lambda job: 2))
    assert sum(len(p) for p in parts) == len(group)
    assert calls and all(kw["one_adapter"] is one for kw in calls)
