"""Choosing the device and dtype a model runs with."""

from __future__ import annotations

import time

import torch

from kernels import check_triton, kernel_mode

from .errors import DFlashError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> str:
    """'auto' means CUDA when available, else CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("CUDA was requested but this torch build sees no CUDA GPU.")
    if name != "cpu" and not name.startswith("cuda"):
        raise DFlashError(f"Unknown device '{name}' (use auto, cpu or cuda).")
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    """'auto' means bfloat16 on CUDA and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise DFlashError(f"Unknown dtype '{name}' (use auto, {', '.join(DTYPES)}).")
    return DTYPES[name]


def bf16_is_fast(device: str) -> bool:
    """bf16 matmuls pay off on CUDA and on CPUs with AMX or AVX-512 BF16; elsewhere fp32 is faster."""
    if device.startswith("cuda"):
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def check_kernels(device: str | torch.device) -> None:
    """Fail early, in one sentence, when DFLASH_KERNELS is invalid or asks for Triton where it cannot run."""
    try:
        if kernel_mode() == "triton":
            check_triton(torch.device(device).type == "cuda")
    except ValueError as exc:
        raise DFlashError(str(exc)) from None


def clock(device: torch.device) -> float:
    """Seconds, after the device's queued work is done (one sync per call on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
