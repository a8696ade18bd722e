"""The suffix index against a brute-force scan of the same text: the same match (length, count, latest occurrence's
continuation) after every token, built in random chunks, across a rebuild."""

from __future__ import annotations

import random

from dflash_local.drafters.suffix_index import LEVELS, Match, SuffixIndex


def brute_force(tokens: list[int], count: int) -> Match | None:
    """The longest LEVEL-gram ending the text that also ends earlier with a token after it: its latest such
    occurrence's continuation (repeating itself past the text's end) and how many such occurrences there are."""
    end = len(tokens)
    for n in sorted(LEVELS, reverse=True):
        if n >= end:
            continue
        ends = [e for e in range(n - 1, end - 1) if tokens[e - n + 1 : e + 1] == tokens[end - n :]]
        if ends:
            extended = list(tokens)
            for i in range(count):
                extended.append(extended[ends[-1] + 1 + i])
            return Match(extended[end:], n, len(ends))
    return None


def test_matches_equal_the_brute_force_scan_after_every_chunk():
    rng = random.Random(0)
    for alphabet in (2, 3, 8, 50):
        index, tokens = SuffixIndex(), []
        while len(tokens) < 400:
            # copies of earlier spans make long matches; random tokens break them
            if tokens and rng.random() < 0.5:
                begin = rng.randrange(len(tokens))
                chunk = tokens[begin : begin + rng.randrange(1, 60)]
            else:
                chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 5))]
            index.extend(chunk)
            tokens += chunk
            count = rng.randrange(0, 20)
            assert index.match(count) == brute_force(tokens, count), (alphabet, len(tokens))


def test_long_copies_reach_the_longest_level_and_periodic_text_continues():
    index = SuffixIndex()
    text = list(range(100, 140))
    index.extend(text + [7] + text[:35])
    found = index.match(5)
    assert found == Match(text[35:40], max(LEVELS), 1)
    index.extend([1, 2, 1, 2, 1])
    assert index.match(4).tokens == [2, 1, 2, 1]


def test_sync_extends_a_continued_text_and_rebuilds_a_changed_one():
    index = SuffixIndex()
    index.sync([1, 2, 3, 9, 1, 2])
    assert index.match(2) == Match([3, 9], 2, 1)
    index.sync([1, 2, 3, 9, 1, 2, 3, 4])
    assert index.tokens == [1, 2, 3, 9, 1, 2, 3, 4]
    index.sync([5, 6, 1, 2])  # not a continuation: what the old text held is gone
    assert index.match(2) is None
    assert index.tokens == [5, 6, 1, 2]
