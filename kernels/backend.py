"""Choosing Triton or the torch reference for one call, from the caller's mode and the tensors' device."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

MODES = ("auto", "triton", "torch")  # auto: Triton for CUDA tensors, the torch reference elsewhere


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_mode(mode: str) -> None:
    """ValueError unless mode is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"Unknown kernels '{mode}' (use {', '.join(MODES)}).")


def check_triton(on_cuda: bool) -> None:
    """ValueError unless Triton kernels can run here: installed, and on CUDA or under the Triton interpreter."""
    if not triton_installed():
        raise ValueError("Triton kernels were asked for, but triton is not installed.")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels off CUDA need TRITON_INTERPRET=1 (the Triton interpreter).")


def use_triton(mode: str, *tensors: torch.Tensor) -> bool:
    """True when a call in mode (one of MODES) should run the Triton kernel; autograd always takes the reference."""
    if mode == "torch" or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return False
    on_cuda = tensors[0].is_cuda
    if mode == "auto":
        return on_cuda and triton_installed()
    check_mode(mode)
    check_triton(on_cuda)
    return True
