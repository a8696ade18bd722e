"""Prompt-lookup (n-gram) drafting: the baseline a user could switch on instead of a trained drafter."""

from __future__ import annotations

import torch

from ..targets.base import Target


class PromptLookupDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the context's last n-gram."""

    target_layer_ids: list[int] = []

    def __init__(self, block_size: int = 16, max_ngram: int = 3) -> None:
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.cache_owner: object | None = None  # the Session that last used it (it caches nothing)

    def check_target(self, target: Target) -> None:
        """Any target works: lookup needs no features."""

    def reset(self) -> None:
        """Lookup keeps no state between steps."""

    def continuation(self, tokens: list[int], count: int) -> list[int]:
        """Up to count tokens after the most recent earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for begin in range(len(tokens) - n - 1, -1, -1):
                if tokens[begin : begin + n] == suffix:
                    found = tokens[begin + n : begin + n + count]
                    if found:
                        return found
        return []

    def propose(
        self, target: Target, new_features, tokens: list[int], start: int, size: int, rows: int | None = None
    ) -> torch.Tensor:
        """One-hot logits for the first `rows` (default size-1) positions: the lookup continuation, padded by
        repeating the last known token."""
        rows = size - 1 if rows is None else rows
        known = tokens[: start + 1]
        guess = self.continuation(known, rows)
        guess += [guess[-1] if guess else known[-1]] * (rows - len(guess))
        logits = torch.full((rows, target.vocab_size), -1e4, device=target.device)
        logits[torch.arange(rows), torch.tensor(guess, device=target.device)] = 0.0
        return logits
