"""Choosing Triton or the torch reference for one call, from DFLASH_KERNELS and the tensors' device."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNELS_ENV = "DFLASH_KERNELS"
MODES = ("auto", "triton", "torch")


def kernel_mode() -> str:
    """The DFLASH_KERNELS setting: auto (default), triton or torch; ValueError for anything else."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r} is not one of {', '.join(MODES)}.")
    return mode


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_triton(on_cuda: bool) -> None:
    """ValueError unless Triton kernels can run here: installed, and on CUDA or under the Triton interpreter."""
    if not triton_installed():
        raise ValueError(f"{KERNELS_ENV}=triton, but triton is not installed.")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{KERNELS_ENV}=triton off CUDA needs TRITON_INTERPRET=1 (the Triton interpreter).")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel; autograd always takes the reference."""
    mode = kernel_mode()
    if mode == "torch" or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return False
    on_cuda = tensors[0].is_cuda
    if mode == "auto":
        return on_cuda and triton_installed()
    check_triton(on_cuda)
    return True
