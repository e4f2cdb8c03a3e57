"""`bench mixed`'s prompts tokenize like English does through a real tokenizer, on the bench model's own."""

from __future__ import annotations

from pathlib import Path

from bench.mixed import WORDS, workloads
from worker.tools.tinymodel import build_tokenizer


def test_the_bench_words_cost_about_what_english_words_cost_qwens_tokenizer(tmp_path: Path) -> None:
    """About 1.3 tokens a word (Qwen2.5 on English): a list the 512-entry tokenizer splits into ~4 tokens a word
    makes every workload three times longer in tokens than its word counts say."""
    tokenizer = build_tokenizer(tmp_path)  # the bench model's tokenizer (worker.tools.tinymodel.SHAPES)
    jobs = workloads(0.05)
    prompts = [job["prompt"] for job in jobs["greedy"] + jobs["stream"]]
    words = sum(len(p.split()) for p in prompts)
    tokens = sum(len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts)
    assert 1.15 <= tokens / words <= 1.5
    assert all(len(tokenizer(" " + w, add_special_tokens=False).input_ids) <= 2 for w in WORDS)


def test_long_kev_prompts_still_reach_the_input_limit(tmp_path: Path) -> None:
    """The kev-long workload is cut at the models' 1,024-token input limit: every prompt is longer."""
    tokenizer = build_tokenizer(tmp_path)
    for job in workloads(0.05)["kev-long"]:
        assert len(tokenizer(job["prompt"], add_special_tokens=False).input_ids) > 1024


def test_the_edge_set_reaches_every_limit_the_seeds_config_allows(tmp_path: Path) -> None:
    """`bench mixed --set edges`: every job is one `kevlaya submit` accepts, and together they reach the limits
    (Kev answers of 512 tokens, Laya's 64, prompts past the 1,024-token input, one-word prompts, 12 labels,
    sampled rows beside greedy ones)."""
    from bench.mixed import EDGE_LIMITS, WIDE_CHOICES, edge_workloads
    from shared.job import Job

    tokenizer = build_tokenizer(tmp_path)
    sets = edge_workloads(0.05)
    for jobs in sets.values():
        for job in jobs:
            Job.from_dict(job)  # raises on anything the producer would refuse
    assert {j["max_new_tokens"] for j in sets["edge-kev-max"]} == {EDGE_LIMITS["kev_new"]}
    lengths = [len(tokenizer(j["prompt"], add_special_tokens=False).input_ids) for j in sets["edge-lengths"]]
    assert min(lengths) < 64 and max(lengths) > EDGE_LIMITS["max_input_tokens"]
    assert max(j["max_new_tokens"] for j in sets["edge-lengths"]) <= EDGE_LIMITS["laya_new"]
    assert max(len(j["choices"]) for j in sets["edge-choices-wide"]) <= len(WIDE_CHOICES)
    assert {"temperature" in j for j in sets["edge-sampled-half"]} == {True, False}
    assert all(len(j["prompt"].split()) <= 7 for j in sets["edge-tiny"])
