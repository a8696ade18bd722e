"""The policy's cache file: a pair's costs and its drafter's history on this machine, kept between loads."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..atomic import write_text_atomic
from .acceptance import HISTORY_DECAY, AcceptanceEstimate
from .costs import CostTable


def read_policy(path: Path, block_size: int) -> tuple[CostTable, AcceptanceEstimate] | None:
    """The costs and history saved at path for this block size; None where they are for another block size or have
    the wrong sizes. A missing or malformed file raises (OSError, ValueError, KeyError or TypeError)."""
    data = json.loads(path.read_text())
    if data["block_size"] != block_size:
        return None
    history = AcceptanceEstimate(data["history"]["reached"], data["history"]["accepted"], HISTORY_DECAY)
    costs = CostTable.from_dict(data["costs"])
    if len(history.reached) != block_size - 1 or set(costs.target_s) != set(range(1, block_size + 1)):
        return None
    return costs, history


def write_policy(path: Path, block_size: int, costs: CostTable, history: AcceptanceEstimate) -> None:
    """Save the costs and history atomically (skipped where the folder cannot be written: the cache only saves a
    calibration)."""
    data = {
        "block_size": block_size,
        "costs": costs.to_dict(),
        "history": {"reached": history.reached, "accepted": history.accepted},
    }
    with contextlib.suppress(OSError):
        write_text_atomic(path, json.dumps(data))
