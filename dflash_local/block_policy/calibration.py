"""Timing on the device's timeline: the one timer of the block policy's calibration and of the benchmarks, and the
calibration itself (interleaved rounds over the sizes, each size's fastest timing fitted; see costs.fit)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

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


def _verify_step(target, block: torch.Tensor) -> None:
    """What a step's verify costs the target: the forward of the block, then the rollback a step makes (it keeps
    the first token at least; on a hybrid target the rollback restores recurrent state)."""
    target.forward(block)
    target.rollback(CALIBRATION_CONTEXT + 1)


def time_steps(target, drafter, sizes: list[int], rounds: int, steady: int = 0) -> tuple[Samples, Samples]:
    """Seconds of the target's forward of k tokens and of the drafter's step for k-1 rows (k > 1), per k in sizes,
    on a short random context: a warm-up round, then rounds over every size (a burst of load lengthens a few rounds
    of each size, not every timing of one), `rounds` of them and on until `steady` rounds in a row left every fit
    (see fit) within STEADY_CHANGE, within MAX_ROUNDS and CALIBRATION_MAX_S. Both models are reset afterwards."""
    block = drafter.block_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (CALIBRATION_CONTEXT + block,), generator=generator)
    ids = context.to(target.device)
    target.set_feature_layers(drafter.target_layer_ids)
    drafter.reset()
    target.reset()
    features = target.forward(ids[:CALIBRATION_CONTEXT], all_logits=False).features
    tokens = context.tolist()
    drafter.propose(target, features, tokens, CALIBRATION_CONTEXT, block, 1)
    no_features = features[:0]
    target_s: Samples = {k: [] for k in sizes}
    draft_s: Samples = {k: [] for k in sizes if k > 1}
    clock = StepClock(target.device)
    began, fitted, unchanged = time.perf_counter(), [], 0
    for done in range(MAX_ROUNDS + 1):  # round 0 warms up
        if done > rounds and (unchanged >= steady or time.perf_counter() - began > CALIBRATION_MAX_S):
            break
        for k in sizes:
            seconds = timed(clock, partial(_verify_step, target, ids[CALIBRATION_CONTEXT : CALIBRATION_CONTEXT + k]))
            target.rollback(CALIBRATION_CONTEXT)
            if done:
                target_s[k].append(seconds)
            if k > 1:
                step = partial(drafter.propose, target, no_features, tokens, CALIBRATION_CONTEXT, block, k - 1)
                seconds = timed(clock, step)
                if done:
                    draft_s[k].append(seconds)
        if done:
            previous, fitted = fitted, [*fit(target_s).values(), *fit(draft_s).values()]
            steady_now = previous and all(
                old <= new * (1 + STEADY_CHANGE) for old, new in zip(previous, fitted, strict=True)
            )
            unchanged = unchanged + 1 if steady_now else 0
    target.reset()
    drafter.reset()
    return target_s, draft_s


def measure_costs(target, drafter, repeats: int = CALIBRATION_ROUNDS) -> CostTable:
    """The pair's costs on this machine: time_steps over CALIBRATION_SIZES up to the block (`repeats` rounds at least,
    then until steady), fitted (see fit) and interpolated to every size; the sizes between become stale."""
    block = drafter.block_size
    sizes = [k for k in CALIBRATION_SIZES if k < block] + [block]
    target_samples, draft_samples = time_steps(target, drafter, sizes, repeats, STEADY_ROUNDS)
    costs = CostTable(
        interpolate(fit(target_samples), range(1, block + 1)),
        interpolate(fit(draft_samples), range(2, block + 1)),
        target_samples,
        draft_samples,
        time.time(),
    )
    costs.stale = set(costs.target_s) - set(sizes)
    return costs
