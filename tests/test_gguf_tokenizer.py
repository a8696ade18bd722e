"""The tokenizer and chat template inside a GGUF file: same ids as tokenizer.json, and `dflash chat FILE.gguf`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import invoke

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from dflash_local.gguf.convert import convert  # noqa: E402
from dflash_local.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from dflash_local.tokenizer import TextTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
TEXTS = ["def main():\n    return 1", "Hello, world! How are you?", "  spaces\tand tabs\n\n", "héllo wörld ✓"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return convert(TINY / "target", tmp_path_factory.mktemp("tok") / "tiny-f16.gguf", "f16", threads=1)


def test_gguf_tokenizer_matches_tokenizer_json(gguf_file):
    ours, reference = GGUFTokenizer.load(gguf_file), TextTokenizer.load(TINY / "target")
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(reference.encode(text)) == reference.decode(reference.encode(text))
    messages = [{"role": "user", "content": "Write a loop."}, {"role": "assistant", "content": "for i in x:"}]
    assert ours.encode_chat(messages) == reference.encode_chat(messages)
    assert ours.token_id("<|end|>") == reference.token_id("<|end|>") == 3
    long = [i for i in range(4096) if len(reference.decode([i]).encode()) > 32]  # pieces past a 32-byte buffer
    assert long and ours.decode(long) == reference.decode(long)


def test_chat_with_a_gguf_file_uses_its_template(gguf_file):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dflash_local", "chat", str(gguf_file), "--drafter", str(TINY / "drafter")]
    result = subprocess.run(
        [*command, "--max-new-tokens", "24"], input="Write a function.\n", capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr and "tau" in result.stderr  # the status line; answers alone on stdout
    assert result.stdout.strip()
    generated = invoke(
        "generate", "--target", gguf_file, "--no-draft", "--prompt", "def main():", "--max-new-tokens", "8", "--json"
    )
    assert generated.exit_code == 0, generated.stderr
    assert json.loads(generated.stdout)["text"]
