"""The drafter's block attention: B queries over [cached context K/V ; block K/V], GQA, RoPE already applied."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .backend import use_triton


def visibility_mask(
    num_queries: int, num_keys: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Which of num_keys keys each of the last num_queries positions sees, or None when all see all."""
    if not causal and window is None:
        return None
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        visible &= key_pos <= query_pos
    if window is not None:
        visible &= query_pos - key_pos < window
        if not causal:
            visible &= key_pos - query_pos < window
    return visible


def fixed_visibility_mask(
    context_len: torch.Tensor, cache_len: int, block: int, causal: bool, window: int | None
) -> torch.Tensor:
    """Visibility for fixed shapes: block queries at context_len.. over [cache_len cache slots ; block keys]."""
    slots = torch.arange(cache_len, device=context_len.device)
    offsets = torch.arange(block, device=context_len.device)
    query_pos = (context_len + offsets)[:, None]
    key_pos = torch.cat([slots, context_len + offsets])[None, :]
    visible = torch.cat([slots < context_len, offsets >= 0])[None, :].expand(block, -1)
    if causal:
        visible = visible & (key_pos <= query_pos)
    if window is not None:
        visible = visible & (query_pos - key_pos < window)
        if not causal:
            visible = visible & (key_pos - query_pos < window)
    return visible


def block_attention_reference(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    context_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, heads, B, dim]; past K/V [batch, kv_heads, ctx, dim]; block K/V [batch, kv_heads, B, dim].

    context_len (a one-element tensor, for fixed shapes): only the first context_len past positions count.
    """
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    if context_len is None:
        mask = visibility_mask(q.shape[2], keys.shape[2], causal, window, q.device)
    else:
        mask = fixed_visibility_mask(context_len, past_k.shape[2], q.shape[2], causal, window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def block_attention(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    context_len: torch.Tensor | None = None,
    *,
    kernels: str = "auto",
) -> torch.Tensor:
    """Same contract as block_attention_reference; one Triton launch for all heads when the backend says so for this
    mode (kernels)."""
    if use_triton(kernels, q, past_k, past_v, k, v):
        from .attention_triton import block_attention_triton

        return block_attention_triton(q, past_k, past_v, k, v, causal, window, context_len)
    return block_attention_reference(q, past_k, past_v, k, v, causal, window, context_len)
