"""A JSON line's objects checked for a key given twice, which orjson (like most parsers) settles silently by
keeping the last: `{"model": "laya", ..., "model": "kev"}` would run on Kev with no word said.

Exactly, and cheaply for the usual line. Every key written as a plain ASCII name (`KEY_TOKEN`) is found by one
pass of a regular expression over the text; a match can only add to the count (text inside a value), so as many
matches as the parsed objects hold keys means no key was given twice. The exact check (Python's parser with
`unique_pairs`, in `producer.jsonl`, the same parse that looks for integers past 64 bits) runs only where that
cannot decide: a key that is no plain name, a `\\u` escape (which can spell
one), or more matches than keys. Measured on `bench mixed`'s 1 KB job lines: ~3 us a line, against ~14 us for
the line's parse and validation without it (the exact parse alone ~9 us; a substring count per key ~8.5 us).
"""

from __future__ import annotations

import re
from typing import Any

from shared.errors import ValidationError, shown

# A key as a plain ASCII name: JSON escapes other than \u spell no such character, so the text holds each such
# key given in a line as this token (linear: no character of the name can end or restart it).
KEY_TOKEN = re.compile(r'"[A-Za-z_][A-Za-z0-9_]*"\s*:')


def keys_may_repeat(raw: str, parsed: Any) -> bool:
    """Whether the JSON text `raw` (parsed: `parsed`) may give a key twice in one object: False only where the
    token count proves it does not; the exact answer is Python's parser with `unique_pairs`."""
    keys = _plain_keys(parsed)
    return keys is None or ("\\" in raw and "\\u" in raw) or len(KEY_TOKEN.findall(raw)) != keys


def _plain_keys(parsed: Any) -> int | None:
    """How many keys the parsed objects hold, or None where one is no plain ASCII name."""
    count, stack = 0, [parsed]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in node:
                if not (key.isascii() and key.isidentifier()):
                    return None
            count += len(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict (an `object_pairs_hook`); ValidationError naming a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValidationError(f"key {shown(key)} is given twice in one object", field=key)
        out[key] = value
    return out
