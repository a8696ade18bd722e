"""--block-size auto: each step's block size from measured costs and running acceptance estimates, by job: costs
(the cost table and its fit), acceptance (the estimates), policy (the choice per step, loading a saved one), store
(the cache file), calibration (the timer, the calibration). docs/block-size.md has the design."""

from .acceptance import HISTORY_DECAY, AcceptanceEstimate, expected_tokens
from .calibration import CHECK_ROUNDS, measure_costs, median_ms, time_steps
from .costs import CostTable, Samples, inconsistencies
from .policy import BlockPolicy, load_policy

__all__ = [
    "CHECK_ROUNDS",
    "HISTORY_DECAY",
    "AcceptanceEstimate",
    "BlockPolicy",
    "CostTable",
    "Samples",
    "expected_tokens",
    "inconsistencies",
    "load_policy",
    "measure_costs",
    "median_ms",
    "time_steps",
]
