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


def test_loading_returns_the_warning_and_prints_nothing(tmp_path: Path, monkeypatch, capfd):
    """Below the CLI the warning is data: load_models hands it back in LoadedModels.warnings (once) and writes
    nothing to stdout or stderr; a writable folder warns of nothing."""
    from dflash_local.generation import load_models
    from dflash_local.runtime import LoadSpec

    tiny = Path(__file__).resolve().parent.parent / "models" / "tiny"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH_HOME", str(blocker / "dflash"))
    models = load_models(tiny / "target", tiny / "drafter", LoadSpec(max_context=512))
    assert models.warnings == (
        f"warning: {blocker / 'dflash' / 'block-costs'} is not writable (Not a directory): block sizes are timed "
        "afresh at every load; set DFLASH_HOME to a writable folder to keep them.",
    )
    assert capfd.readouterr() == ("", "")
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "writable"))
    assert load_models(tiny / "target", tiny / "drafter", LoadSpec(max_context=512)).warnings == ()
