"""`dflash doctor` (the stack, a model of any kind: here? fits?) and `dflash models` on the bundled catalog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from dflash_local import doctor, memory_estimate
from dflash_local.defaults import CACHE_RAM_MIB
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec, RuntimeConfig


def child_env() -> dict[str, str]:
    """The doctor's environment, read when it starts (after conftest points DFLASH_HOME at the session)."""
    return {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def dflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_local", *args], capture_output=True, text=True, env=child_env()
    )


def test_doctor_reports_the_stack_and_whether_a_model_fits():
    result = dflash("doctor", "tiny")
    assert result.returncode == 0, result.stderr
    for name in ("torch", "CUDA", "Triton", "bitsandbytes", "llama-cpp-python", "huggingface_hub", "model cache"):
        assert name in result.stdout
    assert torch.__version__ in result.stdout and f"{huggingface_hub.__version__}, HTTP client" in result.stdout
    assert "tiny fits?" in result.stdout and "needs ~0.3 GB (4096-token context: " in result.stdout
    unknown = dflash("doctor", "tinyy")
    assert (unknown.returncode, unknown.stderr) == (
        1,
        "error: 'tinyy' is neither a known model, a Hub repo (owner/name) nor a path. Did you mean tiny?\n",
    )


def _verdict(name: str, monkeypatch, budget_gb: float) -> doctor.Check:
    monkeypatch.setattr(doctor, "memory_budget", lambda: ("GPU test", budget_gb))
    return doctor.model_checks(name)[-1]


def test_fit_verdict_follows_the_memory_there_is(monkeypatch):
    """tiny needs its estimate from its files' shapes: a budget just under it does not hold it, just over it does."""
    need, basis = doctor.estimate_gb(TINY / "target", TINY / "drafter")
    small = _verdict("tiny", monkeypatch, need * 0.99)
    assert (small.ok, small.found) == (
        False,
        f"needs ~{need:.1f} GB ({basis}), GPU test has {need * 0.99:.1f} GB: does NOT fit",
    )
    assert _verdict("tiny", monkeypatch, need * 1.01).ok is True


def test_the_fit_check_weighs_the_prompt_cache_where_models_run_in_host_ram(monkeypatch):
    """Serve's and chat's default --cache-ram is host RAM: where models run in RAM, a budget that holds the model but
    not its prompt cache fits with a warning naming the --cache-ram that does; a GPU's memory never holds it."""
    need, basis = doctor.estimate_gb(TINY / "target", TINY / "drafter")
    cache = CACHE_RAM_MIB * 2**20 / 1e9
    monkeypatch.setattr(doctor, "memory_budget", lambda: (doctor.HOST_RAM, need + cache / 2))
    fit = doctor.model_checks("tiny")[-1]
    left = int(cache / 2 * 1e9 / 2**20)
    advice = f"fits, but not beside the default prompt cache ({CACHE_RAM_MIB} MiB): pass --cache-ram {left}"
    assert fit.ok is None and fit.found.endswith(advice), fit.found
    monkeypatch.setattr(doctor, "memory_budget", lambda: (doctor.HOST_RAM, need + cache * 1.01))
    assert doctor.model_checks("tiny")[-1].ok is True
    monkeypatch.setattr(doctor, "memory_budget", lambda: (doctor.HOST_RAM, need * 0.99))
    assert doctor.model_checks("tiny")[-1].ok is False
    assert _verdict("tiny", monkeypatch, need * 1.01).ok is True  # a GPU's memory holds no prompt cache
    assert basis.startswith("4096-token context: ")


def test_doctor_takes_folders_gguf_files_and_repos(monkeypatch, tmp_path, tiny_gguf):
    """A folder or a .gguf file is estimated from its shapes (memory_estimate); a repo not pulled is reported as
    such, a catalog entry not pulled gets the catalog's figure, and doctor never downloads (no Hub is reachable)."""
    target = TINY / "target"
    estimate = memory_estimate.estimate_files(target, None, 4096)
    where, images, fit = doctor.model_checks(str(target))
    assert (where.found, where.ok) == (f"on disk: {target}; no drafter (pass --drafter)", True)
    assert (images.name, images.found) == (
        f"{target} images?",
        "no: text only (a GGUF vision target takes --mmproj FILE)",
    )
    assert fit.found.startswith(f"needs ~{estimate.total_gb:.1f} GB (4096-token context: {estimate.summary()})")
    kv = 2 * 8 * 2 * 64 * 4096 * 2  # K and V, 8 layers, 2 KV heads of 64, 4096 tokens, 16-bit
    assert estimate.parts["KV cache"] == kv
    assert estimate.parts["target weights"] == (target / "model.safetensors").stat().st_size
    assert _verdict(str(target), monkeypatch, estimate.total_gb * 0.99).ok is False
    assert _verdict(str(target), monkeypatch, estimate.total_gb * 1.01).ok is True
    gguf = tiny_gguf["q8_0"]
    estimate = memory_estimate.estimate_files(gguf, None, 4000)  # llama.cpp rounds the context up to 4096
    assert estimate.parts["target weights"] == gguf.stat().st_size and estimate.parts["KV cache"] == kv
    assert estimate.parts["llama.cpp activations"] == 4 * 512 * (3 * 768 + 5 * 256)  # a full batch, fp32
    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"\0" * 3_000_000)
    with pytest.raises(DFlashError, match=f"^{broken} is not a GGUF file whose shape can be read"):
        doctor.model_checks(str(broken))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "dflash"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    where, fit = doctor.model_checks("someone/model")
    assert where.found == "someone/model is not downloaded (dflash pull someone/model)"
    assert (fit.found, fit.ok) == ("unknown until it is downloaded", None)
    where, images, fit = doctor.model_checks("qwen3-4b-q4")
    assert where.found == "Qwen/Qwen3-4B-GGUF is not downloaded (dflash pull qwen3-4b-q4)"
    assert images.found.startswith("no: text only")
    figure = memory_estimate.estimate_shape("qwen3-4b", "q4_k_m", 4096).total_gb
    assert fit.found.startswith(f"needs ~{figure:.1f} GB (the catalog's estimate)") and figure > 4
    assert not (tmp_path / "hf").exists()


def test_huggingface_hub_check(monkeypatch):
    check = doctor._hub_check()
    assert check.ok is True and check.found.startswith(f"{huggingface_hub.__version__}, HTTP client ")

    def broken():
        raise ImportError("cannot import name 'Client' from 'httpx'")

    monkeypatch.setattr(huggingface_hub, "get_session", broken)
    check = doctor._hub_check()
    assert (check.ok, check.found) == (
        False,
        f"{huggingface_hub.__version__}, fails to load: cannot import name 'Client' from 'httpx'",
    )


def test_models_lists_the_catalog():
    result = dflash("models")
    assert result.returncode == 0, result.stderr
    listed = [line.split("\t")[0] for line in result.stdout.splitlines()]  # piped: one line per model, name first
    for name in ("tiny", "llama3-8b-q4", "qwen3-8b-q4", "qwen3-4b-q4", "qwen3-4b", "qwen3-8b-int4"):
        assert name in listed
    assert "bundled" in result.stdout


def test_size_rule_matches_the_converted_files(tiny_gguf):
    """The GGUF size a catalog entry is estimated with is the tensor data `dflash convert` writes, to the byte."""
    import gguf

    sizes = memory_estimate.target_sizes(TINY / "target")
    for kind, path in tiny_gguf.items():
        data = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
        assert memory_estimate.gguf_bytes(sizes, kind) == data, kind


def test_catalog_figures_come_from_shapes(monkeypatch, tmp_path):
    from dflash_local.catalog import load_catalog

    catalog = load_catalog()
    assert catalog["llama3-8b-q4"].memory_gb == round(
        memory_estimate.estimate_shape("llama3.1-8b", "q4_k_m", 4096).total_gb, 1
    )
    mine = tmp_path / "mine.toml"
    monkeypatch.setenv("DFLASH_CATALOG", str(mine))
    entry = '[mine]\ntarget = { repo = "a/b" }\n'
    for extra, message in (
        ('shape = "llama9"\nweights = "q4_k_m"\n', "shape must be one of llama3.1-8b, "),
        (
            'shape = "qwen3-8b"\nweights = "q5"\n',
            "weights must be one of q4_k_m, q8_0, f16, bf16, int4, nf4, got 'q5'.",
        ),
        ('shape = "qwen3-8b"\nweights = "nf4"\nmemory_gb = 3\n', "give memory_gb or shape and weights, not both."),
    ):
        mine.write_text(entry + extra)
        with pytest.raises(DFlashError) as error:
            load_catalog()
        assert str(error.value).startswith(f"{mine}: entry 'mine': {message}")


def test_the_quantize_on_load_entry_is_int4_counted_as_loaded(monkeypatch, tmp_path):
    """The catalog's bf16-quantized-on-load entry is int4 (NF4 is for bnb-4bit checkpoints), its figure holds the
    bytes int4 keeps: int4_linear_bytes is, to the byte, what --quantize int4 makes of the tiny target's layers in
    bf16 (uint8 nibble pairs, fp16 scale and min per 128); an unknown quantize is one sentence."""
    from dflash_local.catalog import load_catalog
    from dflash_local.dimensions import Dimensions
    from dflash_local.quant import INT4_GROUP, GroupQuantLinear
    from dflash_local.shapes import SHAPES, target_config
    from dflash_local.targets.torch_llama import TorchLlamaTarget

    entry = load_catalog()["qwen3-8b-int4"]
    assert (entry.quantize, entry.backend) == ("int4", "torch")
    int4 = memory_estimate.estimate_shape("qwen3-8b", "int4", 4096)
    assert entry.memory_gb == round(int4.total_gb, 1)
    sizes = Dimensions.from_config(target_config(SHAPES["qwen3-8b"]))
    linears = sizes.layers * sum(sizes.layer_matrices().values())
    bf16 = memory_estimate.estimate_shape("qwen3-8b", "bf16", 4096).parts["target weights"]
    assert bf16 - int4.parts["target weights"] == linears * 2 - linears * 68 // 128  # every Qwen3-8B linear is int4

    assert memory_estimate.INT4_GROUP == INT4_GROUP
    target = TorchLlamaTarget.load(
        TINY / "target", LoadSpec(RuntimeConfig(dtype="bfloat16"), max_context=64, quantize="int4")
    )
    quantized = [m for m in target.model.model.layers.modules() if isinstance(m, GroupQuantLinear)]
    held = sum(b.numel() * b.element_size() for m in quantized for b in m.buffers())
    tiny = memory_estimate.target_sizes(TINY / "target")
    assert len(quantized) == 7 * tiny.layers and held == memory_estimate.int4_linear_bytes(tiny)

    mine = tmp_path / "mine.toml"
    monkeypatch.setenv("DFLASH_CATALOG", str(mine))
    mine.write_text('[mine]\ntarget = { repo = "a/b" }\nquantize = "int3"\n')
    with pytest.raises(DFlashError) as error:
        load_catalog()
    assert str(error.value) == f"{mine}: entry 'mine': quantize must be 'int4', 'nf4' or left out, got 'int3'."


@pytest.mark.parametrize("shape,report", [("llama3.2-1b", "synth-1b"), ("llama3.1-8b", "synth-8b")])
def test_catalog_figures_are_within_15_percent_of_the_measured_peaks(shape, report):
    """The catalog's figure for a shape (Q4_K_M, its drafter, native: the CPU default) and the same without a
    drafter, against the peak RSS measured on the synthetic model of that shape (benchmarks/measure_memory.py)."""
    from dflash_local.dimensions import Dimensions
    from dflash_local.shapes import SHAPES, target_config

    measured = json.loads((TINY.parent.parent / "results" / "memory" / f"{report}-q4_k_m-ctx4096.json").read_text())
    context, runs = measured["max_context"], measured["runs"]
    sizes = Dimensions.from_config(target_config(SHAPES[shape]))
    alone = memory_estimate.estimate(sizes, memory_estimate.gguf_bytes(sizes, "q4_k_m"), context, "llamacpp")
    paired = memory_estimate.estimate_shape(shape, "q4_k_m", context)
    assert abs(measured["gguf_bytes"] / memory_estimate.gguf_bytes(sizes, "q4_k_m") - 1) < 0.02  # that shape's file
    for estimate, run in ((alone, "no-draft"), (paired, "native")):
        assert abs(estimate.total_gb * 1e9 / runs[run]["peak_rss_bytes"] - 1) <= 0.15, (run, estimate.total_gb)
