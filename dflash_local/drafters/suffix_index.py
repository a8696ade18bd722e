"""An incremental index over a session's tokens (the prompt and everything generated) that proposes what followed
the longest earlier match of the text's end: hashed n-gram tables at fixed lengths, constant work per token."""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # n-gram lengths indexed; a match's length is the longest that matches
_MOD = (1 << 61) - 1  # polynomial hashes modulo a Mersenne prime (a collision is caught by comparing the tokens)
_BASE = 1_000_000_007
_POWERS = {n: pow(_BASE, n, _MOD) for n in LEVELS}
_POSITION = (1 << 32) - 1  # a table entry packs (count << 32) | the latest end position


@dataclass(frozen=True)
class Match:
    """The proposed continuation of the longest earlier match of the text's end, the match's length (a LEVEL) and
    how many earlier occurrences of that n-gram have a token after them."""

    tokens: list[int]
    length: int
    count: int


class SuffixIndex:
    """For every LEVEL n, the latest end position and the count of each n-gram that has a token after it. Extending
    by t tokens costs O(t * len(LEVELS)); a match costs O(sum of LEVELS) at most."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Hold no tokens."""
        self.tokens: list[int] = []
        self.prefix = [0]  # prefix[i]: the hash of tokens[:i]
        self.tables: dict[int, dict[int, int]] = {n: {} for n in LEVELS}

    def _hash(self, begin: int, end: int) -> int:
        return (self.prefix[end] - self.prefix[begin] * _POWERS[end - begin]) % _MOD

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index the n-grams that now have a token after them (those ending before the last token)."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending at end - 1 gain their next token
            self.tokens.append(token)
            self.prefix.append((self.prefix[-1] * _BASE + token + 1) % _MOD)
            if token < 0:  # an image row (dflash_local.vision): never proposed, so nothing is indexed as before it
                continue
            for n in LEVELS:
                if n > end:
                    break
                table, key = self.tables[n], self._hash(end - n, end)
                table[key] = ((table.get(key, 0) >> 32) + 1) << 32 | (end - 1)

    def sync(self, tokens: list[int]) -> None:
        """Make the index hold exactly `tokens`: extended where they continue what it holds, rebuilt otherwise."""
        held = len(self.tokens)
        if held > len(tokens) or tokens[:held] != self.tokens:
            self.clear()
            held = 0
        self.extend(tokens[held:])

    def match(self, count: int) -> Match | None:
        """Up to `count` tokens after the latest earlier occurrence of the longest LEVEL-gram ending the text; where
        that occurrence runs into the text's end or an image row (a negative id), the proposal repeats itself (a
        periodic text goes on). None where nothing matches."""
        end = len(self.tokens)
        for n in reversed(LEVELS):
            if n >= end:
                continue
            entry = self.tables[n].get(self._hash(end - n, end))
            if entry is None:
                continue
            last = entry & _POSITION
            if self.tokens[last - n + 1 : last + 1] != self.tokens[end - n :]:
                continue  # a hash collision
            proposal: list[int] = []
            for i in range(count):
                source = last + 1 + i
                token = self.tokens[source] if source < end else proposal[source - end]
                if token < 0:  # an image row is never a draft: the text before it repeats instead
                    break
                proposal.append(token)
            period = len(proposal)  # at least 1: an n-gram is indexed only before a text token
            proposal += [proposal[i % period] for i in range(period, count)]
            return Match(proposal, n, entry >> 32)
        return None
