"""The status line while a command starts: on a terminal it says what runs; through pipes nothing of it is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect


def test_first_start_says_what_runs_until_the_prompt(tmp_path: Path):
    env = {**os.environ, "DFLASH_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "COLUMNS": "150"}  # nothing cached
    child = pexpect.spawn(
        sys.executable,
        ["-m", "dflash_local", "chat"],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(24, 150),
    )
    child.expect_exact("starting: importing libraries", timeout=20)  # drawn 0.2 s after the start
    for phase in ("loading the target", "loading the drafter", "calibrating: timing each block size", ">>> "):
        child.expect_exact(phase)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_piped_commands_get_no_status_line(tmp_path: Path):
    env = {**os.environ, "DFLASH_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "dflash_local", "models"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "importing libraries" not in result.stdout + result.stderr
    assert "tiny" in result.stdout
