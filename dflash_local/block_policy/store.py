"""The policy's cache file: a pair's costs and its drafter's history on this machine, kept between loads, where it
lives (its identity) and whether it can be kept."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..atomic import unwritable_reason, write_text_atomic
from ..drafters.base import Drafter
from ..paths import files_identity, identity_key, state_dir
from ..runtime import LoadSpec, pick_dtype
from ..targets.base import Target
from .acceptance import HISTORY_DECAY, AcceptanceEstimate
from .costs import CostTable


def costs_file(
    target_path: Path, drafter_path: Path | None, target: Target, drafter: Drafter | None, spec: LoadSpec
) -> Path:
    """Where the pair's measured costs per block size are kept (with no drafter, the target's and lookup's): keyed by
    both models' files, the backend and drafter kind, the device and llama.cpp's placement (device, layers there),
    the KV cache's types, dtype and threads (any change there times the sizes afresh)."""
    identity = {
        "target": files_identity(target_path),
        "drafter": None if drafter_path is None else files_identity(drafter_path),
        "backend": type(target).__name__,
        "drafter_kind": "lookup" if drafter is None else type(drafter).__name__,
        "device": spec.runtime.device,
        "placement": None if spec.placement is None else spec.placement.describe(),
        "kv_cache": spec.kv_cache.describe(),
        "dtype": str(pick_dtype(spec.runtime.dtype, spec.runtime.device)),
        "threads": torch.get_num_threads(),
    }
    return state_dir() / "block-costs" / f"{identity_key(identity)}.json"


def unwritable_warning(path: Path) -> str | None:
    """The user's warning where the cache file's folder cannot be written (the sizes are then timed at every load);
    None where it can."""
    reason = unwritable_reason(path.parent)
    if reason is None:
        return None
    return (
        f"warning: {path.parent} is not writable ({reason}): block sizes are timed afresh at every load; "
        "set DFLASH_HOME to a writable folder to keep them."
    )


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
