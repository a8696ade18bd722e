"""The DFlash block objective: many anchored blocks per sequence in one drafter forward.

Each block is [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1. It sees the target's
context features of positions before its anchor, and its own block (non-causal), nothing else:
exactly what the drafter sees at inference. Loss: cross-entropy against the sequence's next tokens,
weighted by exp(-(j - 1) / gamma) at block offset j, gamma = 7 for B = 16 (scaled with B), since a
late position only counts when every earlier one was accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..drafters.torch_drafter import DFlashModel
from ..layers import rope_cos_sin

IGNORE = -100


def position_weights(block_size: int) -> torch.Tensor:
    """Loss weight per block offset 0..B-1 (offset 0 is the known token: weight 0)."""
    gamma = 7.0 * block_size / 16
    weights = [0.0] + [math.exp(-(j - 1) / gamma) for j in range(1, block_size)]
    return torch.tensor(weights)


@dataclass
class Blocks:
    """Anchored blocks for a batch of sequences, flattened to K*B query slots per sequence."""

    ids: torch.Tensor  # [batch, K*B] block inputs: anchor token then MASKs
    positions: torch.Tensor  # [batch, K*B]
    labels: torch.Tensor  # [batch, K*B], IGNORE where there is nothing to predict
    weights: torch.Tensor  # [batch, K*B]
    mask: torch.Tensor  # [batch, 1, K*B, L + K*B]: what each query may see


def make_blocks(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    block_size: int,
    anchors: int,
    mask_token_id: int,
    generator: torch.Generator,
) -> Blocks:
    """Sample `anchors` block starts per sequence inside its generated part (at or after the prompt's end)."""
    batch, width = tokens.shape
    starts = torch.zeros(batch, anchors, dtype=torch.long)
    live = torch.zeros(batch, anchors, dtype=torch.bool)
    for row in range(batch):
        first, last = int(prompt_lengths[row]), int(lengths[row]) - 2
        count = last - first + 1
        if count <= 0:
            continue
        chosen = torch.randperm(count, generator=generator)[:anchors] + first
        starts[row, : chosen.numel()] = chosen.sort().values
        live[row, : chosen.numel()] = True
    offsets = torch.arange(block_size)
    positions = (starts[:, :, None] + offsets).reshape(batch, -1)
    in_sequence = positions < lengths[:, None].long()
    gathered = tokens.long().gather(1, positions.clamp_max(width - 1))
    has_label = in_sequence & live.repeat_interleave(block_size, 1) & (offsets.repeat(anchors) > 0)[None]
    labels = torch.where(has_label, gathered, IGNORE)
    ids = torch.where(offsets.repeat(anchors)[None] == 0, gathered, mask_token_id)
    weights = position_weights(block_size).repeat(anchors)[None] * has_label
    block_of = torch.arange(anchors).repeat_interleave(block_size)
    same_block = block_of[:, None] == block_of[None, :]
    sees_context = torch.arange(width)[None, None, :] < starts.repeat_interleave(block_size, 1)[:, :, None]
    mask = torch.cat([sees_context, same_block[None].expand(batch, -1, -1)], dim=2)
    return Blocks(ids, positions, labels, weights, mask[:, None])


@dataclass
class BlockResult:
    """Loss and the greedy acceptance the drafter would get on these blocks."""

    loss: torch.Tensor
    accepted: torch.Tensor  # [blocks] accepted drafts per complete block
    correct: torch.Tensor  # [B-1] correct predictions per block offset 1..B-1 (complete blocks)


def block_loss(
    model: DFlashModel,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    features: torch.Tensor,
    blocks: Blocks,
    block_size: int,
    complete_only: bool = True,
    label_map: torch.Tensor | None = None,
) -> BlockResult:
    """One drafter forward over every block of the batch; weighted cross-entropy. Acceptance counts
    cover complete blocks only, or every live block (labels past a sequence's end count as misses).
    label_map: target id -> row of a reduced head (IGNORE outside it: no loss, a miss)."""
    dtype = features.dtype
    batch, width, _ = features.shape
    context = model.project_context(features)
    ctx_cos, ctx_sin = (t[None, None] for t in rope_cos_sin(model.inv_freq, torch.arange(width), dtype))
    cos, sin = rope_cos_sin(model.inv_freq, blocks.positions.reshape(-1), dtype)
    cos, sin = (t.view(batch, 1, blocks.positions.shape[1], -1) for t in (cos, sin))
    x = F.embedding(blocks.ids, embed_weight).to(dtype) * model.cfg.input_embedding_scale
    for layer in model.layers:
        past_k, past_v = layer.self_attn.key_value(context, ctx_cos, ctx_sin)
        x = layer(x, cos, sin, past_k, past_v, blocks.mask)
    logits = model.logits(model.norm(x), lambda h: F.linear(h, lm_head_weight))
    labels = blocks.labels
    if label_map is not None:
        labels = torch.where(labels == IGNORE, IGNORE, label_map[labels.clamp_min(0)])
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    weights = blocks.weights.flatten().to(per_token.dtype)
    loss = (per_token * weights).sum() / weights.sum().clamp_min(1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).view(-1, block_size)[:, 1:]
        labelled = blocks.labels.view(-1, block_size)[:, 1:] != IGNORE
        keep = labelled.all(dim=1) if complete_only else labelled.any(dim=1)
        hit = hit[keep]
        accepted = hit.long().cumprod(dim=1).sum(dim=1)
    return BlockResult(loss, accepted, hit.sum(dim=0))
