"""`dflash generate`: JSON output, and one clear sentence with a non-zero exit for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import invoke
from one_error import assert_one_error
from tiny_models import add_char_tokenizer, make_drafter, make_target


def dflash(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models; keeps parallel test runs from contending
    return subprocess.run(
        [sys.executable, "-m", "dflash_local", *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def texted_target(tmp_path_factory, llama_target) -> Path:
    folder = tmp_path_factory.mktemp("texted") / "target"
    shutil.copytree(llama_target, folder)
    add_char_tokenizer(folder, 64)
    return folder


def test_generate_json(llama_target, drafters):
    result = invoke(
        "generate",
        "--target",
        llama_target,
        "--drafter",
        drafters["llama", 2],
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "20",
        "--block-size",
        "4",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("output_ids", "acceptance_lengths", "tau", "decode_tokens_per_s", "prefill_s"):
        assert key in report
    assert len(report["output_ids"]) == 20
    assert sum(report["acceptance_lengths"]) == 19
    baseline = json.loads(
        invoke(
            "generate",
            "--target",
            llama_target,
            "--no-draft",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "20",
            "--json",
        ).stdout
    )
    assert baseline["output_ids"] == report["output_ids"]


def test_generate_text_streams(texted_target, drafters):
    result = invoke(
        "generate",
        "--target",
        texted_target,
        "--drafter",
        drafters["llama", 1],
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "12",
    )
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.strip("\n")) == 12
    assert "tau" in result.stderr
    report = json.loads(
        invoke(
            "generate",
            "--target",
            texted_target,
            "--drafter",
            drafters["llama", 1],
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "12",
            "--json",
        ).stdout
    )
    assert report["text"] == result.stdout.strip("\n")


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, llama_target, drafters) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    narrow = make_target(root / "narrow", hidden_size=32, vocab_size=64)
    wide_vocab = make_target(root / "wide_vocab", vocab_size=80)
    truncated = root / "truncated"
    shutil.copytree(llama_target, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    corrupted = root / "corrupted"
    shutil.copytree(llama_target, corrupted)
    data = bytearray((corrupted / "model.safetensors").read_bytes())
    data[8:40] = b"\x00garbage-not-a-json-header\xff\xfe\x00\x01"
    (corrupted / "model.safetensors").write_bytes(bytes(data))
    (root / "empty").mkdir()
    return {
        "narrow_drafter": make_drafter(root / "narrow_drafter", narrow, target_layer_ids=[1]),
        "deep_drafter": make_drafter(root / "deep_drafter", llama_target, target_layer_ids=[1, 6]),
        "vocab_drafter": make_drafter(root / "vocab_drafter", wide_vocab, target_layer_ids=[1]),
        "good_drafter": drafters["llama", 1],
        "truncated": truncated,
        "corrupted": corrupted,
        "empty": root / "empty",
    }


CASES = {
    "drafter hidden size": (["--drafter", "narrow_drafter"], "hidden size 32 does not match the target's 64"),
    "drafter layer ids": (["--drafter", "deep_drafter"], "reads target layers [1, 6], but the target has only 4"),
    "drafter vocab": (["--drafter", "vocab_drafter"], "vocabulary (80 tokens) does not match the target's (64)"),
    "no config": (["--target", "empty", "--no-draft"], "has no config.json"),
    "truncated weights": (["--target", "truncated", "--no-draft"], "is truncated or corrupted"),
    "corrupted weights": (["--target", "corrupted", "--no-draft"], "is truncated or corrupted"),
    "id outside vocab": (["--no-draft", "--prompt-ids", "1,64"], "Prompt token id 64 is outside the vocabulary"),
    "empty prompt ids": (["--no-draft", "--prompt-ids", ""], "The prompt is empty."),
    "prompt without tokenizer": (["--no-draft", "--prompt", "hello"], "has no tokenizer.json"),
    "missing drafter": (["--no-lookup"], "Pass --drafter DIR, drop --no-lookup, or --no-draft"),
    "bad block size": (["--drafter", "good_drafter", "--block-size", "40"], "between 2 and the drafter's trained 16"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_sentence(case, bad_files, llama_target):
    extra, message = CASES[case]
    args = {"--target": str(llama_target), "--prompt-ids": "1,2"}
    flags: list[str] = []
    it = iter(extra)
    for arg in it:
        if arg.startswith("--") and arg not in ("--no-draft", "--no-lookup"):
            value = next(it)
            args[arg] = str(bad_files.get(value, value))
        else:
            flags.append(arg)
    if "--prompt" in args:
        del args["--prompt-ids"]
    argv = [item for pair in args.items() for item in pair] + flags
    assert_one_error(invoke("generate", *argv), message)


def test_empty_text_prompt(texted_target):
    result = invoke("generate", "--target", texted_target, "--no-draft", "--prompt", "")
    assert result.exit_code == 1 and result.stderr.strip() == "error: The prompt is empty."


def test_quantized_drafter_from_the_command_line_is_lossless():
    pytest.importorskip("bitsandbytes")
    base = ("generate", "--target", "tiny", "--prompt", "def main():", "--max-new-tokens", "24", "--json")
    plain = json.loads(invoke(*base, "--no-draft").stdout)
    for kind in ("int8", "nf4"):
        result = invoke(*base, "--drafter-quantize", kind)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["output_ids"] == plain["output_ids"]
    assert invoke(*base, "--drafter-quantize", "int4").stderr.strip() == (
        "error: --drafter-quantize must be none, int8 or nf4, got 'int4'."
    )


def test_decode_options_build_the_settings_of_every_command():
    """The one builder of decode's Settings: drafting unless --no-draft, or no drafter is loaded and --no-lookup; the
    end-of-sequence ids unless --ignore-eos, the block size checked (auto: None), sampling and seed as given."""
    from dflash_local.cli.options import DecodeOptions
    from dflash_local.errors import DFlashError
    from dflash_local.generation import LoadedModels
    from dflash_local.sampling import SamplingParams

    paired, alone = (LoadedModels(None, drafter, None, frozenset({2})) for drafter in (object(), None))
    given = DecodeOptions(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, block_size="4")
    settings = given.settings(paired)
    assert (settings.max_new_tokens, settings.block_size, settings.draft, settings.seed) == (7, 4, True, 11)
    assert settings.sampling == SamplingParams(0.5, 0.9, 3) and settings.stop_ids == frozenset({2})
    assert DecodeOptions(no_draft=True).settings(paired).draft is False
    assert DecodeOptions(lookup=False).settings(alone).draft is False
    assert DecodeOptions().settings(alone).draft is True and DecodeOptions().settings(alone).lookup is True
    assert DecodeOptions(ignore_eos=True).settings(paired).stop_ids == frozenset()
    assert DecodeOptions().settings(paired).block_size is None
    with pytest.raises(DFlashError, match="--block-size must be at least 2"):
        DecodeOptions(block_size="1").settings(paired)
