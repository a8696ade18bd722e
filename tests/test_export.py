"""`dflash export`: drafters in z-lab's layout draft in vLLM's `speculators` as they draft here, a broken config field
is caught there, vLLM itself reads and loads them from the printed line, and the drafter GGUF is llama.cpp's
converter's and drafts natively."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest
import torch
from in_process import invoke
from one_error import assert_one_error
from reference import oracle_python
from safetensors.torch import load_file, save_file
from test_architectures import llama_cpp_source
from tiny_models import add_char_tokenizer, make_target

from dflash_local.drafters.config import DrafterConfig
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.train.pipeline import TrainRequest, run_training
from dflash_local.train.selfdistill import DistillSettings
from dflash_local.train.trainer import TrainSettings
from dflash_local.weights import read_config

TESTS = Path(__file__).resolve().parent
TINY = TESTS.parent / "models" / "tiny"
TOLERANCE = 1e-4  # float32 on both sides, the same weights: measured max |diff| 1.3e-5 (bundled), 4.8e-7 (trained)
CORPUS = "def add(a, b):\n    return a + b\n\n\nclass Counter:\n    count = 0\n" * 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A target and the drafter `dflash train` writes for it in a few steps."""
    root = tmp_path_factory.mktemp("trained")
    target = make_target(root / "target", vocab_size=96, seed=3, std=0.1)
    add_char_tokenizer(target, 96)
    (root / "corpus").mkdir()
    (root / "corpus" / "code.py").write_text(CORPUS)
    request = TrainRequest(
        target=target,
        corpus=[root / "corpus"],
        out=root / "drafter",
        prompt_tokens=16,
        max_prompts=8,
        mask_token_id=95,
        distill=DistillSettings(new_tokens=16, batch_size=8, shard_size=8, sampled_fraction=0.0),
        train=TrainSettings(layers=2, block_size=4, steps=3, batch_size=4, anchors=4, eval_every=100),
    )
    list(run_training(request))
    return target, root / "drafter"


def _export(drafter: Path | str, to: str, out: Path, *more: str) -> str:
    result = invoke("export", drafter, "--to", to, "--out", out, *more)
    assert result.exit_code == 0, result.stderr
    return result.stdout


def _corrupt(exported: Path, out: Path, change) -> Path:
    """A copy of an exported folder whose dflash_config `change` edited."""
    shutil.copytree(exported, out)
    config = read_config(out)
    change(config["dflash_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def _ours(target: Path, drafter: Path, states: dict[str, torch.Tensor], ids: list[int], start: int) -> torch.Tensor:
    """Our drafter's logits for the block [ids[start], MASK...] at start, over the target features of 0..start-1
    (hidden_states[id + 1] for each target layer id)."""
    model = TorchLlamaTarget.load(target, LoadSpec())
    ours = DFlashDrafter.load(drafter, LoadSpec(max_context=256))
    features = torch.cat([states[f"hidden.{i + 1}"][:start] for i in ours.target_layer_ids], dim=-1)
    return ours.propose(model, features, ids, start, ours.block_size)


@pytest.fixture(scope="module")
def reference(trained, tmp_path_factory, heldout) -> dict:
    """Both drafters exported for vLLM, and broken copies, drafted by speculators in one process; our logits beside."""
    root = tmp_path_factory.mktemp("exported")
    target, drafter = trained
    pairs = {"bundled": (TINY / "target", TINY / "drafter"), "trained": (target, drafter)}
    exported = {name: root / name for name in pairs}
    for name, (target_dir, drafter_dir) in pairs.items():
        _export(drafter_dir, "vllm", exported[name], "--target", target_dir)

    def shift(dflash: dict) -> None:
        dflash["target_layer_ids"] = [i + 1 for i in dflash["target_layer_ids"]]

    shifted = _corrupt(exported["bundled"], root / "shifted", shift)
    unmasked = _corrupt(exported["bundled"], root / "unmasked", lambda d: d.pop("mask_token_id"))
    ids = {"bundled": heldout[0][:40], "trained": [ord(c) % 90 + 5 for c in "def add(a, b):\n    return a"]}
    jobs = [
        {"target": str(TINY / "target"), "ids": ids["bundled"], "start": 32,
         "drafters": {"bundled": str(exported["bundled"]), "shifted": str(shifted), "unmasked": str(unmasked)}},
        {"target": str(target), "ids": ids["trained"], "start": 20, "drafters": {"trained": str(exported["trained"])}},
    ]  # fmt: skip
    (root / "jobs.json").write_text(json.dumps(jobs))
    command = [oracle_python(), TESTS / "speculators_reference.py", root / "jobs.json", root]
    ran = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    logits = {name: load_file(root / f"{name}.safetensors")["logits"] for name, r in results.items() if r == "ok"}
    states = [load_file(root / f"target.{j}.safetensors") for j in range(len(jobs))]
    ours = {
        "bundled": _ours(TINY / "target", TINY / "drafter", states[0], ids["bundled"], 32),
        "trained": _ours(target, drafter, states[1], ids["trained"], 20),
    }
    return {"results": results, "logits": logits, "ours": ours, "exported": exported}


@pytest.mark.parametrize("name", ["bundled", "trained"])
def test_speculators_drafts_our_exported_drafter_as_we_do(reference, name):
    assert reference["results"][name] == "ok", reference["results"][name]
    theirs, ours = reference["logits"][name], reference["ours"][name]
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() < TOLERANCE


def test_a_wrong_layer_or_missing_mask_token_is_caught_by_speculators(reference):
    results = reference["results"]
    assert results["shifted"] == "ok"  # it loads, but reads other target layers: its drafts differ
    assert (reference["logits"]["shifted"] - reference["ours"]["bundled"]).abs().max().item() > 100 * TOLERANCE
    assert "mask_token_id is not set" in results["unmasked"]


def test_the_exported_folder_is_zlab_layout(reference, trained):
    folder = reference["exported"]["trained"]
    config = read_config(folder)
    trained_config = read_config(trained[1])
    assert trained_config["dflash_config"]["block_size"] == 4  # dflash train writes z-lab's fields itself
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == trained_config["dflash_config"]
    assert config["num_target_layers"] == 4
    names = set(load_file(folder / "model.safetensors"))
    assert not {n for n in names if "embed" in n or "lm_head" in n or n == "d2t"}
    assert names == set(load_file(trained[1] / "model.safetensors"))


def test_the_serving_lines(tmp_path):
    vllm = _export(TINY / "drafter", "vllm", tmp_path / "v", "--target", "Org/Target")
    spec = json.dumps({"method": "dflash", "model": str(tmp_path / "v"), "num_speculative_tokens": 15})
    assert f"vllm serve Org/Target --speculative-config '{spec}'" in vllm
    sglang = _export("tiny", "sglang", tmp_path / "s", "--target", "Org/Target", "--offline")  # a catalog name
    assert "--speculative-algorithm DFLASH" in sglang and "--speculative-num-draft-tokens 16" in sglang


def _vllm_python() -> Path:
    """.venv-vllm's interpreter (./install.sh --dev creates it)."""
    python = TESTS.parent / ".venv-vllm" / "bin" / "python"
    assert python.is_file(), "./install.sh --dev creates .venv-vllm (vLLM's CPU build), which this test runs"
    return python


def _serving_config(printed: str) -> dict:
    """The JSON of `--speculative-config '...'` in the line `dflash export --to vllm` printed."""
    return json.loads(printed.split("--speculative-config '", 1)[1].split("'", 1)[0])


@pytest.fixture(scope="module")
def vllm_loaded(trained, tmp_path_factory) -> dict:
    """vLLM's reading of each export, from the serving line dflash printed, and of a copy with a misnamed tensor."""
    root = tmp_path_factory.mktemp("vllm")
    target, drafter = trained
    jobs = []
    for name, (target_dir, drafter_dir) in {"bundled": (TINY / "target", TINY / "drafter"), "trained": trained}.items():
        printed = _export(drafter_dir, "vllm", root / name, "--target", target_dir)
        jobs.append({"name": name, "target": str(target_dir), "speculative_config": _serving_config(printed)})
    misnamed = root / "misnamed"
    shutil.copytree(root / "bundled", misnamed)
    tensors = load_file(misnamed / "model.safetensors")
    tensors["fc_in.weight"] = tensors.pop("fc.weight")
    save_file(tensors, misnamed / "model.safetensors")
    jobs.append(
        jobs[0] | {"name": "misnamed", "speculative_config": jobs[0]["speculative_config"] | {"model": str(misnamed)}}
    )
    (root / "jobs.json").write_text(json.dumps(jobs))
    command = [_vllm_python(), TESTS / "vllm_reference.py", "load", root / "jobs.json", root]
    ran = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads((root / "vllm.json").read_text())


@pytest.mark.parametrize("name, block", [("bundled", 16), ("trained", 4)])
def test_vllm_reads_and_loads_the_export_from_the_printed_line(vllm_loaded, trained, name, block):
    """vLLM's own config parsing and weight loading (its CPU build): the DFlash method, block - 1 speculative
    tokens, its Qwen3 DFlash model class, and our mask token and target layers as its config reads them."""
    loaded = vllm_loaded[name]
    assert "error" not in loaded, loaded.get("error")
    assert loaded["method"] == "dflash" and loaded["num_speculative_tokens"] == block - 1
    assert loaded["class"] == loaded["built"] == "DFlashQwen3ForCausalLM"
    drafter = TINY / "drafter" if name == "bundled" else trained[1]
    ours = DrafterConfig.from_dict(read_config(drafter), drafter)
    assert (loaded["mask_token_id"], loaded["target_layer_ids"]) == (ours.mask_token_id, ours.target_layer_ids)
    assert (
        "model.fc.weight" in loaded["parameters"] and "model.layers.0.self_attn.qkv_proj.weight" in loaded["parameters"]
    )


def test_vllm_refuses_a_drafter_whose_tensors_it_cannot_place(vllm_loaded):
    assert "fc_in" in vllm_loaded["misnamed"].get("error", ""), vllm_loaded["misnamed"]


@pytest.fixture(scope="module")
def vllm_drafted(tmp_path_factory, heldout) -> list[dict]:
    """vLLM decoding four held-out prompts with the tiny target and the bundled drafter exported, from the line dflash
    printed: each prompt's tokens, drafting steps and accepted drafts."""
    root = tmp_path_factory.mktemp("vllm-drafted")
    printed = _export(TINY / "drafter", "vllm", root / "drafter", "--target", TINY / "target")
    job = {"target": str(TINY / "target"), "speculative_config": _serving_config(printed)}
    (root / "job.json").write_text(json.dumps(job | {"prompts": heldout[:4], "max_tokens": 48}))
    command = [_vllm_python(), TESTS / "vllm_reference.py", "generate", root / "job.json", root]
    ran = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads((root / "drafted.json").read_text())


def _steps_to(acceptance_lengths: list[int], tokens: int) -> int:
    """Drafting steps until `tokens` new tokens exist (the prefill gives the first)."""
    made = list(accumulate([1, *acceptance_lengths]))
    return next(steps for steps, count in enumerate(made) if count >= tokens)


def test_vllm_drafts_with_the_export_as_dflash_does(vllm_drafted, heldout):
    """vLLM's DFlash decoding with the export makes dflash's tokens (both lossless: the target's greedy ones) in the
    same drafting steps, prompt by prompt: measured 10, 32, 18, 21. dflash runs on past the 48 tokens here, since its
    last blocks otherwise shrink to the tokens left (a shorter block drafts otherwise), where vLLM drafts its whole
    block past max_tokens. Target layers off by one gave 10, 28, 16, 20 there, a wrong mask token 10, 31, 18, 21."""
    for prompt, theirs in zip(heldout[:4], vllm_drafted, strict=True):
        ids = ",".join(map(str, prompt))
        result = invoke(
            "generate", "--target", TINY / "target", "--drafter", TINY / "drafter", "--prompt-ids", ids,
            "--max-new-tokens", "80", "--ignore-eos", "--block-size", "16", "--no-lookup", "--json", "--threads", "1",
        )  # fmt: skip
        ours = json.loads(result.stdout)
        assert theirs["token_ids"] == ours["output_ids"][:48]
        assert theirs["drafts"] == _steps_to(ours["acceptance_lengths"], 48)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--to", "onnx"], "Unknown export target 'onnx' (use vllm, sglang, gguf)."),
        (["--to", "gguf", "--out", "x.gguf"], "--to gguf needs --target TARGET.gguf"),
        (["--to", "vllm", "--out", str(TINY)], "exists and is not an empty folder"),
    ],
)
def test_bad_input_is_one_sentence(args, message, tmp_path):
    assert_one_error(invoke("export", TINY / "drafter", *args), message)


def test_a_drafter_vllm_would_misread_is_refused(tmp_path):
    drafter = tmp_path / "scaled"
    shutil.copytree(TINY / "drafter", drafter)
    config = read_config(drafter) | {"input_embedding_scale": 16.0}
    (drafter / "config.json").write_text(json.dumps(config))
    assert_one_error(invoke("export", drafter, "--to", "sglang"), "uses input_embedding_scale, which sglang's")


def _gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """A GGUF's tensors as stored."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data) for t in reader.tensors}


def test_the_gguf_export_is_llamacpps_and_drafts_natively(tiny_gguf, tmp_path, heldout):
    from dflash_local.drafters.gguf_drafter import gguf_drafter_config
    from dflash_local.drafters.native import NativeDrafter
    from dflash_local.targets.llamacpp import LlamaCppTarget

    out = tmp_path / "dflash-tiny.gguf"
    printed = _export(TINY / "drafter", "gguf", out, "--target", tiny_gguf["f16"])
    assert f"llama-server -m {tiny_gguf['f16']} -md {out} --spec-type draft-dflash" in printed
    theirs = tmp_path / "converted.gguf"
    script = [oracle_python(), TESTS / "convert_drafter.py", llama_cpp_source(), TINY / "drafter", tiny_gguf["f16"]]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    built = subprocess.run([*script, theirs], capture_output=True, text=True, env=one_thread)
    assert built.returncode == 0, built.stderr[-3000:]
    ours_cfg, theirs_cfg = gguf_drafter_config(out), gguf_drafter_config(theirs)
    assert (ours_cfg.dims, ours_cfg.block_size, ours_cfg.target_layer_ids, ours_cfg.mask_token_id) == (
        theirs_cfg.dims, theirs_cfg.block_size, theirs_cfg.target_layer_ids, theirs_cfg.mask_token_id
    )  # fmt: skip
    ours, converted = _gguf_tensors(out), _gguf_tensors(theirs)
    assert ours.keys() == converted.keys()
    for name, array in ours.items():  # ours: F16 matrices (fc F32) of the bf16 weights; llama.cpp's: F32
        assert array.shape == converted[name].shape and np.array_equal(array, converted[name].astype(array.dtype)), name
    target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=256))
    spec = LoadSpec(RuntimeConfig(threads=1))
    native, from_folder = NativeDrafter.load(out, target, spec), NativeDrafter.load(TINY / "drafter", target, spec)
    assert native.cfg.dims == DrafterConfig.from_dict(read_config(TINY / "drafter"), TINY / "drafter").dims
    features = torch.randn(32, 3 * target.hidden_size, generator=torch.Generator().manual_seed(0))
    drafted = [d.propose(target, features, heldout[1], 32, 16) for d in (native, from_folder)]
    assert torch.equal(*drafted)  # the exported file drafts as the native drafter's own GGUF of the folder
