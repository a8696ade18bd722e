"""Saved sequence states in RAM (serve's prompt cache across conversations): each entry holds what a target/drafter
pair's caches held for one sequence, so that a later request continuing it skips its prefill. Bounded by a byte
budget, least recently used out."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .drafters.suffix_index import SuffixIndex

MIN_GAIN = 16  # positions a saved entry must hold beyond what the caches give, to be worth swapping in


@dataclass
class Saved:
    """One sequence's caches: the pair that filled them, the ids whose state they held, each model's saved state (the
    drafter's with the features it had not cached), the suffix index over the ids (None: rebuilt on use).
    floor: the fewest of its ids a prompt must continue to use it (the target's trim_floor: all of them for a
    recurrent state, which cannot drop a suffix; the reach of a window-sized cache)."""

    owner: tuple
    tokens: list[int]
    target_state: object
    drafter_state: object | None
    index: SuffixIndex | None
    floor: int

    @property
    def size(self) -> int:
        """Bytes held (the models' states; the ids and index are small beside them)."""
        return state_bytes((self.target_state, self.drafter_state))


def state_bytes(state: object) -> int:
    """Bytes of a saved state: buffers, tensors and arrays, in tuples and lists."""
    if isinstance(state, (bytes, bytearray)):
        return len(state)
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, ctypes.Array):
        return ctypes.sizeof(state)
    if isinstance(state, (tuple, list)):
        return sum(state_bytes(part) for part in state)
    return 0


def usable(entry: Saved, prompt_ids: list[int]) -> int:
    """How many leading prompt ids the entry's caches give (at most all but the prompt's last id)."""
    tokens, limit = entry.tokens, min(len(entry.tokens), len(prompt_ids) - 1)
    if entry.floor > limit or prompt_ids[: entry.floor] != tokens[: entry.floor]:
        return 0
    kept = entry.floor
    while kept < limit and tokens[kept] == prompt_ids[kept]:
        kept += 1
    return kept


class PromptCache:
    """Saved entries, least recently used first, holding at most `budget` bytes together."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: list[Saved] = []

    @property
    def used(self) -> int:
        return sum(entry.size for entry in self.entries)

    def best(self, owner: tuple, prompt_ids: list[int]) -> tuple[Saved | None, int]:
        """The pair's entry giving the most leading prompt ids, and how many (None, 0: none gives any)."""
        found, most = None, 0
        for entry in self.entries:
            if entry.owner == owner:
                kept = usable(entry, prompt_ids)
                if kept > most:
                    found, most = entry, kept
        return found, most

    def take(self, entry: Saved) -> Saved:
        """Remove the entry (its state goes back into the caches)."""
        self.entries.remove(entry)
        return entry

    def add(self, entry: Saved) -> None:
        """Keep the entry as the most recent, dropping those it makes useless (the pair's entries whose ids it
        continues), then the least recently used while over budget (the entry itself if it alone is)."""
        self.entries = [old for old in self.entries if not _covers(entry, old)]
        self.entries.append(entry)
        while self.entries and self.used > self.budget:
            self.entries.pop(0)

    def describe(self) -> dict:
        """The store for /health: entries, bytes held and the budget."""
        return {"entries": len(self.entries), "bytes": self.used, "budget_bytes": self.budget}


def _covers(new: Saved, old: Saved) -> bool:
    """Whether every prompt `old` serves, `new` serves as far: same pair, old's ids begin new's, and new needs no more
    of them continued than old does."""
    if new.owner != old.owner or len(old.tokens) > len(new.tokens) or new.floor > old.floor:
        return False
    return new.tokens[: len(old.tokens)] == old.tokens
