"""The coding agents the serve tests drive, installed from the npm registry at pinned versions into the tests' own
cache (once; later runs reuse it): Claude Code (`@anthropic-ai/claude-code`) and Codex CLI (`@openai/codex`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332")
CODEX = ("@openai/codex", "0.171.0")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-local-tests" / "npm"


def installed(package: tuple[str, str]) -> Path:
    """The package's folder in the cache, installed there with npm if it is not yet."""
    name, version = package
    folder = CACHE / f"{name.replace('/', '+')}@{version}"
    where = folder / "node_modules" / name
    if not (where / "package.json").is_file():
        npm = shutil.which("npm")
        assert npm, "npm (Node.js 20 or later) is needed to install the coding agents the serve tests drive"
        command = [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", f"{name}@{version}"]
        subprocess.run(command, check=True, capture_output=True, timeout=900)
    return where


def claude_code() -> list[str]:
    """The command that runs Claude Code (its wrapper finds the platform's native binary)."""
    return [shutil.which("node") or "node", str(installed(CLAUDE_CODE) / "cli-wrapper.cjs")]


def codex() -> list[str]:
    """The command that runs Codex CLI."""
    return [shutil.which("node") or "node", str(installed(CODEX) / "bin" / "codex.js")]
