"""The DFlash block objective: many anchored blocks per sequence in one drafter forward.

Each block is [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1. It sees the target's
context features of positions before its anchor, and its own block (non-causal), nothing else:
exactly what the drafter sees at inference. Loss: cross-entropy against the sequence's next tokens,
weighted by exp(-(j - 1) / gamma) at block offset j, gamma = 7 for B = 16 (scaled with B), since a
late position only counts when every earlier one was accepted. With soft labels (the target's top-k logits
stored in the shards) the loss mixes in cross-entropy against the target's distribution over those ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..drafters.torch_drafter import DFlashModel
from ..errors import DFlashError
from ..layers import rope_cos_sin

IGNORE = -100


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Loss weight per block offset 0..B-1 (offset 0 is the known token: weight 0); gamma defaults to 7 * B / 16."""
    gamma = gamma or 7.0 * block_size / 16
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
    soft_ids: torch.Tensor | None = None  # [batch, K*B, k] the target's top-k ids for each slot's label
    soft_logits: torch.Tensor | None = None  # [batch, K*B, k] their logits


def make_blocks(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    block_size: int,
    anchors: int,
    mask_token_id: int,
    generator: torch.Generator,
    soft: tuple[torch.Tensor, torch.Tensor] | None = None,
    gamma: float | None = None,
) -> Blocks:
    """Sample `anchors` block starts per sequence inside its generated part (at or after the prompt's end);
    soft: the rows' top-k (ids, logits) [batch, width, k] at the position of the token they predict."""
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
    weights = position_weights(block_size, gamma).repeat(anchors)[None] * has_label
    block_of = torch.arange(anchors).repeat_interleave(block_size)
    same_block = block_of[:, None] == block_of[None, :]
    sees_context = torch.arange(width)[None, None, :] < starts.repeat_interleave(block_size, 1)[:, :, None]
    mask = torch.cat([sees_context, same_block[None].expand(batch, -1, -1)], dim=2)
    blocks = Blocks(ids, positions, labels, weights, mask[:, None])
    if soft is not None:
        at = positions.clamp_max(width - 1)[:, :, None].expand(-1, -1, soft[0].shape[-1])
        blocks.soft_ids = soft[0].long().gather(1, at)
        blocks.soft_logits = soft[1].float().gather(1, at)
    return blocks


def soft_cross_entropy(
    log_probs: torch.Tensor, soft_ids: torch.Tensor, soft_logits: torch.Tensor, label_map: torch.Tensor | None
) -> torch.Tensor:
    """Per slot, cross-entropy of the drafter's log-probabilities [N, V] against the target's distribution over its
    top-k ids [N, k] (renormalised over the ids the head covers; 0 where it covers none)."""
    rows = soft_ids if label_map is None else label_map[soft_ids]
    covered = rows != IGNORE
    teacher = torch.where(covered, soft_logits, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return -(teacher * log_probs.gather(1, rows.clamp_min(0))).sum(dim=-1)


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
    soft_weight: float = 0.0,
) -> BlockResult:
    """One drafter forward over every block of the batch; weighted cross-entropy, (1 - soft_weight) on the target's
    tokens and soft_weight on its top-k distribution (blocks.soft_*). Acceptance counts cover complete blocks only,
    or every live block (labels past a sequence's end count as misses).
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
    if soft_weight:
        if blocks.soft_ids is None:
            raise DFlashError("Soft labels were asked for, but the shards hold none (distil with soft labels).")
        soft = soft_cross_entropy(
            logits.flatten(0, 1).log_softmax(dim=-1),
            blocks.soft_ids.flatten(0, 1),
            blocks.soft_logits.flatten(0, 1),
            label_map,
        )
        per_token = (1 - soft_weight) * per_token + soft_weight * soft
    weights = blocks.weights.flatten().to(per_token.dtype)
    loss = (per_token * weights).sum() / weights.sum().clamp_min(1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).view(-1, block_size)[:, 1:]
        labelled = blocks.labels.view(-1, block_size)[:, 1:] != IGNORE
        keep = labelled.all(dim=1) if complete_only else labelled.any(dim=1)
        hit = hit[keep]
        accepted = hit.long().cumprod(dim=1).sum(dim=1)
    return BlockResult(loss, accepted, hit.sum(dim=0))
