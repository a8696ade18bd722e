"""The measured costs of each verify size k: the cost table, its fit from timings, its checks and its updates.

Costs come from a calibration that a burst of load cannot skew (each size's fastest timing, a fit that never falls
with k and at most doubles per doubling of k), are checked at each load (consistency, then a few timings;
recalibrated or rescaled where off) and follow the steps decoding times. Sizes not timed since the load, or since
plain steps' cost drifted, are stale: their bounds say what they could cost. docs/block-size.md has the design.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

COST_WEIGHT = 0.2  # weight of one timed step in the running costs
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
