"""The small interface every target backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class TargetOutput:
    """Logits (fp32, one row per requested position) and concatenated context features (or None); a forward
    asked for greedy ids may give each row's argmax instead of the logits."""

    logits: torch.Tensor | None
    features: torch.Tensor | None
    argmax: torch.Tensor | None = None


class Target(Protocol):
    """A causal LM that the decode loop feeds, verifies with, and trims back to the accepted tokens."""

    device: torch.device
    dtype: torch.dtype
    length: int  # cached positions: forward appends at it, trim cuts it
    max_context: int
    kernels: str  # the kernel mode the target was loaded with (kernels.MODES)
    cache_owner: object | None  # the Session that last filled this model's cache (session.Session sets it)
    verify_rows: int | None  # the most rows the decode loop verifies in one forward (None: a whole block), the next
    # forward only while every draft so far stands: a trim then stays inside the last forward
    recurrent: bool  # part of its state cannot drop a suffix (a hybrid): a saved state serves only prompts that
    # continue all of it
    window: int  # a sliding window whose window-sized cache reuses cells (0: every cached position's cells are kept)

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def set_feature_layers(self, layer_ids: list[int]) -> None: ...

    @property
    def trim_floor(self) -> int:
        """The shortest length `trim` keeps in place (shorter, it feeds the kept tokens again): past 0 for a recurrent
        state or a window-sized cache."""
        ...

    def trim(self, length: int) -> None:
        """Forget every cached position at or after `length` (0: all of them)."""
        ...

    def save_state(self) -> object:
        """The cached positions' state, for load_state (the prompt cache)."""
        ...

    def load_state(self, state: object, tokens: list[int]) -> None:
        """Hold a saved state again: the cache of `tokens`."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the output head for these token ids, in `dtype` (a reduced-vocabulary drafter's head)."""
        ...

    def forward(
        self, ids: torch.Tensor, all_logits: bool = True, features: bool = True, greedy: bool = False
    ) -> TargetOutput:
        """greedy: the caller reads only each row's argmax; a target may then return `argmax` and no logits."""
