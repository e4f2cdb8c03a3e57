"""Confidence calibration: fitted on labelled held-out answers, stored in the models config, applied to
every answer the engine returns.

A model's raw confidence is a token probability (README, "Result format"), and a small LoRA-tuned model's
probabilities are rarely honest: the demo Laya's ECE was 0.159. Two maps are fitted here:

- temperature scaling (the default): generation confidences are the probability of the decision span
  the model emitted, a single number, so their log-odds are divided by T (sigmoid(logit(p) / T));
  choice scores are a distribution over labels, so the label log-probabilities are divided by T and
  renormalised (the textbook form). One parameter each, fitted by minimising the negative log-likelihood:
  it cannot overfit a few hundred items and keeps the order of the confidences.
- isotonic regression (pool-adjacent-violators) of correctness on the generation confidence: any
  monotone shape, but it can overfit. `fit` keeps it only when it beats temperature scaling out of fold
  by a clear margin (cross-validated ECE lower by `ISOTONIC_MARGIN`).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from shared.errors import ConfigError

BINS = 10
EPS = 1e-6
TEMPERATURE = "temperature"
ISOTONIC = "isotonic"
METHODS = (TEMPERATURE, ISOTONIC)
ISOTONIC_MARGIN = 0.01  # isotonic must beat temperature's out-of-fold ECE by this much to be chosen
FOLDS = 5
_TABLE_KEYS = {"method", "temperature", "choices_temperature", "isotonic", "ece_before", "ece_after", "fitted_on"}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """How one model's raw confidence becomes the calibrated one (`[models.NAME.calibration]`)."""

    method: str = TEMPERATURE
    temperature: float = 1.0  # generation: sigmoid(logit(p) / temperature)
    choices_temperature: float = 1.0  # choices: softmax(log p_label / choices_temperature)
    isotonic: tuple[tuple[float, float], ...] = ()  # method = isotonic: (raw, calibrated) knots, interpolated
    ece_before: float | None = None  # on the fitting data, recorded for the reader
    ece_after: float | None = None
    fitted_on: str = ""

    def confidence(self, raw: float) -> float:
        """The calibrated confidence of a generated answer."""
        if self.method == ISOTONIC and self.isotonic:
            return _interpolate(self.isotonic, raw)
        return _sigmoid(_logit(raw) / self.temperature)

    def choices(self, probs: dict[str, float]) -> dict[str, float]:
        """The label distribution of a scored (choices) job, re-tempered."""
        logits = {k: math.log(max(p, 1e-300)) / self.choices_temperature for k, p in probs.items()}
        top = max(logits.values())
        exp = {k: math.exp(v - top) for k, v in logits.items()}
        total = sum(exp.values())
        return {k: v / total for k, v in exp.items()}

    def to_table(self) -> dict[str, Any]:
        """The config table `kevlaya calibrate` writes (TOML values only, none of them None)."""
        table: dict[str, Any] = {
            "method": self.method,
            "temperature": round(self.temperature, 6),
            "choices_temperature": round(self.choices_temperature, 6),
        }
        if self.isotonic:
            table["isotonic"] = [[round(x, 6), round(y, 6)] for x, y in self.isotonic]
        for key in ("ece_before", "ece_after"):
            value = getattr(self, key)
            if value is not None:
                table[key] = round(value, 6)
        if self.fitted_on:
            table["fitted_on"] = self.fitted_on
        return table

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Calibration:
        unknown = sorted(set(table) - _TABLE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_TABLE_KEYS)}")
        method = table.get("method", TEMPERATURE)
        if method not in METHODS:
            raise ConfigError(f"{where}: method must be one of {METHODS}, got {method!r}")
        temps = {k: _number(table, k, where, 1.0) for k in ("temperature", "choices_temperature")}
        if not all(0.0 < t < math.inf for t in temps.values()):
            raise ConfigError(f"{where}: temperatures must be positive and finite, got {temps}")
        knots = _knots(table.get("isotonic", []), where)
        if method == ISOTONIC and not knots:
            raise ConfigError(f"{where}: method = 'isotonic' needs 'isotonic' knots [[raw, calibrated], ...]")
        fitted_on = table.get("fitted_on", "")
        if not isinstance(fitted_on, str):
            raise ConfigError(f"{where} fitted_on = {fitted_on!r}: must be a string")
        return cls(
            method=method,
            isotonic=knots,
            ece_before=_number(table, "ece_before", where, None),
            ece_after=_number(table, "ece_after", where, None),
            fitted_on=fitted_on,
            **temps,
        )


# ---- measuring ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Bin:
    low: float
    high: float
    n: int
    confidence: float
    accuracy: float


def reliability(confidences: Sequence[float], correct: Sequence[bool]) -> tuple[float, list[Bin]]:
    """Expected calibration error over ten equal-width bins, and the bins (the reliability diagram)."""
    if not confidences:
        return 0.0, []
    members: list[list[int]] = [[] for _ in range(BINS)]
    for i, c in enumerate(confidences):
        members[min(int(c * BINS), BINS - 1)].append(i)
    ece, bins = 0.0, []
    for b, idx in enumerate(members):
        if not idx:
            continue
        conf = sum(confidences[i] for i in idx) / len(idx)
        acc = sum(bool(correct[i]) for i in idx) / len(idx)
        ece += len(idx) / len(confidences) * abs(acc - conf)
        bins.append(Bin(low=b / BINS, high=(b + 1) / BINS, n=len(idx), confidence=conf, accuracy=acc))
    return ece, bins


def ece(confidences: Sequence[float], correct: Sequence[bool]) -> float:
    return reliability(confidences, correct)[0]


# ---- fitting --------------------------------------------------------------------------------------
def fit_temperature(confidences: Sequence[float], correct: Sequence[bool]) -> float:
    """T minimising the NLL of correctness under sigmoid(logit(p) / T). The NLL is convex in 1/T
    (logistic regression through the origin on the log-odds), so a golden-section search finds it."""
    z = [_logit(p) for p in confidences]
    y = [bool(c) for c in correct]

    def nll(log_inv_t: float) -> float:
        a = math.exp(log_inv_t)
        return sum(_softplus(-a * zi) if yi else _softplus(a * zi) for zi, yi in zip(z, y, strict=True))

    return 1.0 / math.exp(_golden_min(nll, -5.0, 5.0))


def fit_choices_temperature(distributions: Sequence[dict[str, float]], gold: Sequence[str]) -> float:
    """T minimising the NLL of the gold label under softmax(log p / T) (multi-class temperature scaling).
    Items whose gold label is not among the choices carry no information about T and are skipped."""
    rows = [({k: math.log(max(p, 1e-300)) for k, p in d.items()}, g) for d, g in zip(distributions, gold, strict=True)]
    rows = [(lp, g) for lp, g in rows if g in lp]
    if not rows:
        return 1.0

    def nll(log_inv_t: float) -> float:
        a = math.exp(log_inv_t)
        return sum(_logsumexp([a * v for v in lp.values()]) - a * lp[g] for lp, g in rows)

    return 1.0 / math.exp(_golden_min(nll, -5.0, 5.0))


def fit_isotonic(confidences: Sequence[float], correct: Sequence[bool]) -> tuple[tuple[float, float], ...]:
    """Pool-adjacent-violators: the non-decreasing step function of confidence closest to correctness
    (least squares); knots at each pooled block's mean confidence, interpolated between."""
    pairs = sorted(zip(confidences, (float(bool(c)) for c in correct), strict=True))
    blocks: list[list[float]] = []  # [sum_x, sum_y, count]
    for x, y in pairs:
        blocks.append([x, y, 1.0])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            sx, sy, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + sx, blocks[-1][1] + sy, blocks[-1][2] + n]
    return tuple((sx / n, min(max(sy / n, EPS), 1 - EPS)) for sx, sy, n in blocks)


def fit(
    confidences: Sequence[float],
    correct: Sequence[bool],
    *,
    method: str = "auto",
    choice_distributions: Sequence[dict[str, float]] = (),
    choice_gold: Sequence[str] = (),
    fitted_on: str = "",
    seed: int = 0,
) -> Calibration:
    """Fit a model's calibration. method: temperature, isotonic, or auto (isotonic only if it beats
    temperature scaling out of fold by ISOTONIC_MARGIN)."""
    if method not in (*METHODS, "auto"):
        raise ValueError(f"unknown calibration method {method!r}")
    choices_t = fit_choices_temperature(choice_distributions, choice_gold) if choice_distributions else 1.0
    chosen = method
    if method == "auto":
        cv = cross_validated_ece(confidences, correct, seed=seed)
        chosen = ISOTONIC if cv[ISOTONIC] + ISOTONIC_MARGIN < cv[TEMPERATURE] else TEMPERATURE
    calibration = Calibration(
        method=chosen,
        temperature=fit_temperature(confidences, correct) if confidences else 1.0,
        choices_temperature=choices_t,
        isotonic=fit_isotonic(confidences, correct) if chosen == ISOTONIC else (),
        fitted_on=fitted_on,
    )
    after = [calibration.confidence(p) for p in confidences]
    return replace(calibration, ece_before=ece(confidences, correct), ece_after=ece(after, correct))


def cross_validated_ece(
    confidences: Sequence[float], correct: Sequence[bool], *, folds: int = FOLDS, seed: int = 0
) -> dict[str, float]:
    """Out-of-fold ECE of each method: fitted on k-1 folds, measured on the one left out, pooled."""
    order = list(range(len(confidences)))
    random.Random(seed).shuffle(order)
    pooled: dict[str, list[float]] = {TEMPERATURE: [0.0] * len(order), ISOTONIC: [0.0] * len(order)}
    for k in range(folds):
        test = order[k::folds]
        held = set(test)
        train = [i for i in order if i not in held]
        xs, ys = [confidences[i] for i in train], [correct[i] for i in train]
        temp = Calibration(temperature=fit_temperature(xs, ys))
        iso = Calibration(method=ISOTONIC, isotonic=fit_isotonic(xs, ys))
        for i in test:
            pooled[TEMPERATURE][i] = temp.confidence(confidences[i])
            pooled[ISOTONIC][i] = iso.confidence(confidences[i])
    return {name: ece(values, correct) for name, values in pooled.items()}


# ---- applying -------------------------------------------------------------------------------------
def calibrated_output(output: Any, calibration: Calibration | None, *, scored: bool) -> Any:
    """A RowOutput with the calibrated confidence (and choices), the model's own under `raw_confidence`.
    Errors, missing confidences and uncalibrated models pass through unchanged."""
    if calibration is None or output.error is not None or output.confidence is None:
        return output
    if scored and output.choices:
        choices = calibration.choices(output.choices)
        return replace(output, choices=choices, confidence=choices[output.decision], raw_confidence=output.confidence)
    return replace(output, confidence=calibration.confidence(output.confidence), raw_confidence=output.confidence)


# ---- small maths ----------------------------------------------------------------------------------
def _logit(p: float) -> float:
    p = min(max(p, EPS), 1 - EPS)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _softplus(x: float) -> float:
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _interpolate(knots: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= knots[0][0]:
        return knots[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(knots):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return knots[-1][1]


def _golden_min(f: Any, lo: float, hi: float, *, tol: float = 1e-5) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(table: dict[str, Any], key: str, where: str, default: Any) -> Any:
    """A numeric key of the table (TOML integer or float; a string or bool is refused, never converted)."""
    value = table.get(key, default)
    if value is default:
        return value
    if not _is_number(value):
        raise ConfigError(f"{where} {key} = {value!r}: must be a number")
    return float(value)


def _knots(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    """Isotonic knots: [raw, calibrated] pairs of probabilities, raw sorted, calibrated non-decreasing (the map
    keeps the order of the confidences, and serves a probability)."""
    if not isinstance(value, list) or not all(
        isinstance(k, list) and len(k) == 2 and all(_is_number(v) for v in k) for k in value
    ):
        raise ConfigError(f"{where} isotonic = {value!r}: must be a list of [raw, calibrated] number pairs")
    knots = tuple((float(x), float(y)) for x, y in value)
    if not all(0.0 <= v <= 1.0 for knot in knots for v in knot):  # NaN fails this too
        raise ConfigError(f"{where} isotonic = {value!r}: every raw and calibrated value must be in [0, 1]")
    if any(b[0] < a[0] for a, b in itertools.pairwise(knots)):
        raise ConfigError(f"{where} isotonic: knots must be sorted by their raw confidence")
    if any(b[1] < a[1] for a, b in itertools.pairwise(knots)):
        raise ConfigError(f"{where} isotonic: calibrated values must not decrease as the raw confidence grows")
    return knots
