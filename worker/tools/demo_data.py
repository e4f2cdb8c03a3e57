"""The demo's synthetic decision task: loan triage from a repayment record.

An application lists eight quarters of repayments, each `clean`, `late` or `missed`. The bank keeps a risk
score: it starts at 0, a late quarter adds 1, a missed one adds 2, a clean one takes 1 off, and the score
never goes below 0. The final score decides: 0-1 approve, 2-3 review, 4 or more reject.

The task is built so that thinking in steps genuinely helps:

- Laya answers with the label alone, in one pass. Counting the quarters of each kind is easy for a small
  model, and on most records (clean ones, bad ones) the counts decide. But the floor at 0 makes the score
  depend on the order: clean quarters before any trouble are worth nothing. Where the order matters, a
  model that only sees counts cannot know the answer; trained on labels, it learns to be unsure there.
- Kev writes one line per quarter (copy the quarter's kind, add its points to the running score, clamp at
  0), then the label of the final score. Every step is a copy or a small lookup, and the hard records
  cost Kev no more than the easy ones.

`python -m worker.tools.demo_data > worker/data/demo_decisions.jsonl` regenerates the bundled file.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import orjson

LABELS = ("approve", "reject", "review")
QUARTERS = 8
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August")
POINTS = {"clean": -1, "late": 1, "missed": 2}
APPROVE_MAX, REVIEW_MAX = 1, 3  # score 0-1 approve, 2-3 review, 4+ reject
# Applicants come in profiles (hidden from the models), as weights of clean/late/missed per quarter:
# steady payers, struggling ones, and uneven ones whose record turns halfway (recovering or declining),
# the records where order matters most. The mix decides whether a cascade can work at all: a screen that
# only counts is unsure exactly where counts leave the label open, so those records must fit in the
# escalation budget, with room to spare for a screen that ranks them less well than the counts would.
# Exact over all 3^8 records: a counts-only screen that answers each count's most likely label is right on
# 0.911 of these cases, and its most sure 75% are all right (79% of the cases have a count whose label is
# at least 95% likely). The earlier weights, steady (9, 1, 0.3) / struggling (2, 4, 4) at 50/35/15: 0.904,
# but only 73% of cases that sure, and its most sure 75% right 0.994: built Laya's errors began at 70%.
PROFILES = {"steady": (15.0, 1.0, 0.2), "struggling": (1.0, 4.0, 5.0)}
PROFILE_MIX = {"steady": 45, "struggling": 35, "uneven": 20}


def score_steps(record: list[str]) -> list[int]:
    """The running score after each quarter."""
    steps, score = [], 0
    for kind in record:
        score = max(0, score + POINTS[kind])
        steps.append(score)
    return steps


def label_for(score: int) -> str:
    return "approve" if score <= APPROVE_MAX else "review" if score <= REVIEW_MAX else "reject"


def case(rng: random.Random) -> dict[str, Any]:
    profile = rng.choices(list(PROFILE_MIX), weights=list(PROFILE_MIX.values()))[0]
    halves = rng.sample(list(PROFILES), 2) if profile == "uneven" else [profile, profile]
    record = [rng.choices(list(POINTS), weights=PROFILES[halves[q >= QUARTERS // 2]])[0] for q in range(QUARTERS)]
    return {"record": record, "score": score_steps(record)[-1], "label": label_for(score_steps(record)[-1])}


def prompt_for(c: dict[str, Any]) -> str:
    quarters = ", ".join(f"{MONTHS[q]} {kind}" for q, kind in enumerate(c["record"]))
    return f"Loan application: repayment record {quarters}. Decide: approve, reject or review."


def kev_target(c: dict[str, Any]) -> str:
    """Kev's steps: the running score quarter by quarter, then the score's label, then the decision line."""
    lines = [
        f"{MONTHS[q]} {kind} {POINTS[kind]:+d} = {score}"
        for q, (kind, score) in enumerate(zip(c["record"], score_steps(c["record"]), strict=True))
    ]
    return "\n".join([*lines, f"score {c['score']}: {c['label']}", f"Decision: {c['label']}"])


def training_rows(n: int, *, seed: int) -> list[dict[str, Any]]:
    """Rows for `kevlaya train`: prompt, both targets, and the label as the rebalancing category."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        c = case(rng)
        rows.append({"prompt": prompt_for(c), "kev": kev_target(c), "laya": c["label"], "category": c["label"]})
    return rows


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
