"""`dflash doctor` (the stack, a model of any kind: here? fits?) and `dflash models` on the bundled catalog."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import torch

from dflash_local import doctor

ENV = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def dflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_local", *args], capture_output=True, text=True, env=ENV)


def test_doctor_reports_the_stack_and_whether_a_model_fits():
    result = dflash("doctor", "tiny")
    assert result.returncode == 0, result.stderr
    for name in ("torch", "CUDA", "Triton", "bitsandbytes", "llama-cpp-python", "huggingface_hub", "model cache"):
        assert name in result.stdout
    assert torch.__version__ in result.stdout and f"{huggingface_hub.__version__}, HTTP client" in result.stdout
    assert "tiny fits?" in result.stdout and "needs ~0.1 GB (the catalog's estimate)" in result.stdout
    unknown = dflash("doctor", "tinyy")
    assert (unknown.returncode, unknown.stderr) == (
        1,
        "error: 'tinyy' is neither a known model, a Hub repo (owner/name) nor a path. Did you mean tiny?\n",
    )


def _verdict(name: str, monkeypatch, budget_gb: float) -> doctor.Check:
    monkeypatch.setattr(doctor, "memory_budget", lambda: ("GPU test", budget_gb))
    return doctor.model_checks(name)[-1]


def test_fit_verdict_follows_the_memory_there_is(monkeypatch):
    """tiny's catalog entry needs 0.1 GB: a 0.04 GB budget does not hold it, a 0.2 GB one does."""
    small = _verdict("tiny", monkeypatch, 0.04)
    assert (small.ok, small.found) == (
        False,
        "needs ~0.1 GB (the catalog's estimate), GPU test has 0.0 GB: does NOT fit",
    )
    large = _verdict("tiny", monkeypatch, 0.2)
    assert (large.ok, large.found) == (True, "needs ~0.1 GB (the catalog's estimate), GPU test has 0.2 GB: fits")


def test_doctor_takes_folders_gguf_files_and_repos(monkeypatch, tmp_path):
    """A folder is estimated from its weights + a 4096-token KV cache, a .gguf from its size; a repo not pulled
    is reported as such, and doctor never downloads (no Hub is reachable here)."""
    target = TINY / "target"
    weights = (target / "model.safetensors").stat().st_size
    kv = 2 * 8 * 2 * 64 * 4096 * 2  # K and V, 8 layers, 2 KV heads of 64, 4096 tokens, 16-bit
    budget = (weights + kv) / 1e9
    where, fit = doctor.model_checks(str(target))
    assert (where.found, where.ok) == (f"on disk: {target}; no drafter (pass --drafter)", True)
    assert fit.found.startswith(f"needs ~{budget:.1f} GB (weight files + a 4096-token KV cache)")
    assert _verdict(str(target), monkeypatch, budget * 0.99).ok is False
    assert _verdict(str(target), monkeypatch, budget * 1.01).ok is True
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 3_000_000)
    assert _verdict(str(gguf), monkeypatch, 1.0).found == (
        "needs ~0.0 GB (weight files; its KV cache comes on top), GPU test has 1.0 GB: fits"
    )
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "dflash"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    where, fit = doctor.model_checks("someone/model")
    assert where.found == "someone/model is not downloaded (dflash pull someone/model)"
    assert (fit.found, fit.ok) == ("unknown until it is downloaded", None)
    where, fit = doctor.model_checks("qwen3-4b-q4")
    assert where.found == "Qwen/Qwen3-4B-GGUF is not downloaded (dflash pull qwen3-4b-q4)"
    assert fit.found.startswith("needs ~3.6 GB (the catalog's estimate)")
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
    for name in ("tiny", "llama3-8b-q4", "qwen3-8b-q4", "qwen3-4b-q4", "qwen3-4b", "qwen3-8b-nf4"):
        assert f" {name} " in result.stdout
    assert "bundled" in result.stdout
