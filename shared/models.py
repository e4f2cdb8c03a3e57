"""The model names both sides agree on, and their default generation limits."""

from __future__ import annotations

KEV = "kev"
LAYA = "laya"
MODEL_NAMES: tuple[str, ...] = (KEV, LAYA)

# The seed's limits: Kev writes long structured answers, Laya short decisions.
DEFAULT_MAX_NEW_TOKENS: dict[str, int] = {KEV: 512, LAYA: 64}

# The model that answers a Laya job's escalation.
ESCALATES_TO: dict[str, str] = {LAYA: KEV}
