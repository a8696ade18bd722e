"""Which tokens a target/drafter pair's caches hold for one sequence, so that the next generation reuses their longest
common prefix.

Each model owns its cache: its length, its `trim(n)`, and for a drafter the features of accepted positions it has not
cached yet. A Session records only the sequence: the tokens the caches hold, the pair that filled them, the suffix
index over the tokens, and (with serve's prompt cache) other sequences' saved states to swap in. The decode loop
records after every step, so a generation abandoned at any step (an exception in a consumer, Ctrl-C, a closed
generator) still leaves a description the next generation can trust. Each model's `cache_owner` names the Session
that last filled its cache: a session trusts only caches it owns.

With several sequences (serve --parallel N, generation.share), each Session belongs to one worker, whose target and
drafter are views for one llama.cpp sequence id: each view keeps its own length, held features and cache_owner and
trims its own id, so the Session itself stays as it is, tokens and owner and index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .drafters.suffix_index import SuffixIndex
from .prompt_cache import MIN_GAIN, PromptCache, Saved

if TYPE_CHECKING:
    from .drafters.base import Drafter
    from .targets.base import Target


class Session:
    """The ids whose state the caches hold (tokens[:length]), the pair that filled them, and the suffix index."""

    def __init__(self, cache: PromptCache | None = None) -> None:
        self.index = SuffixIndex()  # lookup's index over the session's tokens (it syncs itself to each prompt)
        self.cache = cache  # other sequences' saved states (None: the caches' sequence only)
        self.invalidate()

    def invalidate(self) -> None:
        """Forget what the caches hold: something other than the decode loop (e.g. calibration) used them."""
        self.tokens: list[int] = []  # the caches hold tokens[:length]
        self.length = 0
        self.owner: tuple | None = None  # (target, drafter, feature layers) that filled the caches

    def resume(
        self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple[int, ...] | None
    ) -> int:
        """Trim both caches to the longest common prefix of the prompt and the cached ids (a saved entry holding more
        of it swapped in first), leaving at least one prompt token to forward; return how many positions are kept."""
        if self.cache is not None:
            self._swap(target, drafter, prompt_ids, layers)
        kept = self._given(target, self.common_prefix(target, drafter, prompt_ids, layers))
        self.owner = (target, drafter, layers)
        for model in _models(target, drafter):
            model.cache_owner = self
            model.trim(kept)
        self.length = kept
        return kept

    def common_prefix(
        self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple[int, ...] | None
    ) -> int:
        """How many leading prompt ids the caches hold for this pair and feature layers (at most all but one)."""
        owner = self.owner
        same = owner is not None and owner[0] is target and owner[1] is drafter and owner[2] == layers
        if not same or not self._owns() or target.length < self.length:  # another session, or a trim, used the caches
            return 0
        limit = min(self.length, len(prompt_ids) - 1)
        kept = 0
        while kept < limit and self.tokens[kept] == prompt_ids[kept]:
            kept += 1
        return kept

    def reusable(self, prompt_ids: list[int]) -> int:
        """How many leading prompt ids the caches or a saved entry would give a generation by the pair that last filled
        the caches (serve --parallel's routing compares this between idle workers)."""
        if self.owner is None:
            return 0
        target, drafter, layers = self.owner
        given = self._given(target, self.common_prefix(target, drafter, prompt_ids, layers))
        return given if self.cache is None else max(given, self.cache.best(self.owner, prompt_ids)[1])

    def record(self, tokens: list[int], length: int) -> None:
        """The caches now hold tokens[:length].

        Keeps the caller's list, which the decode loop only appends to between records (a copy per step would cost a
        long run of plain steps time quadratic in its length)."""
        self.tokens, self.length = tokens, length

    def checkpoint(self) -> None:
        """Save a copy of the caches' state now (a prompt just prefilled) where the target's state cannot drop any
        suffix (a recurrent state; a window-sized cache, once the answer has reused the cells): the next turn of the
        conversation continues these tokens."""
        target = None if self.owner is None else self.owner[0]
        if self.cache is not None and target is not None and (target.recurrent or target.window):
            self.cache.add(self._saved(None))

    def _given(self, target: Target, kept: int) -> int:
        """How many prompt ids the caches give, `kept` of them common: none where the target cannot trim to `kept` in
        place (below its trim_floor a trim feeds them again: the prefill is as short from nothing)."""
        return kept if kept >= target.trim_floor else 0

    def _owns(self) -> bool:
        """Whether this session filled the owner pair's caches last."""
        return all(model.cache_owner is self for model in _models(*self.owner[:2]))

    def _swap(self, target: Target, drafter: Drafter | None, prompt_ids: list[int], layers: tuple | None) -> None:
        """Save the caches' sequence where the prompt would drop MIN_GAIN or more of it, and swap in the pair's saved
        entry that holds the most of the prompt where that is MIN_GAIN more than the caches give (nothing below the
        target's trim_floor)."""
        kept = self.common_prefix(target, drafter, prompt_ids, layers)
        given = self._given(target, kept)
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
        self.tokens, self.length, self.owner = list(entry.tokens), len(entry.tokens), owner
        self.index = entry.index if entry.index is not None else SuffixIndex()
        for model in _models(target, drafter):
            model.cache_owner = self

    def _holds_sequence(self) -> bool:
        """Whether the caches still hold what this session recorded (no one else used them since)."""
        if self.owner is None or self.length == 0:
            return False
        return self._owns() and self.owner[0].length >= self.length

    def _saved(self, index: SuffixIndex | None) -> Saved:
        """The caches' sequence as a prompt-cache entry (with this index over its tokens; None: rebuilt on use)."""
        target, drafter, _ = self.owner
        if target.length > self.length:  # a step's forward that was never committed
            target.trim(self.length)
        drafter_state = None if drafter is None else drafter.save_state()
        tokens = self.tokens[: self.length]
        return Saved(self.owner, tokens, target.save_state(), drafter_state, index, target.trim_floor)


def _models(target: Target, drafter: Drafter | None) -> tuple:
    """The pair's models that hold a cache: the target, and the drafter where there is one."""
    return (target,) if drafter is None else (target, drafter)
