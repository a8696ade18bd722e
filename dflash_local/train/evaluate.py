"""How well a drafter drafts on self-distilled rows: each row walked block by block as greedy decoding walks it, tau at
several block sizes with a bootstrap interval over rows, and the acceptance at each block offset."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.torch_drafter import DFlashDrafter, DFlashModel
from ..runtime import LoadSpec
from .objective import IGNORE, block_loss, make_blocks


@dataclass
class Evaluation:
    """tau per block size (with its 95% bootstrap interval over rows) and per-offset acceptance, on `rows` rows."""

    rows: int
    tau: dict[int, float]
    interval: dict[int, tuple[float, float]]
    acceptance: list[
        float
    ]  # offset j = 1..B-1: share of blocks (one anchored at every position) with j drafts accepted


def label_map_of(d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """Target id -> row of a reduced head (IGNORE outside it), or None for a full head."""
    if d2t is None:
        return None
    label_map = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    label_map[d2t.cpu()] = torch.arange(len(d2t))
    return label_map


@torch.no_grad()
def row_acceptance(
    model: DFlashModel,
    embed: torch.Tensor,
    head: torch.Tensor,
    row: tuple[torch.Tensor, torch.Tensor, int, int],
    block_size: int,
    mask_id: int,
    label_map: torch.Tensor | None,
    scale: torch.Tensor,
) -> list[int]:
    """Accepted drafts of a block anchored at each generated position of one row (tokens [1, L], features [1, L, F],
    length, prompt length), in position order; blocks running past the row's end count their labels there as
    misses. head: the drafter's head rows."""
    tokens, features, length, first = row
    anchors = length - 1 - first
    if anchors < 1:
        return []
    device = embed.device
    blocks = make_blocks(
        tokens, torch.tensor([length]), torch.tensor([first]), block_size, anchors, mask_id, torch.Generator()
    )
    for name in ("ids", "positions", "labels", "weights", "mask"):
        setattr(blocks, name, getattr(blocks, name).to(device))
    result = block_loss(model, embed, head, features.to(device).float() / scale, blocks, block_size, False, label_map)
    return result.accepted.tolist()


def walk(accepted: list[int], block: int) -> tuple[int, int]:
    """(tokens made, steps) of greedy decoding over a row whose anchors accept `accepted`, drafting `block` - 1."""
    position = steps = made = 0
    end = len(accepted)
    while position < end:
        step = min(min(accepted[position], block - 1) + 1, end - position)
        position += step
        made += step
        steps += 1
    return made, steps


def bootstrap(pairs: list[tuple[int, int]], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of sum(made) / sum(steps) over rows resampled with replacement."""
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        values.append(sum(m for m, _ in sample) / max(1, sum(s for _, s in sample)))
    values.sort()
    return values[int(0.025 * draws)], values[int(0.975 * draws) - 1]


def summarise(per_row: list[list[int]], block_size: int, blocks: tuple[int, ...] = (4, 8, 16)) -> Evaluation:
    """tau, its interval and per-offset acceptance from each row's accepted drafts per anchor."""
    per_row = [row for row in per_row if row]
    tau, interval = {}, {}
    for block in (b for b in blocks if b <= block_size):
        pairs = [walk(row, block) for row in per_row]
        tau[block] = sum(m for m, _ in pairs) / max(1, sum(s for _, s in pairs))
        interval[block] = bootstrap(pairs) if pairs else (0.0, 0.0)
    counts = [a for row in per_row for a in row]
    acceptance = [sum(a >= j for a in counts) / max(1, len(counts)) for j in range(1, block_size)]
    return Evaluation(len(per_row), tau, interval, acceptance)


def evaluate(
    model: DFlashModel,
    embed: torch.Tensor,
    head: torch.Tensor,
    data,
    indices: list[int],
    label_map: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    blocks: tuple[int, ...] = (4, 8, 16),
) -> Evaluation:
    """Evaluate the drafter on the rows `indices` of data (a trainer.Sequences); head: the drafter's head rows."""
    cfg = model.cfg
    scale = torch.ones(1) if scale is None else scale
    per_row = []
    for index in indices:
        tokens, features, lengths, prompts = data.batch([index])
        row = (tokens, features, int(lengths[0]), int(prompts[0]))
        per_row.append(row_acceptance(model, embed, head, row, cfg.block_size, cfg.mask_token_id, label_map, scale))
    return summarise(per_row, cfg.block_size, blocks)


def evaluate_folder(
    folder: Path,
    embed: torch.Tensor,
    head: torch.Tensor,
    data,
    indices: list[int],
    blocks: tuple[int, ...] = (4, 8, 16),
) -> Evaluation:
    """Evaluate a saved drafter (fp32 on the CPU) on rows of data; embed and head: the target's full matrices."""
    model = DFlashDrafter.load(folder, LoadSpec()).model
    d2t = getattr(model, "d2t", None)
    label_map = label_map_of(d2t, len(embed))
    return evaluate(model, embed, head if d2t is None else head[d2t], data, indices, label_map, None, blocks)
