"""The grammar's part in the decode loop, as one logits processor beside it: it masks the target's and the drafts'
scores to the ids the grammar allows, consumes the tokens drafted and kept, and rolls the matcher back past rejected
drafts. `Unconstrained` is the processor of a generation without a grammar: scores and drafts pass as they are."""

from __future__ import annotations

import torch

from .drafters.lookup import point_logits, point_masses
from .grammar import Grammar
from .sampling import Sampler, mask_scores


def constraint(grammar: Grammar | None, stop_ids: frozenset[int]) -> Unconstrained:
    """One generation's processor: the grammar's (its stop ids added to stop_ids), or with none the pass-through."""
    return Unconstrained(stop_ids) if grammar is None else Constrained(grammar, stop_ids)


class Unconstrained:
    """No grammar: every score and draft passes as it is. stop_ids: the ids that end the generation."""

    masks_scores = False  # whether it changes the target's scores (else greedy acceptance may read their argmax)

    def __init__(self, stop_ids: frozenset[int]) -> None:
        self.stop_ids = stop_ids

    def first(self, logits: torch.Tensor, sampler: Sampler) -> int:
        """The first new token, from the prefill's last row of logits."""
        return sampler.first(logits)

    def begin(self, device: torch.device) -> None:
        """A step begins at the sequence's end (on the block's device)."""

    def draft(
        self, block: torch.Tensor, logits: torch.Tensor, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block with drafts drawn from the drafter's rows of logits, and their probabilities (None where the
        sampler keeps none)."""
        block[1:], probs = sampler.draft(logits)
        return block, probs

    def lookup(
        self, block: torch.Tensor, tokens: list[int], vocab: int, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block with lookup's tokens as drafts, each a point mass."""
        block[1:] = torch.tensor(tokens, dtype=torch.long, device=block.device)
        return block, None if sampler.greedy else point_masses(tokens, vocab, block.device)

    def scores(self, scores: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        """The target's scores of the block's rows begin..end-1, as acceptance sees them."""
        return scores

    def commit(self, made: list[int], accepted: int, stopped: bool) -> None:
        """The step kept `made` (of which the first `accepted` were drafts it accepted); stopped: a stop id ends it."""


class Constrained(Unconstrained):
    """A grammar's matcher over one generation: each row's scores masked to the ids the grammar allows there."""

    masks_scores = True

    def __init__(self, grammar: Grammar, stop_ids: frozenset[int]) -> None:
        super().__init__(stop_ids | grammar.stop_ids)
        self.matcher = grammar.matcher()
        self.masks: torch.Tensor | None = None  # the forbidden ids at each row of the block being verified
        self.consumed = 0  # drafts the matcher has consumed in this step

    def first(self, logits: torch.Tensor, sampler: Sampler) -> int:
        """The first new token among those the grammar allows, consumed (a stop ends the generation: none is)."""
        first = sampler.first(mask_scores(logits, self.matcher.forbidden(logits.device)))
        if first not in self.stop_ids:
            self.matcher.consume(first)
        return first

    def begin(self, device: torch.device) -> None:
        """The ids forbidden after the sequence's end: the block's first row's mask."""
        self.masks, self.consumed = self.matcher.forbidden(device)[None], 0

    def draft(
        self, block: torch.Tensor, logits: torch.Tensor, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft row by row from the drafter's scores masked by the grammar, the matcher consuming each draft. The
        block ends before a row where the drafter scores no allowed id (a drafter with a smaller draft vocabulary),
        or at the first stop id drafted (not consumed; the row after it, never kept, forbids nothing)."""
        masks, drafts, probs = [self.masks[0]], [], []
        for row in range(logits.shape[0]):
            scores = mask_scores(logits[row : row + 1], masks[-1])
            if not bool(torch.isfinite(scores).any()):
                break
            token, row_probs = sampler.draft(scores)
            drafts.append(token)
            probs.append(row_probs)
            if int(token) in self.stop_ids:
                masks.append(torch.zeros_like(masks[0]))
                break
            self.matcher.consume(int(token))
            self.consumed += 1
            masks.append(self.matcher.forbidden(block.device))
        block = block[: len(drafts) + 1]
        self.masks = torch.stack(masks)
        if not drafts:
            return block, None
        block[1:] = torch.cat(drafts)
        return block, None if probs[0] is None else torch.cat(probs)

    def lookup(
        self, block: torch.Tensor, tokens: list[int], vocab: int, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Lookup's tokens through the grammar as a drafter's rows (point masses)."""
        return self.draft(block, point_logits(tokens, vocab, block.device), sampler)

    def scores(self, scores: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        """The target's scores with the ids the grammar forbids at each row at -inf."""
        return mask_scores(scores, self.masks[begin:end])

    def commit(self, made: list[int], accepted: int, stopped: bool) -> None:
        """Roll the matcher back to the kept drafts and consume the rest of the kept tokens (after a stop, nothing
        more is matched)."""
        if stopped:
            return
        self.matcher.rollback(self.consumed - min(accepted, len(made)))
        for token in made[accepted:]:
            self.matcher.consume(token)
