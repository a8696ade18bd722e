"""Where dflash keeps things (its state folder, the Hub cache) and how a model's files are identified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """The Hub cache every HF tool shares (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def state_dir() -> Path:
    """dflash's own folder (DFLASH_HOME, else ~/.cache/dflash): pull records, block costs, native drafters, prompts."""
    return Path(os.environ.get("DFLASH_HOME") or Path.home() / ".cache" / "dflash")


def files_identity(path: Path) -> list:
    """Path, sizes and modification times of a model file or folder: changes when the weights change."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [str(path.resolve())] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def identity_key(parts: dict) -> str:
    """A file name for one identity (model files, backend, device, threads...): a short hash of its parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
