"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP; set_kernels, a model's kernel
mode."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .errors import DFlashError
from .kernels import check_mode, rms_norm
from .weights import check_number


def set_kernels(module: nn.Module, mode: str) -> None:
    """Make every submodule that calls kernels (those with a `kernels` attribute) run them in mode: auto, triton or
    torch."""
    check_mode(mode)
    for sub in module.modules():
        if hasattr(sub, "kernels"):
            sub.kernels = mode


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by a learned weight (Llama/Qwen3 convention)."""

    kernels: str = "auto"  # the kernel mode (set_kernels)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, kernels=self.kernels)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused pass where the kernels allow."""
        return rms_norm(x, self.weight, self.eps, residual, kernels=self.kernels)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`) RoPE fields."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    for key in ("rope_scaling", "rope_parameters"):
        extra = config.get(key)
        if isinstance(extra, dict):
            params.update(extra)
    if "type" in params and params.get("rope_type", "default") == "default":
        params["rope_type"] = params["type"]
    return params


ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope(config: dict[str, Any], path: Path) -> None:
    """Raise one sentence naming the file and field unless the RoPE fields (4.x or 5.x layout) can be used."""
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise DFlashError(f"{path}: {key} must be an object or null, got {json.dumps(config[key])}.")
    where = "rope_parameters" if isinstance(config.get("rope_parameters"), dict) else "rope_scaling"
    params = rope_parameters(config)
    theta_where = f"{where}.rope_theta" if "rope_theta" in (config.get(where) or {}) else "rope_theta"
    check_number(params["rope_theta"], theta_where, path)
    kind = params["rope_type"]
    if not isinstance(kind, str) or kind not in ROPE_FIELDS:
        raise DFlashError(
            f"{path}: RoPE type {json.dumps(kind)} is not supported (supported: default, linear, llama3)."
        )
    for field in ROPE_FIELDS[kind]:
        if field not in params:
            raise DFlashError(f"{path}: {where} lacks {field}, which {kind} RoPE needs.")
        check_number(params[field], f"{where}.{field}", path)
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise DFlashError(f"{path}: {where}.high_freq_factor must be larger than low_freq_factor.")
    partial = params.get("partial_rotary_factor", 1.0)
    check_number(partial, f"{where}.partial_rotary_factor", path)
    if partial > 1:
        raise DFlashError(f"{path}: {where}.partial_rotary_factor must be at most 1, got {partial}.")


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32) for default, linear and llama3 rope types."""
    params = rope_parameters(config)
    kind = params["rope_type"]
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    # on the CPU even inside a meta-device model build: a meta arange imports torch._dynamo (2-3 s)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise DFlashError(f"RoPE type '{kind}' is not supported (supported: default, linear, llama3).")


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [len(positions), head_dim] for the given positions."""
    freqs = positions.float()[:, None] @ inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., seq, head_dim] by the cos/sin tables [seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
