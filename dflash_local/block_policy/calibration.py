"""Timing on the device's timeline: the one timer of the block policy's calibration and of the benchmarks, and the
calibration itself (interleaved rounds over the sizes, each size's fastest timing fitted; see costs.fit)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from ..defaults import MIN_BLOCK, block_limit
from ..drafters.suffix_index import SuffixIndex
from ..runtime import StepClock
from .costs import CostTable, Samples, fit, interpolate

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CALIBRATION_CONTEXT = 64
CALIBRATION_ROUNDS = 5  # a calibration times every size in at least this many rounds, interleaved ...
STEADY_ROUNDS = 3  # ... and on until this many rounds in a row improved no fit by more than STEADY_CHANGE ...
STEADY_CHANGE = 0.02
MAX_ROUNDS = 40  # ... but for at most this many rounds, or past CALIBRATION_MAX_S once CALIBRATION_ROUNDS are done
CALIBRATION_MAX_S = 30.0
CHECK_ROUNDS = 3  # a cached table is checked at load by this many rounds of decode-1 and verify-block


def timed(clock: StepClock, call: Callable[[], object]) -> float:
    """Seconds one call takes between marks on the device's timeline (CUDA events on CUDA)."""
    start = clock.mark()
    call()
    return clock.seconds(start, clock.mark())


def median_ms(call: Callable[[], object], device: torch.device | str, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of `repeats` timed calls after `warmup` untimed ones: the benchmarks' timer."""
    for _ in range(warmup):
        call()
    clock = StepClock(torch.device(device))
    return statistics.median(timed(clock, call) for _ in range(repeats)) * 1000


def _verify_step(target, block: torch.Tensor, features: bool) -> None:
    """What a step's verify costs the target: the forward of the block (with the drafter's features where one
    drafts), then the trim a step makes (it keeps the first token at least; on a hybrid target the trim restores
    recurrent state)."""
    target.forward(block, features=features)
    target.trim(CALIBRATION_CONTEXT + 1)


def _draft_step(target, drafter, context: torch.Tensor) -> Callable[[int], Callable[[], object]]:
    """The drafting step of k - 1 rows, per k, after the drafter took the context's features: the drafter's, or with
    none, the suffix index's match over the context (lookup)."""
    tokens = context.tolist()
    if drafter is None:
        index = SuffixIndex()
        index.extend(tokens[:CALIBRATION_CONTEXT])
        return lambda k: partial(index.match, k - 1)
    target.set_feature_layers(drafter.target_layer_ids)
    drafter.trim(0)
    target.trim(0)
    features = target.forward(context[:CALIBRATION_CONTEXT].to(target.device), all_logits=False).features
    block = drafter.block_size
    drafter.propose(target, features, tokens, CALIBRATION_CONTEXT, block, 1)
    return lambda k: partial(drafter.propose, target, features[:0], tokens, CALIBRATION_CONTEXT, block, k - 1)


def time_steps(target, drafter, sizes: list[int], rounds: int, steady: int = 0) -> tuple[Samples, Samples]:
    """Seconds of the target's forward of k tokens and of the drafter's step for k-1 rows (k > 1; with no drafter,
    lookup's), per k in sizes, on a short random context: a warm-up round, then rounds over every size (a burst of
    load lengthens a few rounds of each size, not every timing of one), `rounds` of them and on until `steady` rounds
    in a row left every fit (see fit) within STEADY_CHANGE, within MAX_ROUNDS and CALIBRATION_MAX_S. Both models are
    emptied afterwards."""
    block = block_limit(drafter)[0]
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (CALIBRATION_CONTEXT + block,), generator=generator)
    ids = context.to(target.device)
    draft_step = _draft_step(target, drafter, context)
    if drafter is None:
        target.trim(0)
        target.forward(ids[:CALIBRATION_CONTEXT], all_logits=False, features=False)
    target_s: Samples = {k: [] for k in sizes}
    draft_s: Samples = {k: [] for k in sizes if k > 1}
    clock = StepClock(target.device)
    began, fitted, unchanged = time.perf_counter(), [], 0
    for done in range(MAX_ROUNDS + 1):  # round 0 warms up
        if done > rounds and (unchanged >= steady or time.perf_counter() - began > CALIBRATION_MAX_S):
            break
        for k in sizes:
            block_ids = ids[CALIBRATION_CONTEXT : CALIBRATION_CONTEXT + k]
            seconds = timed(clock, partial(_verify_step, target, block_ids, drafter is not None))
            target.trim(CALIBRATION_CONTEXT)
            if done:
                target_s[k].append(seconds)
            if k > 1:
                seconds = timed(clock, draft_step(k))
                if done:
                    draft_s[k].append(seconds)
        if done:
            previous, fitted = fitted, [*fit(target_s).values(), *fit(draft_s).values()]
            steady_now = previous and all(
                old <= new * (1 + STEADY_CHANGE) for old, new in zip(previous, fitted, strict=True)
            )
            unchanged = unchanged + 1 if steady_now else 0
    target.trim(0)
    if drafter is not None:
        drafter.trim(0)
    return target_s, draft_s


def measure_costs(target, drafter, repeats: int = CALIBRATION_ROUNDS) -> CostTable:
    """The pair's costs on this machine (with no drafter, the target's and lookup's): time_steps over CALIBRATION_SIZES
    up to the block (`repeats` rounds at least, then until steady), fitted (see fit) and interpolated to every size;
    the sizes between become stale."""
    block = block_limit(drafter)[0]
    sizes = [k for k in CALIBRATION_SIZES if k < block] + [block]
    target_samples, draft_samples = time_steps(target, drafter, sizes, repeats, STEADY_ROUNDS)
    costs = CostTable(
        interpolate(fit(target_samples), range(1, block + 1)),
        interpolate(fit(draft_samples), range(MIN_BLOCK, block + 1)),
        target_samples,
        draft_samples,
        time.time(),
    )
    costs.stale = set(costs.target_s) - set(sizes)
    return costs
