"""Triton block attention: one program per (batch, kv head) holds all its query heads x B queries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONTEXT_TILE = 64  # fp32 inputs multiply in full fp32 ("ieee"), not TF32: fp32 runs are the exact ones


@triton.jit
def _attend(
    q, k, v, m_i, l_i, acc, query_pos, key_pos, key_ok, scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax update of (max, sum, accumulator) with a tile of keys."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = key_ok[None, :] & (query_pos[:, None] >= 0)
    if CAUSAL:
        visible = visible & (key_pos[None, :] <= query_pos[:, None])
    if WINDOW > 0:
        visible = visible & (query_pos[:, None] - key_pos[None, :] < WINDOW)
        if not CAUSAL:
            visible = visible & (key_pos[None, :] - query_pos[:, None] < WINDOW)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _block_attention_kernel(
    q_ptr, pk_ptr, pv_ptr, k_ptr, v_ptr, o_ptr,
    sq_b, sq_h, sq_m, pk_b, pk_h, pk_n, pv_b, pv_h, pv_n,
    k_b, k_h, k_n, v_b, v_h, v_n, o_b, o_h, o_m,
    num_kv_heads, context, context_ptr, scale,
    CONTEXT_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr, TILE: tl.constexpr, BLOCK_KEYS: tl.constexpr, DIM: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    if CONTEXT_IN_MEMORY:
        context = tl.load(context_ptr).to(tl.int32)
    pid = tl.program_id(0)
    batch, kv_head = pid // num_kv_heads, pid % num_kv_heads
    pk_ptr += batch * pk_b + kv_head * pk_h
    pv_ptr += batch * pv_b + kv_head * pv_h
    k_ptr += batch * k_b + kv_head * k_h
    v_ptr += batch * v_b + kv_head * v_h
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP * BLOCK
    head = kv_head * GROUP + rows // BLOCK
    query = rows % BLOCK
    dims = tl.arange(0, DIM)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + batch * sq_b + head[:, None] * sq_h + query[:, None] * sq_m + dims[None, :], mask=q_mask, other=0.0
    )
    query_pos = context + query
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for tile in range(0, context, TILE):
        keys = tile + tl.arange(0, TILE)
        key_ok = keys < context
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(pk_ptr + keys[:, None] * pk_n + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pv_ptr + keys[:, None] * pv_n + dims[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, query_pos, keys, key_ok, scale, CAUSAL, WINDOW, PRECISION)
    keys = tl.arange(0, BLOCK_KEYS)
    key_ok = keys < BLOCK
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + keys[:, None] * k_n + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + keys[:, None] * v_n + dims[None, :], mask=kv_mask, other=0.0)
    m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, query_pos, context + keys, key_ok, scale, CAUSAL, WINDOW, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + batch * o_b + head[:, None] * o_h + query[:, None] * o_m + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def block_attention_triton(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
    context_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of block_attention_reference; reads the context K/V in place (any strides but the last)."""
    q, past_k, past_v, k, v = (_last_dim_contiguous(t) for t in (q, past_k, past_v, k, v))
    batch, heads, block, head_dim = q.shape
    kv_heads, context = k.shape[1], past_k.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    _block_attention_kernel[(batch * kv_heads,)](
        q, past_k, past_v, k, v, out,
        q.stride(0), q.stride(1), q.stride(2), past_k.stride(0), past_k.stride(1), past_k.stride(2),
        past_v.stride(0), past_v.stride(1), past_v.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kv_heads, context, q if context_len is None else context_len, head_dim**-0.5,
        CONTEXT_IN_MEMORY=context_len is not None, BLOCK=block, GROUP=group, HEAD_DIM=head_dim,
        ROWS=max(16, triton.next_power_of_2(group * block)), TILE=CONTEXT_TILE,
        BLOCK_KEYS=max(16, triton.next_power_of_2(block)), DIM=max(16, triton.next_power_of_2(head_dim)),
        CAUSAL=causal, WINDOW=window or 0, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
