"""The block size of each step, chosen from measured costs and running acceptance estimates (k = 1: a plain step).

Each step verifies k tokens: the known token plus k-1 drafts. The drafter always drafts its trained block (shorter
blocks change what it proposes) and returns only the k-1 rows the step verifies. Expected tokens for k come from
per-position acceptance rates, each conditional on the positions before it being accepted, as decoding sees them:
E[k] = 1 + sum_{i<k} prod_{j<=i} p_j. The policy picks the k with the most expected tokens per second of measured
cost; when plain steps win it still probes the drafter now and then, at a bounded share of the decode time. A
drafter with no history on this machine is tried with small blocks first, growing as its steps are seen.

Costs come from a calibration that a burst of load cannot skew (interleaved rounds, each size's fastest timing, a
fit that never falls with k and at most doubles per doubling of k), are cached per pair and machine, and are checked
at each load (consistency, then a few timings; recalibrated or rescaled where off). Sizes not timed since the load,
or since plain steps' cost drifted, are stale: probes and explorations try those that could beat the best, within
PROBE_SHARE of the time, and a stale size's timing lowers its estimate where lower. docs/block-size.md has the design.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .atomic import write_text_atomic
from .runtime import StepClock

PRIOR_RATE = 0.8  # acceptance assumed for a drafter with no history: optimistic, so drafting is tried (small k
# first, see BlockPolicy.trial_limit) and measured
PRIOR_WEIGHT = 2.0  # pseudo-observations the prior (the drafter's history) is worth per position
DECAY = 0.95  # per-step forgetting of this text's evidence (plain steps too): back toward the history when not drafting
HISTORY_DECAY = 0.999  # per-step forgetting of the drafter's history across generations
COST_WEIGHT = 0.2  # weight of one timed step in the running costs
PROBE_SHARE = 0.01  # probes may cost at most this share of plain decoding time
MAX_PROBE_INTERVAL = 4096  # plain steps between probes at most
RECHECK = 8  # while plain steps win, the choice is made again every RECHECK steps (and before each probe): the
# evidence moves by a few percent per step, and on a fast model the choice itself costs a few percent of a step
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CALIBRATION_CONTEXT = 64
CALIBRATION_ROUNDS = 5  # a calibration times every size in at least this many rounds, interleaved ...
STEADY_ROUNDS = 3  # ... and on until this many rounds in a row improved no fit by more than STEADY_CHANGE ...
STEADY_CHANGE = 0.02
MAX_ROUNDS = 40  # ... but for at most this many rounds, or past CALIBRATION_MAX_S once CALIBRATION_ROUNDS are done
CALIBRATION_MAX_S = 30.0
CHECK_ROUNDS = 3  # a cached table is checked at load by this many rounds of decode-1 and verify-block
SHAPE_TOLERANCE = 1.5  # the check's verify-block / decode-1 off the table's by more than this: calibrate afresh
LEVEL_TOLERANCE = 1.5  # its costs off the table's by more than this (same shape): rescale the table
DRIFT = 1.5  # plain steps' cost moved by more than this since the table was confirmed: its other sizes go stale
FASTEST_RISE = 0.01  # per timing of a size, how far its recent fastest timing rises toward slower ones
SLACK = 1.5  # consistency: a cost may fall with k to 1/SLACK, and a batch cost up to SLACK x the batches it splits into

Samples = dict[int, list[float]]  # seconds of each timing per verify size k


@dataclass
class CostTable:
    """Seconds per step by verify size k: the target's forward of k tokens, and the drafter's step for k-1 rows.

    Sizes in `stale` have not been timed since this load, or since plain steps' fastest timing drifted: probes explore
    them."""

    target_s: dict[int, float]
    draft_s: dict[int, float]
    target_samples: Samples = field(default_factory=dict)  # the calibration's timings, per measured size
    draft_samples: Samples = field(default_factory=dict)
    measured_at: float = 0.0  # when it was calibrated (unix time; 0: unknown)
    checked_at: float = 0.0  # when a load last checked it, and what that check found
    check: str = ""
    stale: set[int] = field(default_factory=set)
    anchor_s: float = field(default=0.0, init=False)  # plain steps' (fastest) cost when the table was last confirmed
    fastest: dict[int, float] = field(default_factory=dict, init=False)  # each size's recent fastest timing

    def __post_init__(self) -> None:
        self.anchor_s = self.target_s[1]

    def step_s(self, k: int) -> float:
        return self.target_s[k] + (self.draft_s[k] if k > 1 else 0.0)

    def observe(self, k: int, draft_s: float, target_s: float, steps: int = 1, fastest: float | None = None) -> None:
        """Move the costs toward `steps` timed steps of size k (their mean times): each part's level follows, its
        calibrated shape over k stays (a slower context or a busy machine slows every k alike); one stall moves
        little (clamped, averaged). A stale size's target cost is refreshed first (see refresh); plain steps whose
        recent fastest timing drifted by more than DRIFT (a stall moves a mean, not that) make every other size stale.
        `fastest`: the fastest of the steps (default: their mean)."""
        rising = self.fastest.get(k, float("inf")) * (1 + FASTEST_RISE) ** steps
        self.fastest[k] = min(rising, target_s if fastest is None else fastest)
        if k in self.stale:
            self.refresh(k, target_s)
        _rescale(self.target_s, _blend(self.target_s[k], target_s, steps) / self.target_s[k])
        if k > 1:
            _rescale(self.draft_s, _blend(self.draft_s[k], draft_s, steps) / self.draft_s[k])
        elif not 1 / DRIFT <= self.fastest[1] / self.anchor_s <= DRIFT:
            self.stale = set(self.target_s) - {1}
            self.anchor_s = self.fastest[1]

    def refresh(self, k: int, target_s: float) -> None:
        """A stale size timed: its target cost becomes that timing on the scale of the costs (times the cost over the
        recent fastest timing of the nearest fresh size timed lately: the running costs follow the mean of timings,
        stalls included, a single timing mostly misses them), where that is lower (a stall only lengthens a timing,
        and the levels follow slower steps), at least a smaller fresh size's; smaller stale sizes come down with it,
        so that cost never falls with k. It is fresh again."""
        fresh = [j for j in self.fastest if j != k and j not in self.stale]
        ref = min(fresh, key=lambda j: abs(j - k), default=None)
        scaled = target_s if ref is None else target_s * self.target_s[ref] / self.fastest[ref]
        low = max(self.target_s[j] for j in self.target_s if j < k and j not in self.stale)
        self.target_s[k] = cost = min(self.target_s[k], max(scaled, low))
        self.stale.discard(k)
        for j in self.stale:
            if j < k:
                self.target_s[j] = min(self.target_s[j], cost)

    def bounds(self, k: int) -> tuple[float, float] | None:
        """The least and most a stale size's target cost can be, from the fresh sizes: no less than the largest
        smaller one, no more than the smallest larger one or twice one at least half its size; None where nothing
        bounds it from above."""
        fresh = [j for j in self.target_s if j not in self.stale]
        below = max(j for j in fresh if j < k)
        caps = [self.target_s[j] for j in fresh if j > k] + ([2 * self.target_s[below]] if 2 * below >= k else [])
        return (self.target_s[below], min(caps)) if caps else None

    def worst_s(self, k: int) -> float:
        """The most a step of k can cost: a stale size's target cost capped by its bounds."""
        bounds = self.bounds(k) if k in self.stale else None
        target = self.target_s[k] if bounds is None else min(self.target_s[k], bounds[1])
        return target + (self.draft_s[k] if k > 1 else 0.0)

    def verify(self, target_samples: Samples, draft_samples: Samples) -> bool:
        """Compare a load's few timings (decode-1 and some verify sizes k, the drafter's step at each) with the table:
        False where a verify-k / decode-1 is off by more than SHAPE_TOLERANCE (calibrate afresh); where only a part's
        level is off by more than LEVEL_TOLERANCE, that part is rescaled. The sizes not timed become stale."""
        timed = {k: min(v) for k, v in target_samples.items()}
        drafted = {k: min(v) for k, v in draft_samples.items()}
        self.checked_at = time.time()
        for k in sorted(timed)[1:]:
            shape = (timed[k] / timed[1]) / (self.target_s[k] / self.target_s[1])
            if not 1 / SHAPE_TOLERANCE <= shape <= SHAPE_TOLERANCE:
                was, now = self.target_s[k] / self.target_s[1], timed[k] / timed[1]
                self.check = f"verify-{k} / decode-1 was {was:.2f}, timed {now:.2f}"
                return False
        factors = (_geometric_mean(timed, self.target_s), _geometric_mean(drafted, self.draft_s))
        self.check = "kept"
        if any(not 1 / LEVEL_TOLERANCE <= f <= LEVEL_TOLERANCE for f in factors):
            _rescale(self.target_s, factors[0])
            _rescale(self.draft_s, factors[1])
            self.check = f"rescaled: target x{factors[0]:.2f}, drafter x{factors[1]:.2f}"
        self.stale = set(self.target_s) - set(timed)
        self.anchor_s = self.target_s[1]
        return True

    def to_dict(self) -> dict:
        return {
            "target_s": self.target_s,
            "draft_s": self.draft_s,
            "target_samples": self.target_samples,
            "draft_samples": self.draft_samples,
            "measured_at": self.measured_at,
            "checked_at": self.checked_at,
            "check": self.check,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        def sizes(values: dict) -> dict:
            return {int(k): v for k, v in values.items()}

        return cls(
            {int(k): float(v) for k, v in data["target_s"].items()},
            {int(k): float(v) for k, v in data["draft_s"].items()},
            sizes(data.get("target_samples", {})),
            sizes(data.get("draft_samples", {})),
            float(data.get("measured_at", 0.0)),
            float(data.get("checked_at", 0.0)),
            str(data.get("check", "")),
        )


def inconsistencies(costs: CostTable) -> list[str]:
    """What no machine measures, found in a table: a cost that falls with k (to under 1/SLACK), or a forward of k
    tokens dearer than SLACK x the ceil(k / j) forwards of j tokens it splits into."""
    found = []
    for name, table in (("the target's forward", costs.target_s), ("the drafter's step", costs.draft_s)):
        pairs = [(j, k) for k in sorted(table) for j in sorted(table) if j < k]
        bad = [(j, k) for j, k in pairs if not table[j] / SLACK <= table[k] <= SLACK * -(-k // j) * table[j]]
        if min(table.values()) <= 0:
            found.append(f"{name} has a cost of {min(table.values())} s")
        elif bad:
            j, k = bad[0]
            found.append(f"{name} of k = {k} costs {table[k] / table[j]:.2f}x its cost at k = {j}")
    return found


def _geometric_mean(timed: dict[int, float], costs: dict[int, float]) -> float:
    """The geometric mean over the timed sizes of timing over cost."""
    return math.prod(timed[k] / costs[k] for k in timed) ** (1 / len(timed))


def _rescale(costs: dict[int, float], factor: float) -> None:
    for k in costs:
        costs[k] *= factor


def _blend(old: float, new: float, steps: int) -> float:
    new = min(max(new, 0.5 * old), 2.0 * old)
    weight = 1 - (1 - COST_WEIGHT) ** steps
    return (1 - weight) * old + weight * new


def interpolate(measured: dict[int, float], sizes: range) -> dict[int, float]:
    """Linear interpolation (and flat extrapolation) of costs measured at some sizes to every size."""
    known = sorted(measured)
    table = {}
    for k in sizes:
        below = max((m for m in known if m <= k), default=known[0])
        above = min((m for m in known if m >= k), default=known[-1])
        if below == above:
            table[k] = measured[below]
        else:
            share = (k - below) / (above - below)
            table[k] = measured[below] + share * (measured[above] - measured[below])
    return table


def fit(samples: Samples) -> dict[int, float]:
    """Costs per measured size with the shape of the hardware, from timings that a busy machine only lengthens: the
    fastest timing of each size, then the largest non-decreasing fit below them (a size costs no more than any
    larger one), capped at twice the cost of a size at least half as large (a batch splits into two)."""
    costs, cheapest = {}, float("inf")
    for k in sorted(samples, reverse=True):
        cheapest = min(cheapest, *samples[k])
        costs[k] = cheapest
    for k in sorted(costs):
        costs[k] = min([costs[k]] + [2 * costs[j] for j in costs if k / 2 <= j < k])
    return dict(sorted(costs.items()))


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


@dataclass
class BlockPolicy:
    """Picks each step's k in 1..block_size from costs and acceptance; learns both from the steps it sees."""

    block_size: int
    costs: CostTable
    history: AcceptanceEstimate
    path: Path | None = None
    current: AcceptanceEstimate = field(init=False)
    plain_run: int = field(default=0, init=False)
    probes: int = field(default=0, init=False)
    probe_at: int = field(default=0, init=False)  # the plain_run at which the next probe is due
    unsettled_steps: int = field(default=0, init=False)  # plain steps not learnt from yet, and their total time
    unsettled_s: float = field(default=0.0, init=False)
    unsettled_fastest: float = field(default=float("inf"), init=False)
    explore_run: int = field(default=0, init=False)  # drafting choices since the last exploring step

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new generation: fresh estimates for this text, with the drafter's history as their prior."""
        self.current = AcceptanceEstimate.empty(self.block_size - 1, DECAY)
        self.plain_run = 0
        self.probes = 0
        self.probe_at = 0
        self.unsettled_steps, self.unsettled_s, self.unsettled_fastest = 0, 0.0, float("inf")
        self.explore_run = 0

    def rates(self) -> list[float]:
        prior = self.history.rates([PRIOR_RATE] * (self.block_size - 1))
        return self.current.rates(prior)

    def choose(self, limit: int) -> int:
        """The verify size for the next step, at most `limit` (tokens left); 1 means a plain step, no drafter.

        Whether to draft is decided over every k; a drafter with little history then runs it at trial_limit() at most.
        Within a run of plain steps the choice stands for RECHECK steps, or until the next probe is due. A stale size
        that could beat the best (see explore_size) is tried instead of the best within PROBE_SHARE of the time: as
        the probe of a plain run, or while drafting every explore_interval() choices.
        """
        top = min(self.block_size, limit)
        if top < 2:
            return 1
        if self.plain_run % RECHECK and self.plain_run + 1 < self.probe_at:
            self.plain_run += 1
            return 1
        self.settle()
        tokens, speeds = self.speeds(top)
        best_draft = max(range(2, top + 1), key=speeds.__getitem__)
        best = best_draft if speeds[best_draft] > speeds[1] else 1
        explore = self.explore_size(tokens, speeds[best], top)
        if best > 1:
            self.plain_run = 0
            self.explore_run += explore is not None
            if explore is None or self.explore_run < self.explore_interval(explore, best, tokens):
                return min(best_draft, self.trial_limit())
            self.explore_run = 0
            return explore
        probe = best_draft if explore is None else explore
        self.plain_run += 1
        self.probe_at = self.probe_interval(probe)
        if self.plain_run >= self.probe_at:
            self.plain_run = 0
            self.probes += 1
            return min(probe, self.trial_limit())
        return 1

    def speeds(self, top: int) -> tuple[list[float], list[float]]:
        """Expected tokens and tokens per second of the costs for each k = 0..top (index k)."""
        tokens = expected_tokens(self.rates(), top)
        return tokens, [0.0] + [tokens[k] / self.costs.step_s(k) for k in range(1, top + 1)]

    def checked_sizes(self) -> list[int]:
        """The sizes a load times to check the costs: decode-1, the drafting size a choice from them rests on (the
        fastest by them), and the block."""
        speeds = self.speeds(self.block_size)[1]
        best = max(range(2, self.block_size + 1), key=speeds.__getitem__)
        return sorted({1, best, self.block_size})

    def explore_size(self, tokens: list[float], best_speed: float, top: int) -> int | None:
        """The stale size (at most top and trial_limit()) that could beat best_speed by the least it can cost (see
        CostTable.bounds), the most by that; None where none could."""
        limit = min(top, self.trial_limit())
        could = {}
        for k in self.costs.stale:
            bounds = self.costs.bounds(k) if k <= limit else None
            if bounds is not None:
                could[k] = tokens[k] / (bounds[0] + self.costs.draft_s[k])
        explore = max(could, key=could.__getitem__, default=None)
        return explore if explore is not None and could[explore] > best_speed else None

    def explore_interval(self, k: int, best: int, tokens: list[float]) -> int:
        """Drafting choices between tries of a stale size k instead of the best: the try's extra cost at most (its
        most over the time its tokens take at the best's speed) stays under PROBE_SHARE of the best's steps."""
        best_s = self.costs.step_s(best)
        extra = max(self.costs.worst_s(k) - tokens[k] * best_s / tokens[best], 0.0)
        return max(1, round(extra / (PROBE_SHARE * best_s)))

    def trial_limit(self) -> int:
        """The largest k worth risking on what the drafter has shown so far: 2 for a drafter with no history,
        doubling with each drafting step it has seen (a random drafter's first steps stay cheap)."""
        return 2 << min(int(self.history.reached[0]), 16)

    def probe_interval(self, k: int) -> int:
        """Plain steps between probes at k: the probe's extra cost stays under PROBE_SHARE, doubling per probe."""
        extra = max(self.costs.worst_s(k) - self.costs.step_s(1), 0.0)
        steps = extra / (PROBE_SHARE * self.costs.step_s(1))
        return min(max(1, round(steps)) << min(self.probes, 12), MAX_PROBE_INTERVAL)

    def observe(self, k: int, accepted: int, draft_s: float, target_s: float) -> None:
        """Learn from one step: its verify size, how many drafts it accepted, and what it cost (plain steps are
        learnt from in bulk, at the next choice that is made afresh)."""
        if k == 1:
            self.unsettled_steps += 1
            self.unsettled_s += target_s
            self.unsettled_fastest = min(self.unsettled_fastest, target_s)
            return
        self.settle()
        self.costs.observe(k, draft_s, target_s)
        self.current.observe(k - 1, accepted)
        self.history.observe(k - 1, accepted)

    def settle(self) -> None:
        """Learn from the plain steps seen since the last time: their mean cost, and the fading of this text's
        evidence."""
        if self.unsettled_steps:
            mean = self.unsettled_s / self.unsettled_steps
            self.costs.observe(1, 0.0, mean, self.unsettled_steps, self.unsettled_fastest)
            self.current.fade(self.unsettled_steps)
            self.unsettled_steps, self.unsettled_s, self.unsettled_fastest = 0, 0.0, float("inf")

    def save(self) -> None:
        """Keep the costs and the drafter's history for the next load of the same pair on this machine (skipped
        where the folder cannot be written: the cache only saves a calibration)."""
        if self.path is None:
            return
        self.settle()
        data = {
            "block_size": self.block_size,
            "costs": self.costs.to_dict(),
            "history": {"reached": self.history.reached, "accepted": self.history.accepted},
        }
        with contextlib.suppress(OSError):
            write_text_atomic(self.path, json.dumps(data))


def load_policy(
    path: Path,
    block_size: int,
    calibrate: Callable[[], CostTable],
    check: Callable[[list[int]], tuple[Samples, Samples]] | None = None,
) -> BlockPolicy:
    """The policy saved at path for this pair and machine, its costs checked: consistent in themselves (see
    inconsistencies) and, given `check` (timings of the sizes it is passed, taken now), with this machine now (see
    CostTable.verify, at checked_sizes()). Otherwise one calibrated afresh now; the drafter's history is
    kept either way."""
    history, reason = AcceptanceEstimate.empty(block_size - 1, HISTORY_DECAY), ""
    try:
        data = json.loads(path.read_text())
        if data["block_size"] == block_size:
            cached = AcceptanceEstimate(data["history"]["reached"], data["history"]["accepted"], HISTORY_DECAY)
            costs = CostTable.from_dict(data["costs"])
            if len(cached.reached) == block_size - 1 and set(costs.target_s) == set(range(1, block_size + 1)):
                history, problems = cached, inconsistencies(costs)
                costs.stale = set(costs.target_s) - {1}
                policy = BlockPolicy(block_size, costs, history, path)
                if not problems and (check is None or costs.verify(*check(policy.checked_sizes()))):
                    return policy
                reason = f"calibrated afresh at load: {problems[0] if problems else costs.check}"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    policy = BlockPolicy(block_size, calibrate(), history, path)
    policy.costs.check = reason
    policy.save()
    return policy


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
    timer = StepClock(target.device)
    began, fitted, unchanged = time.perf_counter(), [], 0
    for done in range(MAX_ROUNDS + 1):  # round 0 warms up
        if done > rounds and (unchanged >= steady or time.perf_counter() - began > CALIBRATION_MAX_S):
            break
        for k in sizes:
            start = timer.mark()
            target.forward(ids[CALIBRATION_CONTEXT : CALIBRATION_CONTEXT + k])
            target.rollback(CALIBRATION_CONTEXT + 1)  # a step keeps its first token at least: a rollback is timed
            seconds = timer.seconds(start, timer.mark())
            target.rollback(CALIBRATION_CONTEXT)
            if done:
                target_s[k].append(seconds)
            if k > 1:
                start = timer.mark()
                drafter.propose(target, no_features, tokens, CALIBRATION_CONTEXT, block, k - 1)
                seconds = timer.seconds(start, timer.mark())
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
