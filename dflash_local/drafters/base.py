"""The drafter interface every drafter implements (the torch one, llama.cpp's native one, prompt lookup),
beside targets/base.py's Target: what the decode loop asks of a drafter."""

from __future__ import annotations

from typing import Protocol

import torch

from ..targets.base import Target


class Drafter(Protocol):
    """Anything that proposes block positions 1..B-1 given newly accepted context features."""

    block_size: int
    source: str  # what its drafts count as in the stats' tokens_by_source: "dflash", or "mtp"
    target_layer_ids: list[int]
    length: int  # cached context positions; setting it lower rolls the cache back (the next propose drops the rest)
    cache_owner: object | None  # the Session that last filled this model's cache (session.Session sets it)

    def check_target(self, target: Target) -> None: ...

    def reset(self) -> None: ...

    def save_state(self) -> object:
        """The context cache's state and length, for load_state (the prompt cache)."""
        ...

    def load_state(self, state: object) -> None:
        """Hold a saved state and its length again."""
        ...

    def propose(
        self,
        target: Target,
        new_features: torch.Tensor | None,
        tokens: list[int],
        start: int,
        size: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Draft a block of `size` at start (tokens[: start + 1] are known), given the features of positions
        [length, start) (None: it reads no target layers); logits [rows, vocab] for positions start+1..start+rows
        (rows defaults to size - 1)."""
