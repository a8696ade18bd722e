"""`dflash doctor` and `dflash models` on the bundled catalog."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ENV = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


def dflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_local", *args], capture_output=True, text=True, env=ENV)


def test_doctor_reports_the_stack_and_whether_a_model_fits():
    result = dflash("doctor", "tiny")
    assert result.returncode == 0, result.stderr
    for name in ("torch", "CUDA", "Triton", "bitsandbytes", "llama-cpp-python", "model cache"):
        assert name in result.stdout
    assert torch.__version__ in result.stdout
    assert "needs ~0.1 GB" in result.stdout and ": fits" in result.stdout
    assert dflash("doctor", "tinyy").stderr.strip() == "error: 'tinyy' is not in the catalog (see dflash models)."


def test_models_lists_the_catalog():
    result = dflash("models")
    assert result.returncode == 0, result.stderr
    for name in ("tiny", "llama3-8b-q4", "qwen3-8b-q4", "qwen3-4b-q4", "qwen3-4b", "qwen3-8b-nf4"):
        assert f" {name} " in result.stdout
    assert "bundled" in result.stdout
