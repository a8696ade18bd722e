"""--block-size auto: each step's block size from measured costs and running acceptance estimates, by job: costs
(the cost table and its fit), acceptance (the estimates), policy (the choice per step, loading a saved one), store
(the cache file: where it lives, whether it can be kept), calibration (the timer, the calibration).
docs/block-size.md has the design."""

from .acceptance import HISTORY_DECAY, AcceptanceEstimate, expected_tokens
from .calibration import CHECK_ROUNDS, measure_costs, median_ms, time_steps
from .costs import CostTable, Samples, inconsistencies
from .policy import BlockPolicy, load_policy
from .store import costs_file, unwritable_warning

__all__ = [
    "CHECK_ROUNDS",
    "HISTORY_DECAY",
    "AcceptanceEstimate",
    "BlockPolicy",
    "CostTable",
    "Samples",
    "costs_file",
    "expected_tokens",
    "inconsistencies",
    "load_policy",
    "measure_costs",
    "median_ms",
    "time_steps",
    "unwritable_warning",
]
