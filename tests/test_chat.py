"""`dflash chat tiny` driven through a pseudo-terminal, and as a plain pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pexpect

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", "COLUMNS": "120"}
PROMPT = ">>> "


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable, ["-m", "dflash_local", "chat", "tiny", *args], env=ENV, encoding="utf-8", timeout=120
    )
    child.expect_exact(PROMPT)
    return child


def test_chat_streams_with_status_and_commands():
    child = spawn("--max-new-tokens", "40")
    child.sendline("Write a Python function `clamp(x, lo, hi)` that clamps x.")
    child.expect(r"tok/s")
    child.expect(r"tau \d+\.\d\d")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect("acceptance histogram")
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.sendline("/draft off")
    child.expect_exact("(drafting off)")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_program():
    child = spawn("--max-new-tokens", "1500", "--ignore-eos")
    child.sendline("def fibonacci(n):")
    child.expect(r"tok/s")  # the answer is streaming
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_as_a_pipe():
    result = subprocess.run(
        [sys.executable, "-m", "dflash_local", "chat", "tiny", "--max-new-tokens", "16"],
        input="Explain what `os.path.join` does.\n/unknown\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout and "unknown command /unknown" in result.stdout


def test_unknown_model_suggests_close_names():
    result = subprocess.run(
        [sys.executable, "-m", "dflash_local", "chat", "tinyy"], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: 'tinyy' is neither a known model, a Hub repo (owner/name) nor a path. Did you mean tiny?"
    )


def test_a_path_that_is_not_a_model():
    readme = Path(__file__).resolve().parent.parent / "README.md"
    result = subprocess.run(
        [sys.executable, "-m", "dflash_local", "chat", str(readme)], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert result.returncode == 1
    expected = f"error: {readme} is neither a model folder (config.json + safetensors) nor a .gguf file."
    assert result.stderr.strip() == expected
