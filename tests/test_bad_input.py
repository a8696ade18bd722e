"""Every bad input a user can give ends in one `error: <sentence>` line on stderr and exit status 1.

Errors that come before any model loads are checked through the CLI in this process (Typer's CliRunner: exit
status and stderr as the console script gives them); a subprocess only where a real one is needed (argv bytes, a
killed convert, the console script). Rules with many cases (config fields, catalog shapes, sampling ranges) are
checked on the function that applies them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from in_process import invoke
from one_error import assert_one_error
from typer.testing import CliRunner, Result

from dflash_local import __version__, bench, chat, cli, generation, runtime
from dflash_local.catalog import load_catalog
from dflash_local.cli import files, values
from dflash_local.drafters.config import DrafterConfig
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec
from dflash_local.sampling import SamplingParams
from dflash_local.target_config import TargetConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.weights import read_config

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def child_env() -> dict[str, str]:
    """The subprocesses' environment, read when they start (after conftest points DFLASH_HOME at the session)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def dflash(*args: str | bytes | Path, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dflash_local", *(a if isinstance(a, bytes) else str(a) for a in args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env or child_env())


def assert_exact_error(result: subprocess.CompletedProcess | Result, message: str) -> None:
    """Exit status 1 and a whole stderr of exactly `error: message` (one line, no traceback)."""
    assert assert_one_error(result) == f"error: {message}"


GENERATE = ("generate", "--target", "tiny", "--no-draft", "--prompt-ids", "1,2")
OPTION_CASES = {
    "temperature nan": (["--temperature", "nan"], "The temperature must be a finite number, 0 or more, got nan."),
    "block size 0": (
        ["--block-size", "0"],
        "--block-size must be at least 2 (up to the drafter's trained size), got 0.",
    ),
    "block size 1": (
        ["--block-size", "1"],
        "--block-size must be at least 2 (up to the drafter's trained size), got 1.",
    ),
    "empty id": (
        ["--prompt-ids", "1,,3"],
        "--prompt-ids must be comma-separated integers, got '1,,3' (element 2 is empty).",
    ),
    "id not a number": (
        ["--prompt-ids", "1,x"],
        "--prompt-ids must be comma-separated integers, got '1,x' ('x' is not an integer).",
    ),
    "context -1": (["--max-context", "-1"], "--max-context must be at least 1 token, got -1."),
    "no new tokens": (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0."),
    "seed over 64 bits": (["--seed", str(2**64)], f"--seed must be a whole number from 0 to {2**64 - 1}, got {2**64}."),
    "seed negative": (["--seed", "-1"], f"--seed must be a whole number from 0 to {2**64 - 1}, got -1."),
    "threads 0": (["--threads", "0"], "--threads must be at least 1, got 0."),
    "drafter kind": (["--drafter-kind", "gpu"], "Unknown drafter kind 'gpu' (use auto, torch, native)."),
}


@pytest.mark.parametrize("case", OPTION_CASES)
def test_generate_options_out_of_range(case):
    extra, message = OPTION_CASES[case]
    assert_exact_error(invoke(*GENERATE, *extra), message)


def test_runtime_defaults_come_from_the_environment():
    """DFLASH_KERNELS sets --kernels' default: a bad value is refused like the flag's."""
    result = invoke(*GENERATE, env={"DFLASH_KERNELS": "cuda"})
    assert_exact_error(result, "Unknown kernels 'cuda' (use auto, triton, torch).")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((float("inf"), 1.0, 0), "The temperature must be a finite number, 0 or more, got inf."),
        ((-0.5, 1.0, 0), "The temperature must be a finite number, 0 or more, got -0.5."),
        ((0.7, 0.0, 0), "top-p must be in (0, 1], got 0.0."),
        ((0.7, 1.5, 0), "top-p must be in (0, 1], got 1.5."),
        ((0.7, float("nan"), 0), "top-p must be in (0, 1], got nan."),
        ((0.7, 1.0, -3), "top-k must be a whole number, 0 (off) or more, got -3."),
    ],
)
def test_sampling_params_reject_what_cannot_sample(values, message):
    """The check chat's /temp relies on too."""
    with pytest.raises(DFlashError) as caught:
        SamplingParams(*values)
    assert str(caught.value) == message


def test_numbers_are_refused_before_loading():
    with pytest.raises(DFlashError) as caught:
        values.parse_ids("1 2", "--prompt-ids")
    assert str(caught.value) == "--prompt-ids must be comma-separated integers, got '1 2' ('1 2' is not an integer)."
    assert values.parse_ids(" 1, 2 ,3", "--prompt-ids") == [1, 2, 3]
    for args, message in (
        ((-5, 4096), "--max-new-tokens must be at least 1, got -5."),
        ((8, 0), "--max-context must be at least 1 token, got 0."),
    ):
        with pytest.raises(DFlashError) as caught:
            values.check_numbers(*args)
        assert str(caught.value) == message
    for option, message in (
        ("-3", "--block-size must be at least 2 (up to the drafter's trained size), got -3."),
        ("eight", "--block-size must be auto or a whole number, got 'eight'."),
    ):
        with pytest.raises(DFlashError) as caught:
            values.block_size(option)
        assert str(caught.value) == message
    assert values.block_size("auto") is None and values.block_size("8") == 8
    with pytest.raises(DFlashError) as caught:
        generation.load_models(TINY / "target", None, LoadSpec(max_context=0))
    assert str(caught.value) == "The context (--max-context) must be at least 1 token, got 0."


def test_prompt_that_is_not_utf8():
    """argv bytes that are not UTF-8 are an error (not replaced silently); the --prompt help says so."""
    result = dflash("generate", "--target", "tiny", "--no-draft", "--prompt", b"ab\xff\xfe")
    message = (
        "--prompt is not valid UTF-8 text (the byte 0xff at position 2): pass UTF-8, or token ids with --prompt-ids."
    )
    assert_exact_error(result, message)
    help_text = CliRunner().invoke(cli.app, ["generate", "--help"], env={"COLUMNS": "200"}).output
    assert "Prompt text, UTF-8 (other bytes are an error)" in help_text


# --- config.json of a target and of a drafter ---------------------------------------------------------------


def _config(kind: str) -> dict:
    return json.loads((TINY / kind / "config.json").read_text())


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def _llama3(config: dict, **rope) -> dict:
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    return {**_without(config, "rope_parameters", "rope_theta"), "rope_scaling": {**scaling, **rope}}


TARGET = _config("target")
TARGET_CASES = [
    ({**TARGET, "rms_norm_eps": "1e-6"}, 'rms_norm_eps must be a positive number, got "1e-6".'),
    ({**TARGET, "hidden_size": -8}, "hidden_size must be a positive integer, got -8."),
    ({**TARGET, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0."),
    ({**TARGET, "vocab_size": 0}, "vocab_size must be a positive integer, got 0."),
    ({**TARGET, "vocab_size": 4096.5}, "vocab_size must be a positive integer, got 4096.5."),
    (
        {**_without(TARGET, "head_dim"), "num_attention_heads": 6},
        "num_attention_heads (6) must divide hidden_size (256) when head_dim is absent.",
    ),
    ({**TARGET, "num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)."),
    ({**TARGET, "tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false".'),
    ({**TARGET, "max_position_embeddings": None}, "max_position_embeddings must be a positive integer, got null."),
    (
        _llama3(TARGET, high_freq_factor=4.0),
        "rope_scaling lacks original_max_position_embeddings, which llama3 RoPE needs.",
    ),
    (
        _llama3(TARGET, high_freq_factor=1.0, original_max_position_embeddings=8192),
        "rope_scaling.high_freq_factor must be larger than low_freq_factor.",
    ),
    ({**TARGET, "rope_parameters": "default"}, 'rope_parameters must be an object or null, got "default".'),
    ({**TARGET, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, 'RoPE type "yarn" is not supported'),
]


@pytest.mark.parametrize(("config", "message"), TARGET_CASES)
def test_target_config_fields(config, message, tmp_path):
    with pytest.raises(DFlashError) as caught:
        TargetConfig.from_dict(config, tmp_path)
    assert str(caught.value).startswith(f"{tmp_path}/config.json: {message}")


DRAFTER = _config("drafter")
DRAFTER_CASES = [
    ({**DRAFTER, "hidden_size": "256"}, 'hidden_size must be a positive integer, got "256".'),
    ({**DRAFTER, "vocab_size": 0}, "vocab_size must be a positive integer, got 0."),
    ({**DRAFTER, "block_size": 0}, "block_size must be an integer of at least 2, got 0."),
    ({**DRAFTER, "block_size": "16"}, 'block_size must be an integer of at least 2, got "16".'),
    (
        {**DRAFTER, "dflash_config": {"mask_token_id": -1, "target_layer_ids": [1]}},
        "dflash_config.mask_token_id must be an integer of at least 0, got -1.",
    ),
    (
        {**DRAFTER, "dflash_config": {"mask_token_id": 4, "target_layer_ids": "1,3,5"}},
        'dflash_config.target_layer_ids must be a non-empty list of layer numbers, got "1,3,5".',
    ),
    ({**DRAFTER, "dflash_config": [4]}, "dflash_config must be an object, got [4]."),
    ({**DRAFTER, "layer_types": ["full_attention"]}, "layer_types must list one attention type per layer (2)."),
    ({**DRAFTER, "num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)."),
]


@pytest.mark.parametrize(("config", "message"), DRAFTER_CASES)
def test_drafter_config_fields(config, message, tmp_path):
    with pytest.raises(DFlashError) as caught:
        DrafterConfig.from_dict(config, tmp_path)
    assert str(caught.value) == f"{tmp_path}/config.json: {message}"


def test_bad_config_through_the_cli(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**TARGET, "hidden_size": -8}))
    args = ("--target", target, "--no-draft", "--prompt-ids", "1,2")
    message = f"{target}/config.json: hidden_size must be a positive integer, got -8."
    assert_exact_error(invoke("generate", *args), message)
    (target / "config.json").write_text("[1, 2]")
    with pytest.raises(DFlashError) as caught:
        read_config(target)
    assert str(caught.value) == f"{target}/config.json does not hold a JSON object."


# --- the model catalog (DFLASH_CATALOG) -----------------------------------------------------------------------

GOOD_ENTRY = '[mine]\ntarget = { repo = "someone/model" }\n'
CATALOG_CASES = {
    "not a table": ("mine = 3\n", "entry 'mine' must be a table ([mine] with a target), got 3."),
    "no target": ("[mine]\nsummary = 'x'\n", "entry 'mine' has no target."),
    "typo": (GOOD_ENTRY + "drafer = 'x'\n", "entry 'mine' has an unknown key 'drafer'"),
    "backend": (
        GOOD_ENTRY + "backend = 'tensorflow'\n",
        "entry 'mine': backend must be auto, torch, llamacpp, got 'tensorflow'.",
    ),
    "memory": (
        GOOD_ENTRY + "memory_gb = '8'\n",
        "entry 'mine': memory_gb must be a number of GB (0 or more), got '8'.",
    ),
    "quantize": (
        GOOD_ENTRY + "quantize = 'int3'\n",
        "entry 'mine': quantize must be 'int4', 'nf4' or left out, got 'int3'.",
    ),
    "summary": (GOOD_ENTRY + "summary = 1\n", "entry 'mine': summary must be a string, got 1."),
    "target type": (
        "[mine]\ntarget = 3\n",
        'entry \'mine\': target must be "bundled:PATH" or { repo = "owner/name" }, got 3.',
    ),
    "repo dots": (
        "[mine]\ntarget = { repo = 'a/b..c' }\n",
        "entry 'mine': target: repo must be a valid Hub repo name (owner/name), got 'a/b..c'.",
    ),
    "repo no owner": (
        "[mine]\ntarget = { repo = 'model' }\n",
        "entry 'mine': target: repo must be a valid Hub repo name (owner/name), got 'model'.",
    ),
    "repo missing": ("[mine]\ntarget = { files = ['x'] }\n", "entry 'mine': target has no repo."),
    "files": (
        GOOD_ENTRY + "drafter = { repo = 'a/b', files = 'x' }\n",
        "entry 'mine': drafter: files must be a non-empty list of file names or patterns, got 'x'.",
    ),
    "prompts": (
        GOOD_ENTRY + "prompts = { repo = 'a/b' }\n",
        "entry 'mine': prompts must be \"bundled:PATH\", got {'repo': 'a/b'}.",
    ),
}


@pytest.mark.parametrize("case", CATALOG_CASES)
def test_catalog_shapes(case, tmp_path, monkeypatch):
    text, message = CATALOG_CASES[case]
    path = tmp_path / "catalog.toml"
    path.write_text(text)
    monkeypatch.setenv("DFLASH_CATALOG", str(path))
    with pytest.raises(DFlashError) as caught:
        load_catalog()
    assert str(caught.value).startswith(f"{path}: {message}")


def test_good_user_catalog_loads_and_bad_one_stops_the_cli(tmp_path, monkeypatch):
    path = tmp_path / "catalog.toml"
    path.write_text(GOOD_ENTRY + 'drafter = { repo = "someone/drafter", files = ["*.json"], revision = "v1" }\n')
    monkeypatch.setenv("DFLASH_CATALOG", str(path))
    entry = load_catalog()["mine"]
    assert (entry.target.repo, entry.drafter.patterns, entry.drafter.revision) == ("someone/model", ("*.json",), "v1")
    path.write_bytes(b"[mine]\nsummary = '\xff'\n")
    with pytest.raises(DFlashError, match="cannot be read"):
        load_catalog()
    path.write_text("[mine]\ntarget = { repo = 'a/b..c' }\n")
    message = f"{path}: entry 'mine': target: repo must be a valid Hub repo name (owner/name), got 'a/b..c'."
    assert_exact_error(invoke("models", env={"DFLASH_CATALOG": str(path)}), message)


# --- folders that cannot be written ---------------------------------------------------------------------------


def test_unwritable_cache_folders(tmp_path, monkeypatch):
    """HF_HOME and DFLASH_HOME under a regular file: unwritable even for root. Nothing is fetched (no Hub here)."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    hub = {"HF_HUB_CACHE": None, "XDG_CACHE_HOME": None, "HF_ENDPOINT": "http://127.0.0.1:9"}  # None: unset
    bad = blocker / "sub"
    result = invoke("pull", "someone/model", env=hub | {"HF_HOME": str(bad), "DFLASH_HOME": str(tmp_path / "dflash")})
    message = f"The Hugging Face cache {bad}/hub (from HF_HOME={bad}) is not writable (Not a directory): "
    assert_exact_error(result, message + "point HF_HOME at a writable folder.")
    for name, value in (hub | {"HF_HOME": str(tmp_path / "hf"), "DFLASH_HOME": str(bad)}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(DFlashError) as caught:
        files.resolve("someone/model", None, False, None)  # what generate/chat/bench call before pulling
    message = f"The dflash folder {bad} (from DFLASH_HOME={bad}) is not writable (Not a directory): "
    assert str(caught.value) == message + "point DFLASH_HOME at a writable folder."
    assert files.resolve("tiny", None, False, None).target == TINY / "target"  # bundled: nothing is written


def test_convert_out_that_cannot_be_written(tmp_path):
    pytest.importorskip("llama_cpp")
    from dflash_local.gguf.convert import convert

    folder = tmp_path / "model.gguf"
    folder.mkdir()
    message = f"--out {folder} is an existing folder; name the GGUF file to write, e.g. {folder}/model.gguf."
    assert_exact_error(invoke("convert", TINY / "target", "--out", folder), message)
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "sub" / "x.gguf"
    with pytest.raises(DFlashError) as caught:
        convert(TINY / "target", out)
    assert str(caught.value) == f"Cannot write {out}: its folder {out.parent} is not writable (Not a directory)."


def test_killed_convert_leaves_nothing_after_the_next_run(tmp_path):
    """SIGKILL a convert while it writes its staging file; the next convert removes the leftover."""
    pytest.importorskip("llama_cpp")
    from dflash_local.gguf.file import read_gguf

    out = tmp_path / "tiny.gguf"
    argv = [sys.executable, "-m", "dflash_local", "convert", str(TINY / "target"), "--out", str(out), "--type", "f16"]
    process = subprocess.Popen(argv, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = tmp_path / f"tiny.gguf.dflash-convert-{process.pid}" / "staged.gguf"
    deadline = time.monotonic() + 120
    while not (staged.is_file() and staged.stat().st_size > 0) and process.poll() is None:
        assert time.monotonic() < deadline, "the convert never staged its file"
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the convert finished before it could be killed"
    assert staged.parent.is_dir() and not out.exists()
    result = dflash("convert", TINY / "target", "--out", out, "--type", "f16")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
    model = read_gguf(out)  # complete: every tensor lies inside the file
    assert (model.architecture, model.dims.layers, model.dims.vocab) == ("llama", 8, 4096)


# --- running out of memory (simulated) ------------------------------------------------------------------------


def _oom(*_, **__):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_is_one_sentence(monkeypatch):
    """Simulated: no GPU here, so each load or step raises torch.cuda.OutOfMemoryError through a monkeypatch."""
    runner = CliRunner()
    args = ["generate", "--target", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "4", "--max-context", "512"]
    target = TINY / "target"
    with monkeypatch.context() as patch:
        patch.setattr(TorchLlamaTarget, "load", _oom)
        patch.setattr(runtime, "pick_device", lambda name: "cuda")
        result = runner.invoke(cli.app, args)
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: The target {target} with a 512-token KV cache does not fit in GPU memory: "
        "try a smaller --max-context, --quantize int4, a smaller model or --device cpu.\n"
    )
    with monkeypatch.context() as patch:
        patch.setattr(DFlashDrafter, "load", _oom)
        result = runner.invoke(cli.app, args)
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: The drafter {TINY / 'drafter'} with a 512-token cache does not fit in memory: "
        "try a smaller --max-context or a smaller model.\n"
    )
    with monkeypatch.context() as patch:
        patch.setattr(generation, "generate", _oom)
        result = runner.invoke(cli.app, args)
    assert result.exit_code == 1
    assert result.stderr == (
        "error: A decoding step at 2 tokens of context does not fit in memory: "
        "try a smaller --max-context or a smaller model.\n"
    )
    advice = "does not fit in memory: try a smaller --max-context or a smaller model.\n"
    with monkeypatch.context() as patch:
        patch.setattr(chat, "run_chat", _oom)
        result = runner.invoke(cli.app, ["chat", "tiny", "--max-context", "512"])
    assert (result.exit_code, result.stderr) == (1, f"error: Answering in this conversation {advice}")
    with monkeypatch.context() as patch:
        patch.setattr(bench, "run_bench", _oom)
        result = runner.invoke(cli.app, ["bench", "tiny", "--limit", "1"])
    assert (result.exit_code, result.stderr) == (1, f"error: A benchmark run of tiny {advice}")


# --- the version ----------------------------------------------------------------------------------------------


def test_version():
    script = Path(sys.executable).parent / "dflash"
    for argv in ([str(script), "--version"], [sys.executable, "-m", "dflash_local", "--version"]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env())
        assert (result.returncode, result.stdout, result.stderr) == (0, f"dflash-local {__version__}\n", "")
