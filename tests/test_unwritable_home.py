"""An unwritable DFLASH_HOME costs only the block-cost cache: generation runs, and stderr says so in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_an_unwritable_dflash_home_is_one_warning_and_the_answer_still_comes(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "dflash"  # under a regular file: unwritable even for root
    env = {**os.environ, "DFLASH_HOME": str(home), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "dflash_local", "generate", "--target", "tiny", "--prompt", "def f(x):"]
    result = subprocess.run([*args, "--max-new-tokens", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {home / 'block-costs'} is not writable (Not a directory): block sizes are timed afresh at every "
        "load; set DFLASH_HOME to a writable folder to keep them."
    ]
