"""RMSNorm with an optional fused residual add: dispatcher and plain-torch reference."""

from __future__ import annotations

import torch

from .backend import use_triton


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalize(x + residual), x + residual); the norm runs in fp32, Llama/Qwen3 style."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, kernels: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rms_norm_reference; Triton when the backend says so for this mode (kernels)."""
    if use_triton(kernels, x, weight, *(() if residual is None else (residual,))):
        from .rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
