"""Model names users type, resolved to local target and drafter folders."""

from __future__ import annotations

import difflib
from pathlib import Path

from .errors import DFlashError

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
BUNDLED = {"tiny": (MODELS_DIR / "tiny" / "target", MODELS_DIR / "tiny" / "drafter")}
BUNDLED_PROMPTS = {"tiny": MODELS_DIR / "tiny" / "heldout_prompts.jsonl"}


def resolve(name: str, drafter: Path | None = None) -> tuple[Path, Path | None]:
    """A bundled alias or a local model path, plus its drafter (the alias's own unless one is given)."""
    if name in BUNDLED:
        target, own = BUNDLED[name]
        if not target.is_dir():
            raise DFlashError(f"The bundled model '{name}' is missing from {target.parent}; reinstall dflash-local.")
        return target, drafter or own
    path = Path(name).expanduser()
    if path.exists():
        return path, drafter
    close = difflib.get_close_matches(name, list(BUNDLED), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else f" Known models: {', '.join(BUNDLED)}."
    raise DFlashError(f"'{name}' is neither a known model nor a path.{hint}")
