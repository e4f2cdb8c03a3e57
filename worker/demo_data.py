"""The demo's synthetic decision task: loan triage with rule-based ground truth and borderline cases.

`python -m worker.demo_data > worker/data/demo_decisions.jsonl` regenerates the bundled file.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import orjson

LABELS = ("approve", "reject", "review")


def debt_level(debt_ratio: float) -> str:
    return "low" if debt_ratio < 0.3 else "high" if debt_ratio >= 0.6 else "medium"


def label_for(income: int, amount: int, debt_ratio: float, history: str) -> str:
    """The ground truth: clear rejections, clear approvals, and a review band in between. Borderline
    cases sit at the debt-ratio edges (0.29 vs 0.30, 0.59 vs 0.60), where a quick answer is least sure."""
    if history == "defaulted" or debt_ratio >= 0.6:
        return "reject"
    if history == "clean" and debt_ratio < 0.3:
        return "approve"
    return "review"


def case(rng: random.Random) -> dict[str, Any]:
    income = rng.randrange(18_000, 160_000, 500)
    amount = rng.randrange(1_000, 120_000, 500)
    debt_ratio = round(rng.uniform(0.05, 0.8), 2)
    history = rng.choices(["clean", "late payments", "defaulted"], weights=[6, 3, 1])[0]
    category = rng.choice(["personal", "car", "home", "business"])
    return {
        "income": income,
        "amount": amount,
        "debt_ratio": debt_ratio,
        "history": history,
        "category": category,
        "label": label_for(income, amount, debt_ratio, history),
    }


def kev_target(c: dict[str, Any]) -> str:
    """Kev's style: a short structured analysis that ends in a decision line."""
    share = round(100 * c["amount"] / c["income"])
    return (
        f"Step 1 - income: {c['income']} a year; the request is {share}% of it.\n"
        f"Step 2 - debt ratio: {c['debt_ratio']}, {debt_level(c['debt_ratio'])}.\n"
        f"Step 3 - history: {c['history']}.\n"
        f"Decision: {c['label']}"
    )


def training_rows(n: int, *, seed: int) -> list[dict[str, Any]]:
    """Rows for `kevlaya train`: prompt, both targets, and the label as the rebalancing category."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        c = case(rng)
        rows.append({"prompt": prompt_for(c), "kev": kev_target(c), "laya": c["label"], "category": c["label"]})
    return rows


def prompt_for(c: dict[str, Any]) -> str:
    return (
        f"Loan application ({c['category']}): yearly income {c['income']}, amount requested {c['amount']}, "
        f"debt ratio {c['debt_ratio']}, credit history {c['history']}. Decide: approve, reject or review."
    )


def demo_jobs(n: int = 1000, *, seed: int = 7) -> Iterator[dict[str, Any]]:
    """A quarter go to Kev for a full analysis, the rest to Laya (every tenth as a choice among the labels);
    unsure Laya answers escalate to Kev."""
    rng = random.Random(seed)
    for i in range(n):
        c = case(rng)
        job: dict[str, Any] = {"custom_id": f"loan-{i:05d}", "prompt": prompt_for(c), "meta": {"label": c["label"]}}
        job["model"] = "kev" if i % 4 == 0 else "laya"
        if i % 10 == 5:
            job["choices"] = list(LABELS)
        yield job


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for job in demo_jobs(n):
        sys.stdout.buffer.write(orjson.dumps(job) + b"\n")
