"""`dflash serve MODEL --engine vllm|sglang`: the launch commands, parsed back into their arguments."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from one_error import assert_one_error
from typer.testing import CliRunner

from dflash_local.cli import app

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def serve(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def command(*args: str) -> list[str]:
    result = serve(*args)
    assert result.exit_code == 0, result.output
    return shlex.split(result.stdout)


def test_vllm_gets_the_drafter_in_its_speculative_config():
    argv = command("qwen3-4b", "--engine", "vllm", "--block-size", "16")
    assert argv[:4] == ["vllm", "serve", "Qwen/Qwen3-4B", "--speculative-config"]
    assert len(argv) == 5
    config = json.loads(argv[4])
    assert config == {"method": "dflash", "model": "z-lab/Qwen3-4B-DFlash-b16", "num_speculative_tokens": 15}


def test_sglang_gets_the_dflash_algorithm_and_the_block_as_draft_tokens():
    argv = command("qwen3-4b", "--engine", "sglang", "--block-size", "8")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    options = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert options == {
        "--model-path": "Qwen/Qwen3-4B",
        "--speculative-algorithm": "DFLASH",
        "--speculative-draft-model-path": "z-lab/Qwen3-4B-DFlash-b16",
        "--speculative-num-draft-tokens": "8",
    }


def test_a_gguf_entry_hands_off_its_unquantized_target_or_says_why_not():
    argv = command("qwen3-8b-q4", "--engine", "vllm", "--block-size", "16")
    assert argv[2] == "Qwen/Qwen3-8B"
    assert json.loads(argv[4])["model"] == "z-lab/Qwen3-8B-DFlash-b16"
    result = serve("llama3-8b-q4", "--engine", "sglang", "--block-size", "16")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: 'llama3-8b-q4' is a GGUF target") and "need an HF target" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""


def test_the_bundled_pair_uses_its_folders_and_the_drafters_trained_block():
    argv = command("tiny", "--engine", "vllm")
    assert argv[2] == str((TINY / "target").resolve())
    config = json.loads(argv[4])
    assert config["model"] == str((TINY / "drafter").resolve())
    assert (
        config["num_speculative_tokens"] == json.loads((TINY / "drafter" / "config.json").read_text())["block_size"] - 1
    )


def test_exec_runs_the_printed_command(monkeypatch):
    ran = []
    monkeypatch.setattr(os, "execvp", lambda file, args: ran.append((file, args)))
    printed = command("qwen3-4b", "--engine", "sglang", "--block-size", "16", "--exec")
    assert ran == [("python", printed)]


def test_refusals_are_one_error_line(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for args, message in (
        (("tiny", "--engine", "tgi"), "error: --engine must be vllm or sglang, got 'tgi'."),
        ((str(gguf), "--engine", "vllm", "--drafter", str(TINY / "drafter")), f"error: {gguf} is a GGUF file"),
        (("tiny", "--exec"), "error: --exec runs an engine's command"),
    ):
        assert assert_one_error(serve(*args)).startswith(message)
