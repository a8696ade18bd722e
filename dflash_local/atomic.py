"""Writing a file so that a reader never sees it half-written, and checking a folder can be written at all."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to path through a sibling `.partial` file of this thread's own and a rename (creating the folder):
    serve --parallel's workers may save the same file at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def unwritable_reason(folder: Path) -> str | None:
    """Why new files cannot be made in folder (created if missing), or None when they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
