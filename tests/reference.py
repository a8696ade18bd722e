"""Runs the reference `dflash` package (a dev-only oracle) on folders saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch


def reference_generate(
    target_folder: Path,
    drafter_folder: Path,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int,
    stop_ids: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """New token ids and acceptance lengths from dflash.model.dflash_generate at temperature 0."""
    import time

    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    dflash.model._cuda_time = time.perf_counter  # the reference synchronizes CUDA unconditionally

    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.float32).eval()
    result = dflash_generate(
        drafter,
        target,
        torch.tensor([prompt]),
        max_new_tokens,
        stop_ids,
        block_size=block_size,
        return_stats=True,
    )
    return result.output_ids[0, len(prompt) :].tolist(), list(result.acceptance_lengths)
