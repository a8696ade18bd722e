"""The block size of each step, chosen from measured costs and running acceptance estimates (k = 1: a plain step).

Each step verifies k tokens: the known token plus k-1 drafts. The drafter always drafts its trained block (shorter
blocks change what it proposes) and returns only the k-1 rows the step verifies. Expected tokens for k come from
per-position acceptance rates, each conditional on the positions before it being accepted, as decoding sees them:
E[k] = 1 + sum_{i<k} prod_{j<=i} p_j. The policy picks the k with the most expected tokens per second of measured
cost; when plain steps win it still probes the drafter now and then, at a bounded share of the decode time, and while
drafting is far from paying the target skips its features for the drafter until shortly before the next probe. A
drafter with no history on this machine is tried with small blocks first, growing as its steps are seen.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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
FEATURE_LEAD = 16  # plain steps before a probe that read the target's features again (the rest of a plain run skips
# them: the drafter drafts without that context, and a GGUF target's decode costs a few percent less)
SKIP_SHARE = 0.75  # ... but only while the best drafting k is estimated at under this share of plain steps' speed:
# where drafting is close to paying (the bundled torch pair's plain runs: 0.86-0.99; its GGUFs': 0.34-0.64) it soon
# resumes, and drafting across a gap accepts less than the reads cost
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CALIBRATION_CONTEXT = 64


@dataclass
class CostTable:
    """Seconds per step by verify size k: the target's forward of k tokens, and the drafter's step for k-1 rows."""

    target_s: dict[int, float]
    draft_s: dict[int, float]

    def step_s(self, k: int) -> float:
        return self.target_s[k] + (self.draft_s[k] if k > 1 else 0.0)

    def observe(self, k: int, draft_s: float, target_s: float, steps: int = 1) -> None:
        """Move the costs toward `steps` timed steps of size k (their mean times): each part's level follows, its
        calibrated shape over k stays (a slower context or a busy machine slows every k alike); one stall moves
        little (clamped, averaged)."""
        _rescale(self.target_s, _blend(self.target_s[k], target_s, steps) / self.target_s[k])
        if k > 1:
            _rescale(self.draft_s, _blend(self.draft_s[k], draft_s, steps) / self.draft_s[k])

    def to_dict(self) -> dict:
        return {"target_s": self.target_s, "draft_s": self.draft_s}

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        return cls(
            {int(k): float(v) for k, v in data["target_s"].items()},
            {int(k): float(v) for k, v in data["draft_s"].items()},
        )


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
    draft_share: float = field(default=1.0, init=False)  # the best drafting k's estimated speed over plain steps'
    unsettled_steps: int = field(default=0, init=False)  # plain steps not learnt from yet, and their total time
    unsettled_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new generation: fresh estimates for this text, with the drafter's history as their prior."""
        self.current = AcceptanceEstimate.empty(self.block_size - 1, DECAY)
        self.plain_run = 0
        self.probes = 0
        self.probe_at = 0
        self.draft_share = 1.0
        self.unsettled_steps, self.unsettled_s = 0, 0.0

    def rates(self) -> list[float]:
        prior = self.history.rates([PRIOR_RATE] * (self.block_size - 1))
        return self.current.rates(prior)

    def choose(self, limit: int) -> int:
        """The verify size for the next step, at most `limit` (tokens left); 1 means a plain step, no drafter.

        Whether to draft is decided over every k; a drafter with little history then runs it at trial_limit() at most.
        Within a run of plain steps the choice stands for RECHECK steps, or until the next probe is due.
        """
        top = min(self.block_size, limit)
        if top < 2:
            return 1
        if self.plain_run % RECHECK and self.plain_run + 1 < self.probe_at:
            self.plain_run += 1
            return 1
        self.settle()
        tokens = expected_tokens(self.rates(), top)
        speeds = [0.0] + [tokens[k] / self.costs.step_s(k) for k in range(1, top + 1)]
        best_draft = max(range(2, top + 1), key=speeds.__getitem__)
        if speeds[best_draft] > speeds[1]:
            self.plain_run = 0
            return min(best_draft, self.trial_limit())
        self.plain_run += 1
        self.probe_at = self.probe_interval(best_draft)
        self.draft_share = speeds[best_draft] / speeds[1]
        if self.plain_run >= self.probe_at:
            self.plain_run = 0
            self.probes += 1
            return min(best_draft, self.trial_limit())
        return 1

    def reads_features(self) -> bool:
        """Whether the step just chosen needs the target's features: every drafting step and its context does; a plain
        step skips them only deep in a run of plain steps (the next probe more than FEATURE_LEAD steps away) while
        drafting is far from paying (under SKIP_SHARE of plain steps' speed)."""
        far = self.plain_run + FEATURE_LEAD < self.probe_at and self.draft_share < SKIP_SHARE
        return self.plain_run == 0 or not far

    def trial_limit(self) -> int:
        """The largest k worth risking on what the drafter has shown so far: 2 for a drafter with no history,
        doubling with each drafting step it has seen (a random drafter's first steps stay cheap)."""
        return 2 << min(int(self.history.reached[0]), 16)

    def probe_interval(self, k: int) -> int:
        """Plain steps between probes at k: the probe's extra cost stays under PROBE_SHARE, doubling per probe."""
        extra = max(self.costs.step_s(k) - self.costs.step_s(1), 0.0)
        steps = extra / (PROBE_SHARE * self.costs.step_s(1))
        return min(max(1, round(steps)) << min(self.probes, 12), MAX_PROBE_INTERVAL)

    def observe(self, k: int, accepted: int, draft_s: float, target_s: float) -> None:
        """Learn from one step: its verify size, how many drafts it accepted, and what it cost (plain steps are
        learnt from in bulk, at the next choice that is made afresh)."""
        if k == 1:
            self.unsettled_steps += 1
            self.unsettled_s += target_s
            return
        self.settle()
        self.costs.observe(k, draft_s, target_s)
        self.current.observe(k - 1, accepted)
        self.history.observe(k - 1, accepted)

    def settle(self) -> None:
        """Learn from the plain steps seen since the last time: their mean cost, and the fading of this text's
        evidence."""
        if self.unsettled_steps:
            self.costs.observe(1, 0.0, self.unsettled_s / self.unsettled_steps, self.unsettled_steps)
            self.current.fade(self.unsettled_steps)
            self.unsettled_steps, self.unsettled_s = 0, 0.0

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


def cost_key(parts: dict) -> str:
    """A file name for one (model pair, backend, device, threads) combination."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load_policy(path: Path, block_size: int, calibrate: Callable[[], CostTable]) -> BlockPolicy:
    """The policy saved at path for this pair and machine, or a fresh one from a calibration run now."""
    try:
        data = json.loads(path.read_text())
        if data["block_size"] == block_size:
            history = AcceptanceEstimate(data["history"]["reached"], data["history"]["accepted"], HISTORY_DECAY)
            costs = CostTable.from_dict(data["costs"])
            if len(history.reached) == block_size - 1 and set(costs.target_s) == set(range(1, block_size + 1)):
                return BlockPolicy(block_size, costs, history, path)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    policy = BlockPolicy(block_size, calibrate(), AcceptanceEstimate.empty(block_size - 1, HISTORY_DECAY), path)
    policy.save()
    return policy


def measure_costs(target, drafter, repeats: int = 2) -> CostTable:
    """Time the target's forward of k tokens and the drafter's step for k-1 rows on a short random context.

    Sizes between the measured ones are interpolated; both models are reset afterwards.
    """
    block = drafter.block_size
    sizes = [k for k in CALIBRATION_SIZES if k < block] + [block]
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
    target_s: dict[int, float] = {}
    draft_s: dict[int, float] = {}
    timer = StepClock(target.device)
    for k in sizes:
        timings_t, timings_d = [], []
        for _ in range(repeats + 1):  # the first run warms up
            began = timer.mark()
            target.forward(ids[CALIBRATION_CONTEXT : CALIBRATION_CONTEXT + k])
            timings_t.append(timer.seconds(began, timer.mark()))
            target.rollback(CALIBRATION_CONTEXT)
            if k > 1:
                began = timer.mark()
                drafter.propose(target, no_features, tokens, CALIBRATION_CONTEXT, block, k - 1)
                timings_d.append(timer.seconds(began, timer.mark()))
        target_s[k] = min(timings_t[1:])
        if k > 1:
            draft_s[k] = min(timings_d[1:])
    target.reset()
    drafter.reset()
    every = range(1, block + 1)
    return CostTable(interpolate(target_s, every), interpolate(draft_s, range(2, block + 1)))
