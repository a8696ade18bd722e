"""An unwritable DFLASH_HOME costs only the block-cost cache: generation runs, and stderr says so in one line."""

from __future__ import annotations

from pathlib import Path

from in_process import invoke


def test_an_unwritable_dflash_home_is_one_warning_and_the_answer_still_comes(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "dflash"  # under a regular file: unwritable even for root
    args = ["generate", "--target", "tiny", "--prompt", "def f(x):", "--max-new-tokens", "4"]
    result = invoke(*args, env={"DFLASH_HOME": str(home)})
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {home / 'block-costs'} is not writable (Not a directory): block sizes are timed afresh at every "
        "load; set DFLASH_HOME to a writable folder to keep them."
    ]
