"""Triton RMSNorm (+ residual add): each program normalizes a tile of rows, statistics in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_rows, width, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < num_rows)[:, None] & (cols < width)[None, :]
    offsets = rows[:, None] * width + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offsets, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offsets, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / width + eps)
    normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (w[None, :] * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of rms_norm_reference."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    res = rows if residual is None else residual.reshape(-1, width).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(rows) if residual is not None else rows
    block = triton.next_power_of_2(width)
    tile_rows = max(1, min(64, TILE_ELEMENTS // block))
    if rows.shape[0]:
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], tile_rows),)](
            rows, res, weight.contiguous(), out, summed, rows.shape[0], width, eps,
            HAS_RESIDUAL=residual is not None, ROWS=tile_rows, BLOCK=block,
        )  # fmt: skip
    return out.view(x.shape), x if residual is None else summed.view(x.shape)
