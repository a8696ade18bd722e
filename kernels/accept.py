"""The greedy acceptance step on device: target argmax per row and the accepted draft length, in one tensor."""

from __future__ import annotations

import torch

from .backend import use_triton


def greedy_accept_reference(draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """int64 [1 + B]: the count of leading drafts equal to the target's argmax, then the argmax of each row.

    draft [B - 1] proposes rows 0..B-2 of logits [B, vocab]; the argmax at the accepted count is the bonus.
    """
    choice = logits.argmax(dim=-1)
    accepted = (draft == choice[:-1]).cumprod(dim=0).sum()
    return torch.cat([accepted.view(1), choice])


def greedy_accept(draft: torch.Tensor, logits: torch.Tensor, *, kernels: str = "auto") -> torch.Tensor:
    """Same contract as greedy_accept_reference; one Triton launch when the backend says so for this mode (kernels)."""
    if use_triton(kernels, logits):
        from .accept_triton import greedy_accept_triton

        return greedy_accept_triton(draft, logits)
    return greedy_accept_reference(draft, logits)
