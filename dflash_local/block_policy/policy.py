"""The block size of each step, chosen from measured costs and running acceptance estimates (k = 1: a plain step).

Each step verifies k tokens: the known token plus k-1 drafts. The drafter always drafts its trained block (shorter
blocks change what it proposes) and returns only the k-1 rows the step verifies. Expected tokens for k come from
per-position acceptance rates, each conditional on the positions before it being accepted, as decoding sees them:
E[k] = 1 + sum_{i<k} prod_{j<=i} p_j. The policy picks the k with the most expected tokens per second of measured
cost; when plain steps win it still probes the drafter now and then, at a bounded share of the decode time. A
drafter with no history on this machine is tried with small blocks first, growing as its steps are seen. Stale sizes
that could beat the best are tried within PROBE_SHARE of the time. Each step may instead verify lookup's tokens (the
suffix index's match, see choose_step) where their expected speed, from the match length's acceptance (lookup.py)
and the target's cost, beats the drafter's choice. docs/block-size.md has the design.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..defaults import MIN_BLOCK
from ..drafters.suffix_index import Match
from .acceptance import DECAY, HISTORY_DECAY, AcceptanceEstimate, expected_tokens
from .costs import COST_WEIGHT, CostTable, Samples, inconsistencies
from .lookup import LookupAcceptance, fastest_lookup
from .store import read_policy, write_policy

PRIOR_RATE = 0.8  # acceptance assumed for a drafter with no history: optimistic, so drafting is tried (small k
# first, see BlockPolicy.trial_limit) and measured
PROBE_SHARE = 0.01  # probes may cost at most this share of plain decoding time
MAX_PROBE_INTERVAL = 4096  # plain steps between probes at most
RECHECK = 8  # while plain steps win, the choice is made again every RECHECK steps (and before each probe): the
# evidence moves by a few percent per step, and on a fast model the choice itself costs a few percent of a step


@dataclass
class BlockPolicy:
    """Picks each step's k in 1..block_size from costs and acceptance; learns both from the steps it sees."""

    block_size: int
    costs: CostTable
    history: AcceptanceEstimate
    path: Path | None = None
    drafts: bool = True  # False: no drafter, only lookup and plain steps
    current: AcceptanceEstimate = field(init=False)
    plain_run: int = field(default=0, init=False)
    probes: int = field(default=0, init=False)
    probe_at: int = field(default=0, init=False)  # the plain_run at which the next probe is due
    unsettled_steps: int = field(default=0, init=False)  # plain steps not learnt from yet, and their total time
    unsettled_s: float = field(default=0.0, init=False)
    unsettled_fastest: float = field(default=float("inf"), init=False)
    explore_run: int = field(default=0, init=False)  # drafting choices since the last exploring step
    lookup: LookupAcceptance = field(init=False)  # lookup's acceptance per matched length, kept across generations
    lookup_s: float = field(default=0.0, init=False)  # a lookup step's drafting time (the index, the choice), running
    lookup_scale: float = field(default=1.0, init=False)  # lookup steps' verify time over the table's cost, running

    def __post_init__(self) -> None:
        self.lookup = LookupAcceptance(self.block_size - 1)
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
        if top < MIN_BLOCK:
            return 1
        if self.plain_run % RECHECK and self.plain_run + 1 < self.probe_at:
            self.plain_run += 1
            return 1
        self.settle()
        tokens, speeds = self.speeds(top)
        best_draft = max(range(MIN_BLOCK, top + 1), key=speeds.__getitem__)
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

    def choose_step(self, limit: int, match: Match | None) -> tuple[str, int]:
        """The next step's source and verify size, at most `limit`: "lookup" (the match's tokens) where its expected
        speed (see fastest_lookup) beats the drafter's choice (see choose), else "dflash" (the drafter's block) or
        "plain" (k = 1)."""
        if self.drafts:
            k = self.choose(limit)
        else:
            self.settle()
            k = 1
        top = min(self.block_size, limit, len(match.tokens) + 1) if match is not None else 1
        if top >= MIN_BLOCK:
            rates = self.lookup.rates(match.length)
            length, speed = fastest_lookup(rates, self.costs, top, self.lookup_s, self.lookup_scale)
            if speed > self.speed(k):
                return "lookup", length
        return ("dflash" if k > 1 else "plain"), k

    def speed(self, k: int) -> float:
        """Expected tokens per second of a step of k by the drafter (k = 1: a plain step)."""
        if k == 1:
            return 1 / self.costs.step_s(1)
        return expected_tokens(self.rates(), k)[k] / self.costs.step_s(k)

    def speeds(self, top: int) -> tuple[list[float], list[float]]:
        """Expected tokens and tokens per second of the costs for each k = 0..top (index k)."""
        tokens = expected_tokens(self.rates(), top)
        return tokens, [0.0] + [tokens[k] / self.costs.step_s(k) for k in range(1, top + 1)]

    def checked_sizes(self) -> list[int]:
        """The sizes a load times to check the costs: decode-1, the drafting size a choice from them rests on (the
        fastest by them), and the block."""
        speeds = self.speeds(self.block_size)[1]
        best = max(range(MIN_BLOCK, self.block_size + 1), key=speeds.__getitem__)
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
        """The largest k worth risking on what the drafter has shown so far: MIN_BLOCK for a drafter with no history,
        doubling with each drafting step it has seen (a random drafter's first steps stay cheap)."""
        return MIN_BLOCK << min(int(self.history.reached[0]), 16)

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

    def observe_lookup(self, length: int, k: int, accepted: int, draft_s: float, target_s: float) -> None:
        """Learn from one lookup step: the matched length, its verify size, the drafts accepted, and its costs: its
        drafting time, and its verify time over the table's cost of k (the calibration's shape over k can be off for
        real contexts, and the table keeps it; one stall moves the scale little, as the table's levels)."""
        self.settle()
        self.lookup.observe(length, k - 1, accepted)
        self.lookup_s += COST_WEIGHT * (draft_s - self.lookup_s)
        ratio = min(max(target_s / self.costs.target_s[k], 0.5 * self.lookup_scale), 2.0 * self.lookup_scale)
        self.lookup_scale += COST_WEIGHT * (ratio - self.lookup_scale)

    def settle(self) -> None:
        """Learn from the plain steps seen since the last time: their mean cost, and the fading of this text's
        evidence."""
        if self.unsettled_steps:
            mean = self.unsettled_s / self.unsettled_steps
            self.costs.observe(1, 0.0, mean, self.unsettled_steps, self.unsettled_fastest)
            self.current.fade(self.unsettled_steps)
            self.unsettled_steps, self.unsettled_s, self.unsettled_fastest = 0, 0.0, float("inf")

    def save(self) -> None:
        """Keep the costs and the drafter's history for the next load of the same pair on this machine (see
        store.write_policy)."""
        if self.path is None:
            return
        self.settle()
        write_policy(self.path, self.block_size, self.costs, self.history)


def load_policy(
    path: Path,
    block_size: int,
    calibrate: Callable[[], CostTable],
    check: Callable[[list[int]], tuple[Samples, Samples]] | None = None,
    drafts: bool = True,
) -> BlockPolicy:
    """The policy saved at path for this pair and machine, its costs checked: consistent in themselves (see
    inconsistencies) and, given `check` (timings of the sizes it is passed, taken now), with this machine now (see
    CostTable.verify, at checked_sizes()). Otherwise one calibrated afresh now; the drafter's history is
    kept either way. drafts: False where no drafter drafts (lookup and plain steps only)."""
    history, reason = AcceptanceEstimate.empty(block_size - 1, HISTORY_DECAY), ""
    try:
        cached = read_policy(path, block_size)
        if cached is not None:
            costs, history = cached
            problems = inconsistencies(costs)
            costs.stale = set(costs.target_s) - {1}
            policy = BlockPolicy(block_size, costs, history, path, drafts)
            if not problems and (check is None or costs.verify(*check(policy.checked_sizes()))):
                return policy
            reason = f"calibrated afresh at load: {problems[0] if problems else costs.check}"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    policy = BlockPolicy(block_size, calibrate(), history, path, drafts)
    policy.costs.check = reason
    policy.save()
    return policy
