"""Lookup drafts: the suffix index's continuation as a block's drafts, each a point mass (all its probability on the
token), verified by the same acceptance and rejection sampling as a drafter's (as DFlash2's walked picks are)."""

from __future__ import annotations

import torch


def point_logits(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Logits [len(tokens), vocab]: 0 at each row's token, -inf elsewhere (what a grammar masks row by row)."""
    logits = torch.full((len(tokens), vocab), float("-inf"), device=device)
    logits[torch.arange(len(tokens)), torch.tensor(tokens, device=device)] = 0.0
    return logits


def point_masses(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Probabilities [len(tokens), vocab]: 1 at each row's token (the drafts' q for rejection sampling)."""
    probs = torch.zeros((len(tokens), vocab), device=device)
    probs[torch.arange(len(tokens)), torch.tensor(tokens, device=device)] = 1.0
    return probs
