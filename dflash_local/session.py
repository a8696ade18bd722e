"""What a loaded target/drafter pair's caches hold, so that the next generation reuses their longest common prefix.

The engine is single-sequence: the target's KV cache and the drafter's context cache are one resource per loaded
pair. The decode loop records their state after every step, so a generation abandoned at any step (an exception
in a consumer, Ctrl-C, a closed generator) still leaves a description the next generation can trust. Each model's
`cache_owner` names the Session that last filled its cache: a session trusts only caches it owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .drafters.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from .drafters.base import Drafter
    from .targets.base import Target


class Session:
    """The ids whose K/V the target's cache holds, how far the drafter's cache goes, and the accepted positions'
    features the drafter has not taken yet."""

    def __init__(self) -> None:
        self.index = SuffixIndex()  # lookup's index over the session's tokens (it syncs itself to each prompt)
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
        prompt token to forward; return how many positions are kept and the kept positions' pending features."""
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
