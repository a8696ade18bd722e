"""What sampled output should look like, computed apart from dflash's sampler: temperature, top-k and top-p written
again in float64, the exact distribution of n-token continuations by enumeration, a chi-square test against it,
and the sample size a test needs for a stated power.

Nothing here imports dflash_local.sampling: the logits come from the reference implementation (the oracle) or from
llama.cpp itself, and the truncation below is a second, independent writing of the rules in `probabilities()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from scipy.stats import chi2, chisquare, ncx2

ALPHA = 1e-3  # a sampled-output test fails below this p-value (one false alarm in 1000 runs of a correct sampler)
POWER = 0.99  # and fails a wrong sampler at least this often
MIN_EXPECTED = 5  # cells expected fewer times are pooled into one (the chi-square approximation's usual rule)


def truncated(logits: Sequence[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The sampling distribution of one row: softmax(logits / temperature) over the top_k highest scores (ties with
    the k-th kept), then the most likely tokens until their mass reaches top_p (the one that crosses it kept),
    renormalised. float64 throughout."""
    scores = [float(value) / temperature for value in logits]
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if 0 < top_k < len(scores):
        kth = scores[ranked[top_k - 1]]
        ranked = [i for i in ranked if scores[i] >= kth]
    top = scores[ranked[0]]
    weights = {i: math.exp(scores[i] - top) for i in ranked}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in ranked:
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    kept_total = sum(weights[i] for i in kept)
    row = [0.0] * len(scores)
    for i in kept:
        row[i] = weights[i] / kept_total
    return row


def continuations(
    next_logits: Callable[[list[list[int]]], Sequence[Sequence[float]]],
    prompt: list[int],
    length: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[tuple[int, ...], float]:
    """P(x1..x_length | prompt) for every continuation with mass, by enumeration, one position at a time:
    next_logits(prefixes) gives the logits of the token after each of those id lists."""
    level: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        rows = next_logits([prompt + list(prefix) for prefix in level])
        grown: dict[tuple[int, ...], float] = {}
        for (prefix, probability), logits in zip(level.items(), rows, strict=True):
            for token, p in enumerate(truncated(logits, temperature, top_k, top_p)):
                if p > 0:
                    grown[(*prefix, token)] = probability * p
        level = grown
    return level


def cells(exact: dict[tuple[int, ...], float], samples: int) -> list[list[tuple[int, ...]]]:
    """The chi-square's cells: each continuation expected MIN_EXPECTED times or more alone, the rest pooled."""
    alone = [[s] for s, p in exact.items() if p * samples >= MIN_EXPECTED]
    pooled = [s for s, p in exact.items() if p * samples < MIN_EXPECTED]
    return alone + ([pooled] if pooled else [])


def p_value(exact: dict[tuple[int, ...], float], counts: dict[tuple[int, ...], int]) -> float:
    """Chi-square p-value of observed continuation counts against the exact distribution (0 when a continuation
    without mass was drawn)."""
    samples = sum(counts.values())
    if any(sequence not in exact for sequence in counts):
        return 0.0
    groups = cells(exact, samples)
    observed = [sum(counts.get(s, 0) for s in group) for group in groups]
    expected = [samples * sum(exact[s] for s in group) for group in groups]
    scale = samples / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def effect_size(exact: dict[tuple[int, ...], float], counts: dict[tuple[int, ...], int]) -> float:
    """Cohen's w^2 = sum (q - p)^2 / p of a sampler whose continuation counts these are, over the cells at that
    sample size; each (q - p)^2 estimated without bias as (c/M - p)^2 - (c/M)(1 - c/M)/(M - 1)."""
    samples = sum(counts.values())
    total = 0.0
    for group in cells(exact, samples):
        p = sum(exact.get(s, 0.0) for s in group)
        q = sum(counts.get(s, 0) for s in group) / samples
        total += ((q - p) ** 2 - q * (1 - q) / (samples - 1)) / p
    return total


def power(effect: float, samples: int, df: int, alpha: float = ALPHA) -> float:
    """The chi-square test's power at that sample size: P(noncentral chi2(df, samples * effect) > its critical
    value at alpha)."""
    return float(ncx2.sf(chi2.isf(alpha, df), df, samples * effect))


def samples_for_power(effect: float, exact: dict[tuple[int, ...], float], target: float = POWER) -> int:
    """The fewest samples (a multiple of 100) at which the chi-square test over exact's cells finds a sampler of
    that effect size with the target power."""
    samples = 100
    while len(cells(exact, samples)) < 2 or power(effect, samples, len(cells(exact, samples)) - 1) < target:
        samples += 100
    return samples
