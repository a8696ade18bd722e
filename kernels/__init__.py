"""Kernels of the GPU path: Triton on CUDA, each beside the plain-torch reference it must match.

`set_kernel_mode("auto" | "triton" | "torch")` picks the implementation (auto: Triton for CUDA tensors); the CLI sets
it from its runtime config (`--kernels`, default DFLASH_KERNELS).
"""

from .accept import greedy_accept, greedy_accept_reference
from .attention import block_attention, block_attention_reference, visibility_mask
from .backend import check_triton, kernel_mode, set_kernel_mode, use_triton
from .rmsnorm import rms_norm, rms_norm_reference
from .wq_matmul import dequantize, wq_matmul, wq_matmul_reference

__all__ = [
    "block_attention",
    "block_attention_reference",
    "check_triton",
    "dequantize",
    "greedy_accept",
    "greedy_accept_reference",
    "kernel_mode",
    "rms_norm",
    "rms_norm_reference",
    "set_kernel_mode",
    "use_triton",
    "visibility_mask",
    "wq_matmul",
    "wq_matmul_reference",
]
