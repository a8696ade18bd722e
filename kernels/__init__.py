"""Kernels of the GPU path: Triton on CUDA, each beside the plain-torch reference it must match.

`DFLASH_KERNELS=triton|torch|auto` (default auto: Triton for CUDA tensors) picks the implementation.
"""

from .accept import greedy_accept, greedy_accept_reference
from .attention import block_attention, block_attention_reference, visibility_mask
from .backend import KERNELS_ENV, check_triton, kernel_mode, use_triton
from .rmsnorm import rms_norm, rms_norm_reference

__all__ = [
    "KERNELS_ENV",
    "block_attention",
    "block_attention_reference",
    "check_triton",
    "greedy_accept",
    "greedy_accept_reference",
    "kernel_mode",
    "rms_norm",
    "rms_norm_reference",
    "use_triton",
    "visibility_mask",
]
