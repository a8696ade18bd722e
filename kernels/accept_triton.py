"""Triton greedy acceptance: one program per logits row; the first mismatch lowers the count atomically."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VOCAB_TILE = 1024


@triton.jit
def _greedy_accept_kernel(logits_ptr, row_stride, draft_ptr, out_ptr, vocab, num_draft, TILE: tl.constexpr):
    row = tl.program_id(0)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for start in range(0, vocab, TILE):
        cols = start + tl.arange(0, TILE)
        vals = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < vocab, other=float("-inf"))
        vals = vals.to(tl.float32)
        tile_max = tl.max(vals, axis=0)
        tile_idx = tl.min(tl.where(vals == tile_max, cols, vocab), axis=0).to(tl.int64)
        better = tile_max > best_val
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    tl.store(out_ptr + 1 + row, best_idx)
    is_draft = row < num_draft
    drafted = tl.load(draft_ptr + row, mask=is_draft, other=0)
    tl.atomic_min(out_ptr, row.to(tl.int64), mask=is_draft & (drafted != best_idx))


def greedy_accept_triton(draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Triton twin of greedy_accept_reference."""
    rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.full((rows + 1,), rows - 1, dtype=torch.int64, device=logits.device)
    draft = draft.to(torch.int64).contiguous() if draft.numel() else out  # no drafts: a valid, never-read pointer
    _greedy_accept_kernel[(rows,)](logits, logits.stride(0), draft, out, vocab, rows - 1, TILE=VOCAB_TILE)
    return out
