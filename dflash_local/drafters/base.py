"""The drafter interface every drafter implements (the torch one, llama.cpp's native one, prompt lookup),
beside targets/base.py's Target: what the decode loop asks of a drafter; and the context bookkeeping they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from ..targets.base import Target


class Drafter(Protocol):
    """Anything that proposes block positions 1..B-1 given the accepted positions' context features."""

    block_size: int
    source: str  # what its drafts count as in the stats' tokens_by_source: "dflash", or "mtp"
    target_layer_ids: list[int]
    cache_owner: object | None  # the Session that last filled this model's cache (session.Session sets it)

    def check_target(self, target: Target) -> None: ...

    def extend(self, features: torch.Tensor | None) -> None:
        """Hold the features of the next accepted positions (None: none read) for the next propose."""
        ...

    def trim(self, length: int) -> None:
        """Forget every position at or after `length`, cached or held (0: all of them)."""
        ...

    def save_state(self) -> object:
        """The context's state (cache, length, held features), for load_state (the prompt cache)."""
        ...

    def load_state(self, state: object) -> None:
        """Hold a saved state again."""
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
        """Draft a block of `size` at start (tokens[: start + 1] are known), caching first the features it holds and
        new_features (None: none), which together cover positions [length, start); logits [rows, vocab] for positions
        start+1..start+rows (rows defaults to size - 1)."""


class DraftContext(ABC):
    """A drafter's context: `length` positions cached, then the accepted positions' features it holds but has not
    cached yet (its next propose caches them first); subclasses cut, save and load the cache itself."""

    def __init__(self) -> None:
        self.length = 0  # cached context positions
        self._held: list[torch.Tensor] = []  # features of positions length.., in order

    @property
    def held(self) -> torch.Tensor | None:
        """The features held past the cache (None: none)."""
        return torch.cat(self._held) if self._held else None

    def extend(self, features: torch.Tensor | None) -> None:
        """Hold the features of the next accepted positions for the next propose."""
        if features is not None and len(features):
            self._held.append(features)

    def trim(self, length: int) -> None:
        """Forget every position at or after `length`: held features past it, cached positions past it (0: all)."""
        if length <= self.length:
            self._held = []
            if length < self.length or length == 0:
                self._cut(length)
            return
        rows = length - self.length
        if sum(len(features) for features in self._held) > rows:
            self._held = [torch.cat(self._held)[:rows]]

    def _cut(self, length: int) -> None:
        """Cut the cache to `length` positions (0: empty it)."""
        self.length = length

    def _take(self, new_features: torch.Tensor | None, start: int) -> torch.Tensor | None:
        """The held features and new_features, which must cover positions [length, start); held no more."""
        parts = self._held + ([new_features] if new_features is not None else [])
        self._held = []
        features = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
        if self.length + (0 if features is None else features.shape[0]) != start:
            raise ValueError(f"drafter cache holds {self.length} positions, got features up to {start}")
        return features

    def save_state(self) -> tuple[object, int, tuple[torch.Tensor, ...]]:
        """The cache's state, its length and the held features, for load_state (the prompt cache)."""
        return self._save_cache(), self.length, tuple(self._held)

    def load_state(self, state: tuple[object, int, tuple[torch.Tensor, ...]]) -> None:
        """Hold a saved state again (its length and held features with it)."""
        self._load_cache(state[0])
        self.length, self._held = state[1], list(state[2])

    @abstractmethod
    def _save_cache(self) -> object:
        """The cached positions' state."""

    @abstractmethod
    def _load_cache(self, state: object) -> None:
        """Hold a state from _save_cache again."""
