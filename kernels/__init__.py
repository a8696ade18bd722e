"""Kernels of the GPU path: Triton on CUDA, each beside the plain-torch reference it must match.

Each entry point takes `kernels="auto" | "triton" | "torch"` (auto: Triton for CUDA tensors). The layers that call
them hold their model's mode (`layers.set_kernels`), set at load from the runtime config (`--kernels`, default
DFLASH_KERNELS).
"""

from .accept import greedy_accept, greedy_accept_reference
from .attention import block_attention, block_attention_reference, visibility_mask
from .backend import MODES, check_mode, check_triton, use_triton
from .rmsnorm import rms_norm, rms_norm_reference
from .wq_matmul import dequantize, wq_matmul, wq_matmul_reference

__all__ = [
    "MODES",
    "block_attention",
    "block_attention_reference",
    "check_mode",
    "check_triton",
    "dequantize",
    "greedy_accept",
    "greedy_accept_reference",
    "rms_norm",
    "rms_norm_reference",
    "use_triton",
    "visibility_mask",
    "wq_matmul",
    "wq_matmul_reference",
]
