"""Which weights answer for a model: short content hashes of its base and adapter, from the config's paths."""

from __future__ import annotations

import hashlib
from pathlib import Path

from worker.config import ModelsConfig


def fingerprint(folder: Path) -> str:
    """A short content hash of a checkpoint: config files in full, weight files by size and head/tail bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        if path.suffix in (".json", ".txt", ".model"):
            digest.update(path.read_bytes())
            continue
        size = path.stat().st_size
        digest.update(str(size).encode())
        with path.open("rb") as fh:
            digest.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                digest.update(fh.read())
    return digest.hexdigest()[:16]


def model_versions(config: ModelsConfig) -> dict[str, dict[str, str]]:
    """Per model: {"base": hash, "adapter": hash} (no adapter: the base serves it as it is)."""
    bases = {name: _hash(spec.path) for name, spec in config.bases.items()}
    out = {}
    for name, spec in config.models.items():
        version = {"base": bases[spec.base]}
        if spec.adapter is not None:
            version["adapter"] = _hash(spec.adapter)
        out[name] = version
    return out


def _hash(folder: Path) -> str:
    return fingerprint(folder) if folder.is_dir() else "missing"
