"""Weight-only quantized matmul (W4A16, W8A16): x @ W.T for W stored as int4 or int8 groups with a scale and an
optional min; dispatcher and plain-torch reference.

One format for both widths. W [out, in] is cut along `in` into groups of `group` values; each group has a scale s and
optionally a min m (tensors [out, in // group]). A weight is w = v * s + m, where v is the stored code:
- int8 (bits=8): codes int8 [out, in], v = the code (-128..127);
- int4 (bits=4): codes uint8 [out, in // 2], two per byte, even column in the low nibble, odd in the high one;
  with a min v = the nibble (0..15, Q4_K's layout), without one v = nibble - 8 (-8..7, symmetric, Q4_0's layout).
The weight tile is rounded to the activation dtype before the product (fp32 activations: no rounding); sums in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .backend import use_triton

TRITON_MAX_ROWS = 64  # more rows (a prefill) dequantize the weight once and run a dense matmul
DEQUANT_ROWS = 4096  # the reference dequantizes at most this many output rows at a time


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """The fp32 weights [out, in] that codes, scales and mins (same number of rows) stand for."""
    if bits == 4:
        values = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(codes.shape[0], -1).float()
        if mins is None:
            values -= 8
    else:
        values = codes.float()
    rows, width = values.shape
    weight = values.view(rows, width // group, group) * scales.float()[..., None]
    if mins is not None:
        weight += mins.float()[..., None]
    return weight.view(rows, width)


def dequantized_parts(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group: int, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """W in dtype, DEQUANT_ROWS output rows at a time (a 128K-row head is never whole in fp32)."""
    for begin in range(0, codes.shape[0], DEQUANT_ROWS):
        end = begin + DEQUANT_ROWS
        yield dequantize(
            codes[begin:end], scales[begin:end], None if mins is None else mins[begin:end], bits, group
        ).to(dtype)


def wq_matmul_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """x [rows, in] @ W.T -> [rows, out] in x's dtype: W dequantized, rounded to x's dtype, multiplied in fp32."""
    rows = x.float()
    parts = [rows @ part.float().T for part in dequantized_parts(codes, scales, mins, bits, group, x.dtype)]
    return torch.cat(parts, dim=-1).to(x.dtype)


def wq_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
    *,
    kernels: str = "auto",
) -> torch.Tensor:
    """Same contract as wq_matmul_reference; Triton when the backend says so for this mode (kernels) and x has at most
    TRITON_MAX_ROWS rows, else (a prefill on CUDA) dense matmuls over the weight dequantized in x's dtype, by parts."""
    if not use_triton(kernels, x, codes):
        return wq_matmul_reference(x, codes, scales, mins, bits, group)
    if x.shape[0] > TRITON_MAX_ROWS:
        return torch.cat([x @ part.T for part in dequantized_parts(codes, scales, mins, bits, group, x.dtype)], dim=-1)
    from .wq_matmul_triton import wq_matmul_triton

    return wq_matmul_triton(x, codes, scales, mins, bits, group)
