"""What a loaded target/drafter pair's caches hold, so that the next generation reuses their longest common prefix.

The engine is single-sequence: the target's KV cache and the drafter's context cache are one resource per loaded
pair. The decode loop records their state after every step, so a generation abandoned at any step (an exception
in a consumer, Ctrl-C, a closed generator) still leaves a description the next generation can trust. Each model's
`cache_owner` names the Session that last filled its cache: a session trusts only caches it owns.

With a prompt cache (serve's), a session keeps other sequences' saved states too: a request that an entry serves
further than the caches do swaps that entry in (the caches' sequence saved in its place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .drafters.suffix_index import SuffixIndex
from .prompt_cache import MIN_GAIN, PromptCache, Saved

if TYPE_CHECKING:
    from .drafters.base import Drafter
    from .targets.base import Target


class Session:
    """The ids whose K/V the target's cache holds, how far the drafter's cache goes, and the accepted positions'
    features the drafter has not taken yet."""

    def __init__(self, cache: PromptCache | None = None) -> None:
        self.index = SuffixIndex()  # lookup's index over the session's tokens (it syncs itself to each prompt)
        self.cache = cache  # other sequences' saved states (None: the caches' sequence only)
        self.invalidate()

    def invalidate(self) -> None:
        """Forget what the caches hold: something other than the decode loop (e.g. calibration) used them."""
        self.tokens: list[int] = []  # the target's cache holds tokens[:length]
        self.length = 0
        self.drafter_length = 0
        self.pending: list[torch.Tensor] = []  # features of positions drafter_length..length-1, in order
        self.owner: tuple | None = None  # (target, drafter, feature layers) that filled the caches

    def resume(
        self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple[int, ...] | None
    ) -> tuple[int, list[torch.Tensor]]:
        """Roll both caches back to the longest common prefix of the prompt and the cached ids, leaving at least one
        prompt token to forward; return how many positions are kept and the kept positions' pending features. A
        saved entry that holds more of the prompt is swapped in first."""
        if self.cache is not None:
            self._swap(target, drafter, prompt_ids, layers)
        kept = self.common_prefix(target, drafter, prompt_ids, layers)
        self.owner = (target, drafter, layers)
        for model in (target, drafter) if drafter is not None else (target,):
            model.cache_owner = self
        if kept == 0:
            target.reset()
            if drafter is not None:
                drafter.reset()
            self.length = self.drafter_length = 0
            self.pending = []
            return 0, []
        target.rollback(kept)
        rows = sum(len(features) for features in self.pending) - (self.length - kept)  # pending rows below kept
        self.length = kept
        self.drafter_length = min(self.drafter_length, kept)
        if drafter is not None:
            drafter.length = self.drafter_length
        self.pending = [torch.cat(self.pending)[:rows]] if rows > 0 else []
        return kept, list(self.pending)

    def common_prefix(
        self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple[int, ...] | None
    ) -> int:
        """How many leading prompt ids the caches hold for this pair and feature layers (at most all but one)."""
        owner = self.owner
        same = owner is not None and owner[0] is target and owner[1] is drafter and owner[2] == layers
        ours = same and target.cache_owner is self and (drafter is None or drafter.cache_owner is self)
        if not ours or target.length < self.length:  # another session, or a reset, used the caches
            return 0
        limit = min(self.length, len(prompt_ids) - 1)
        kept = 0
        while kept < limit and self.tokens[kept] == prompt_ids[kept]:
            kept += 1
        return kept

    def record(self, tokens: list[int], length: int, drafter_length: int, pending: list[torch.Tensor]) -> None:
        """The caches now hold tokens[:length] (target), drafter_length positions (drafter) and pending features.

        Keeps the caller's lists, which the decode loop only appends to between records (a copy per step would cost
        a long run of plain steps time quadratic in its length)."""
        self.tokens, self.length, self.drafter_length, self.pending = tokens, length, drafter_length, pending

    def checkpoint(self) -> None:
        """Save a copy of the caches' state now (a prompt just prefilled) where the target's state cannot drop a
        suffix: the next turn of the conversation continues exactly these tokens."""
        if self.cache is not None and self.owner is not None and self.owner[0].recurrent:
            self.cache.add(self._saved(None))

    def _swap(self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple | None) -> None:
        """Save the caches' sequence where the prompt would drop MIN_GAIN or more of it, and swap in the pair's saved
        entry that holds the most of the prompt where that is MIN_GAIN more than the caches give (a recurrent
        target's caches give nothing unless the prompt continues all they hold: a rollback re-feeds the rest)."""
        kept = self.common_prefix(target, drafter, prompt_ids, layers)
        given = 0 if target.recurrent and kept < self.length else kept
        owner = (target, drafter, layers)
        entry, gain = self.cache.best(owner, prompt_ids)
        swap = entry is not None and gain >= given + MIN_GAIN
        if swap:
            self.cache.take(entry)
        if self._holds_sequence() and (swap or self.length - kept >= MIN_GAIN):
            self.cache.add(self._saved(self.index))
            self.index = SuffixIndex()
        if not swap:
            return
        target.load_state(entry.target_state, entry.tokens)
        if drafter is not None:
            drafter.load_state(entry.drafter_state)
        self.tokens, self.length = list(entry.tokens), len(entry.tokens)
        self.drafter_length, self.pending, self.owner = entry.drafter_length, list(entry.pending), owner
        self.index = entry.index if entry.index is not None else SuffixIndex()
        for model in (target, drafter) if drafter is not None else (target,):
            model.cache_owner = self

    def _holds_sequence(self) -> bool:
        """Whether the caches still hold what this session recorded (no one else used them since)."""
        if self.owner is None or self.length == 0:
            return False
        target, drafter, _ = self.owner
        ours = target.cache_owner is self and (drafter is None or drafter.cache_owner is self)
        return ours and target.length >= self.length

    def _saved(self, index: SuffixIndex | None) -> Saved:
        """The caches' sequence as a prompt-cache entry (with this index over its tokens; None: rebuilt on use)."""
        target, drafter, _ = self.owner
        if target.length > self.length:  # a step's forward that was never committed
            target.rollback(self.length)
        drafter_state = None if drafter is None else drafter.save_state()
        tokens = self.tokens[: self.length]
        pending = list(self.pending)
        return Saved(
            self.owner,
            tokens,
            target.save_state(),
            drafter_state,
            self.drafter_length,
            pending,
            index,
            target.recurrent,
        )
