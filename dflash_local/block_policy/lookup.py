"""Lookup drafts' acceptance per matched length (the suffix index's confidence), and the verify size that makes
them fastest by the measured costs."""

from __future__ import annotations

from ..defaults import MIN_BLOCK
from ..drafters.suffix_index import LEVELS
from .acceptance import AcceptanceEstimate, expected_tokens
from .costs import CostTable

LOOKUP_DECAY = 0.98  # per lookup step of a matched length, the forgetting of that length's evidence


def prior_rate(length: int) -> float:
    """Acceptance assumed per position after a match of `length` tokens, before any is seen: longer is likelier."""
    return length / (length + 2)


class LookupAcceptance:
    """Per matched length: decayed counts per draft position of how often it was reached and accepted."""

    def __init__(self, positions: int) -> None:
        self.positions = positions
        self.levels = {n: AcceptanceEstimate.empty(positions, LOOKUP_DECAY) for n in LEVELS}

    def rates(self, length: int) -> list[float]:
        return self.levels[length].rates([prior_rate(length)] * self.positions)

    def observe(self, length: int, drafts: int, accepted: int) -> None:
        """One lookup step after a match of `length`: `drafts` verified, the first `accepted` kept."""
        self.levels[length].observe(drafts, accepted)


def fastest_lookup(
    rates: list[float], costs: CostTable, top: int, lookup_s: float, scale: float = 1.0
) -> tuple[int, float]:
    """The verify size k in MIN_BLOCK..top with the most expected tokens per second (the target's cost of k times
    `scale`, plus lookup's), and that speed."""
    tokens = expected_tokens(rates, top)
    speeds = {k: tokens[k] / (scale * costs.target_s[k] + lookup_s) for k in range(MIN_BLOCK, top + 1)}
    best = max(speeds, key=speeds.__getitem__)
    return best, speeds[best]
