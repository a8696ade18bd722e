"""Triton W4A16 / W8A16 matmul: each program dequantizes a [BLOCK_N, BLOCK_K] weight tile inside the loop (the weight
is read once, as stored) for all rows of x; split-K over programs when the rows are few, partial sums in fp32."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64
MIN_BLOCK_K = 128  # a tile spans whole groups: BLOCK_K = max(MIN_BLOCK_K, group)
PROGRAMS_PER_SM = 4  # split-K until the grid holds about this many programs per multiprocessor


@triton.jit
def _dequantize_tile(
    values, s_ptr, m_ptr, cols, col_ok, group_base, groups_per_row,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr, HAS_MIN: tl.constexpr,
):  # fmt: skip
    """values [BLOCK_N, GROUPS * WIDTH] (fp32, WIDTH per group) times their groups' scales, plus their mins."""
    group_ids = group_base + tl.arange(0, GROUPS)
    where = cols[:, None] * groups_per_row + group_ids[None, :]
    ok = col_ok[:, None] & (group_ids < groups_per_row)[None, :]
    scales = tl.load(s_ptr + where, mask=ok, other=0.0).to(tl.float32)
    grouped = tl.reshape(values, (BLOCK_N, GROUPS, WIDTH)) * scales[:, :, None]
    if HAS_MIN:
        grouped += tl.load(m_ptr + where, mask=ok, other=0.0).to(tl.float32)[:, :, None]
    return tl.reshape(grouped, (BLOCK_N, GROUPS * WIDTH))


@triton.jit
def _product(x, w, DOT_FP32: tl.constexpr):
    """x [BLOCK_M, k] @ w.T for w [BLOCK_N, k] already in x's dtype, summed in fp32."""
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w))


@triton.jit
def _wq_matmul_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, rows_total, cols_total, depth, k_per_split, stride_xm,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < rows_total, cols < cols_total
    groups_per_row = depth // GROUP
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, depth)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if BITS == 4:
            pairs = tl.arange(0, BLOCK_K // 2)
            even = k0 + 2 * pairs
            ok = col_ok[:, None] & (even < k_end)[None, :]
            packed = tl.load(q_ptr + cols.to(tl.int64)[:, None] * (depth // 2) + (k0 // 2 + pairs)[None, :], mask=ok)
            low, high = (packed & 15).to(tl.float32), (packed >> 4).to(tl.float32)
            if not HAS_MIN:
                low, high = low - 8.0, high - 8.0
            low = _dequantize_tile(low, s_ptr, m_ptr, cols, col_ok, k0 // GROUP, groups_per_row,
                                   BLOCK_N, TILE_GROUPS, GROUP // 2, HAS_MIN).to(dtype)  # fmt: skip
            high = _dequantize_tile(high, s_ptr, m_ptr, cols, col_ok, k0 // GROUP, groups_per_row,
                                    BLOCK_N, TILE_GROUPS, GROUP // 2, HAS_MIN).to(dtype)  # fmt: skip
            x_ok = row_ok[:, None] & (even < k_end)[None, :]
            x_even = tl.load(x_rows + even[None, :], mask=x_ok, other=0.0)
            x_odd = tl.load(x_rows + even[None, :] + 1, mask=x_ok, other=0.0)
            acc += _product(x_even, low, DOT_FP32) + _product(x_odd, high, DOT_FP32)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = col_ok[:, None] & (ks < k_end)[None, :]
            codes = tl.load(q_ptr + cols.to(tl.int64)[:, None] * depth + ks[None, :], mask=ok).to(tl.float32)
            w = _dequantize_tile(codes, s_ptr, m_ptr, cols, col_ok, k0 // GROUP, groups_per_row,
                                 BLOCK_N, TILE_GROUPS, GROUP, HAS_MIN).to(dtype)  # fmt: skip
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k_end)[None, :], other=0.0)
            acc += _product(x, w, DOT_FP32)
    out = out_ptr + pid_k.to(tl.int64) * rows_total * cols_total + rows[:, None] * cols_total + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(tiles: int, k_tiles: int, device: torch.device) -> int:
    """How many programs share one output tile's depth: enough for PROGRAMS_PER_SM per multiprocessor (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    return max(1, min(k_tiles, PROGRAMS_PER_SM * multiprocessors(device) // max(tiles, 1)))


def wq_matmul_triton(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton twin of wq_matmul_reference; split_k (default: split_count) programs per output tile, their fp32
    partial sums added in a fixed order (deterministic, the same for every row count)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, depth = x.shape
    cols = codes.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    block_k = max(MIN_BLOCK_K, group)
    k_tiles = triton.cdiv(depth, block_k)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, BLOCK_N)
    split = split_k or split_count(tiles, k_tiles, x.device)
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    split = triton.cdiv(depth, k_per_split)
    dot_fp32 = x.dtype == torch.float32 or x.device.type != "cuda"  # the interpreter multiplies bf16 wrongly
    out = torch.empty((split, rows, cols), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, BLOCK_N), split)
    _wq_matmul_kernel[grid](
        x, codes, scales, scales if mins is None else mins, out, rows, cols, depth, k_per_split, x.stride(0),
        BITS=bits, GROUP=group, HAS_MIN=mins is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        TILE_GROUPS=block_k // group, DOT_FP32=dot_fp32,
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(dim=0).to(x.dtype)
