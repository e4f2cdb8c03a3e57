"""Writing fitted values back into a models config (`kevlaya calibrate`, `kevlaya eval --write-threshold`).

The file is a user's: its comments, order and other tables are kept. A table is replaced as a whole
(its header line to the next header); a single key is set in place. Every edit is checked by parsing the
result and reading the value back, and by the config loader, before the file is replaced, so a layout
this editor does not understand (an inline table, dotted keys) fails loudly instead of writing garbage.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import tomllib

from shared.errors import ConfigError

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def write_table(path: Path, dotted: str, values: dict[str, Any], *, comment: str = "") -> None:
    """Replace (or append) the table `[dotted]` with VALUES."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start, end = _table_span(lines, dotted)
    body = [f"[{dotted}]", *([f"# {line}" for line in comment.splitlines()] if comment else [])]
    body += [f"{key} = {_literal(value)}" for key, value in values.items()]
    if start is None:
        new = [*lines, *([""] if lines and lines[-1].strip() else []), *body]
    else:
        new = [*lines[:start], *body, *([""] if end < len(lines) else []), *lines[end:]]
    _commit(path, new, dotted, values)


def set_key(path: Path, dotted: str, key: str, value: Any) -> None:
    """Set one KEY of the table `[dotted]`, keeping the rest of the table; the table is added if absent."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start, end = _table_span(lines, dotted)
    if start is None:
        write_table(path, dotted, {key: value})
        return
    assign = re.compile(rf"^\s*{re.escape(key)}\s*=")
    line = f"{key} = {_literal(value)}"
    at = next((i for i in range(start + 1, end) if assign.match(lines[i])), None)
    new = [*lines[:at], line, *lines[at + 1 :]] if at is not None else [*lines[: start + 1], line, *lines[start + 1 :]]
    _commit(path, new, dotted, {key: value})


def _table_span(lines: list[str], dotted: str) -> tuple[int | None, int]:
    """(index of the table's header line, index of the next header or the end), or (None, len)."""
    want = [part.strip().strip('"') for part in dotted.split(".")]
    start = None
    for i, line in enumerate(lines):
        match = _HEADER.match(line)
        if not match:
            continue
        if start is not None:
            # A header after ours ends it, unless a comment block leads into it: keep those with the next table.
            end = i
            while end > start + 1 and lines[end - 1].lstrip().startswith("#"):
                end -= 1
            return start, end
        if [part.strip().strip('"') for part in match.group(1).split(".")] == want:
            start = i
    return start, len(lines)


def _commit(path: Path, lines: list[str], dotted: str, values: dict[str, Any]) -> None:
    text = "\n".join(lines) + "\n"
    try:
        table: Any = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: could not write [{dotted}] (result is not valid TOML: {exc})") from exc
    for part in dotted.split("."):
        table = table.get(part, {}) if isinstance(table, dict) else {}
    if any(table.get(key) != _normalised(value) for key, value in values.items()):
        raise ConfigError(f"{path}: could not write [{dotted}] in this file's layout; set it by hand: {values}")
    from worker.config import load_config  # the loader validates what we wrote before it replaces the file

    scratch = path.with_name(f".{path.name}.writing")
    scratch.write_text(text, encoding="utf-8")
    try:
        load_config(scratch, check_paths=False)
        scratch.replace(path)
    finally:
        scratch.unlink(missing_ok=True)


def _normalised(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_normalised(v) for v in value]
    return value


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value}")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    raise ValueError(f"cannot write {type(value).__name__} to TOML")
