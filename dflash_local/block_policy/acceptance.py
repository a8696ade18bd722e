"""Running acceptance estimates per draft position, and the tokens a step of each verify size makes from them."""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_WEIGHT = 2.0  # pseudo-observations the prior (the drafter's history) is worth per position
DECAY = 0.95  # per-step forgetting of this text's evidence (plain steps too): back toward the history when not drafting
HISTORY_DECAY = 0.999  # per-step forgetting of the drafter's history across generations


@dataclass
class AcceptanceEstimate:
    """Decayed counts per draft position j: how often j was reached (drafts before it accepted) and accepted."""

    reached: list[float]
    accepted: list[float]
    decay: float

    @classmethod
    def empty(cls, positions: int, decay: float) -> AcceptanceEstimate:
        return cls([0.0] * positions, [0.0] * positions, decay)

    def fade(self, steps: int) -> None:
        """Let the evidence fade by `steps` steps (plain steps do only this)."""
        factor = self.decay**steps
        self.reached = [r * factor for r in self.reached]
        self.accepted = [a * factor for a in self.accepted]

    def observe(self, drafts: int, accepted: int) -> None:
        """One step that verified `drafts` drafted positions and accepted the first `accepted` of them."""
        self.fade(1)
        for j in range(min(drafts, accepted + 1)):
            self.reached[j] += 1.0
            self.accepted[j] += 1.0 if j < accepted else 0.0

    def rates(self, prior: list[float]) -> list[float]:
        """Posterior mean per position, the prior counting PRIOR_WEIGHT observations."""
        return [
            (a + PRIOR_WEIGHT * p) / (r + PRIOR_WEIGHT)
            for a, r, p in zip(self.accepted, self.reached, prior, strict=True)
        ]


def expected_tokens(rates: list[float], top: int) -> list[float]:
    """Tokens a step makes on average for each verify size k = 0..top (index k; k = 0 makes none): the bonus token
    plus each draft, which counts only when it and every draft before it are accepted."""
    tokens, run = [0.0, 1.0], 1.0
    for rate in rates[: top - 1]:
        run *= rate
        tokens.append(tokens[-1] + run)
    return tokens
