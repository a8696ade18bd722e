"""Training a DFlash drafter for a target on self-distilled shards: the loop, checkpoints, export."""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..atomic import write_text_atomic
from ..drafters.config import DrafterConfig, default_target_layer_ids
from ..drafters.torch_drafter import DFlashModel
from ..errors import DFlashError
from ..runtime import bf16_is_fast
from ..target_config import TargetConfig
from .evaluate import evaluate, label_map_of
from .objective import block_loss, make_blocks
from .settings import TrainSettings


@dataclass
class TrainEvent:
    """Progress of one optimisation step (tau_estimate only on evaluation steps)."""

    step: int
    steps: int
    loss: float
    lr: float
    tokens_per_s: float
    tau_estimate: float | None = None


def drafter_config(
    target: TargetConfig,
    layers: int,
    block_size: int,
    layer_ids: list[int],
    mask_id: int,
    extra: dict | None = None,
    d2t: torch.Tensor | None = None,
) -> dict:
    """A published-layout (z-lab's: Qwen3-style + dflash_config) config.json for a drafter of this target; extra
    holds fields that make it embed and cap as the target does, d2t its draft vocabulary (target ids, llama.cpp's
    layout)."""
    raw = target.raw
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.dims.hidden,
        "intermediate_size": target.dims.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": target.dims.heads,
        "num_key_value_heads": target.dims.kv_heads,
        "head_dim": target.dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.dims.vocab,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * layers,
        "block_size": block_size,
        "num_target_layers": target.dims.layers,
        # z-lab's layout as vLLM, SGLang and llama.cpp's converter read it (block_size in both places, as z-lab's)
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids, "block_size": block_size},
        "dtype": "bfloat16",
        **(extra or {}),
    }
    if d2t is not None:
        config["draft_vocab_size"] = len(d2t)
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if key in raw:
            config[key] = raw[key]
    return config


def new_drafter(
    config: dict,
    seed: int,
    d2t: torch.Tensor | None = None,
    initial: dict[str, torch.Tensor] | None = None,
    feature_scale: torch.Tensor | None = None,
) -> DFlashModel:
    """A drafter drafting over d2t if given: normal(0, 0.02) linears and unit norms, then the tensors of `initial`
    (a warm start, fc taking the target's raw features: it is multiplied by feature_scale to take scaled ones)."""
    torch.manual_seed(seed)
    model = DFlashModel(DrafterConfig.from_dict(config, Path("<new drafter>")))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.normal_(param, std=0.02)
    if d2t is not None:
        model.d2t.copy_(d2t)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in (initial or {}).items():
            if name == "fc.weight" and feature_scale is not None:
                tensor = tensor * feature_scale.to(tensor.device)
            params[name].copy_(tensor)
    return model


def draft_vocabulary(data: Sequences, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids most frequent among the training rows' generated tokens (what the drafter predicts),
    then among their prompts (real text: ids the target may write on other prompts), most frequent first: FR-Spec's
    reduced draft vocabulary. The target still verifies over every id."""
    generated = torch.zeros(vocab_size, dtype=torch.long)
    written = torch.zeros(vocab_size, dtype=torch.long)
    for index in data.train:
        shard, row = data.rows[index]
        begin, end = int(shard["prompt_lengths"][row]), int(shard["lengths"][row])
        generated += torch.bincount(shard["tokens"][row, begin:end].long(), minlength=vocab_size)
        written += torch.bincount(shard["tokens"][row, :begin].long(), minlength=vocab_size)
    rank = generated * (int(written.sum()) + 1) + written
    return torch.argsort(rank, descending=True, stable=True)[:size].clone()


def save_drafter(model: DFlashModel, config: dict, folder: Path, feature_scale: torch.Tensor | None = None) -> None:
    """Write config.json + model.safetensors (bf16), each atomically; fc trained on features divided by
    feature_scale is folded back to take the target's raw features."""
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if feature_scale is not None:
        state = {**state, "fc.weight": state["fc.weight"] / feature_scale.to(state["fc.weight"].device)}
    tensors = {
        name: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()).contiguous()
        for name, t in state.items()
    }
    save_file(tensors, str(folder / "model.safetensors.partial"))
    os.replace(folder / "model.safetensors.partial", folder / "model.safetensors")
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2) + "\n")


class Sequences:
    """All shard rows, indexable, split into training and held-out sets."""

    def __init__(self, shards: list[dict[str, torch.Tensor]], heldout_fraction: float, seed: int) -> None:
        self.rows = [(shard, row) for shard in shards for row in range(shard["tokens"].shape[0])]
        if not self.rows:
            raise DFlashError("No self-distilled sequences to train on.")
        order = list(range(len(self.rows)))
        random.Random(seed).shuffle(order)
        greedy = [i for i in order if not bool(self.rows[i][0]["sampled"][self.rows[i][1]])]
        count = max(1, int(len(order) * heldout_fraction)) if len(order) > 1 else 0
        self.heldout = greedy[:count]
        held = set(self.heldout)
        self.train = [i for i in order if i not in held]

    def feature_scale(self, rows: int = 64) -> torch.Tensor:
        """Per feature channel, its RMS over the first `rows` training sequences (at least 1e-3). Target layers
        differ in scale by 100x and a few channels by 10^4 (Gemma): training on features divided by it lets fc
        learn from every channel at one learning rate."""
        tokens, features, lengths, _ = self.batch(self.train[:rows])
        live = torch.arange(features.shape[1])[None, :] < (lengths - 1)[:, None]
        return features[live].float().pow(2).mean(dim=0).sqrt().clamp_min(1e-3)

    def soft(self, indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' soft labels (top-k ids, logits) padded to width, or None when the shards hold none."""
        rows = [self.rows[i] for i in indices]
        if any("soft_ids" not in shard for shard, _ in rows):
            return None
        k = rows[0][0]["soft_ids"].shape[-1]
        ids = torch.zeros(len(rows), width, k, dtype=torch.int32)
        logits = torch.zeros(len(rows), width, k, dtype=torch.bfloat16)
        for i, (shard, r) in enumerate(rows):
            n = min(width, shard["soft_ids"].shape[1])
            ids[i, :n], logits[i, :n] = shard["soft_ids"][r, :n], shard["soft_logits"][r, :n]
        return ids, logits

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, features, lengths, prompt lengths for the rows, padded to the longest."""
        rows = [self.rows[i] for i in indices]
        lengths = torch.stack([shard["lengths"][r] for shard, r in rows]).long()
        width = int(lengths.max())
        dim = rows[0][0]["features"].shape[-1]
        tokens = torch.zeros(len(rows), width, dtype=rows[0][0]["tokens"].dtype)
        features = torch.zeros(len(rows), width, dim, dtype=torch.bfloat16)
        for i, (shard, r) in enumerate(rows):  # shards are padded to their own longest row
            n = min(width, shard["tokens"].shape[1])
            tokens[i, :n] = shard["tokens"][r, :n]
            n = min(width, shard["features"].shape[1])
            features[i, :n] = shard["features"][r, :n]
        prompt_lengths = torch.stack([shard["prompt_lengths"][r] for shard, r in rows]).long()
        return tokens, features, lengths, prompt_lengths


def _lr(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _autocast(device: str):
    """bf16 autocast where bf16 is fast, plain fp32 elsewhere."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return torch.autocast(device_type=kind, dtype=torch.bfloat16, enabled=bf16_is_fast(device))


def _to(blocks, device: str):
    for name in ("ids", "positions", "labels", "weights", "mask", "soft_ids", "soft_logits"):
        value = getattr(blocks, name)
        setattr(blocks, name, None if value is None else value.to(device))
    return blocks


def _optimizer(model: torch.nn.Module, settings: TrainSettings) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """The trainable parameters and AdamW over them, weight decay on the matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


def _save_checkpoint(
    checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, scale: torch.Tensor
) -> None:
    """Model, optimiser, step and feature scale, written atomically (a killed run resumes from the last one)."""
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "feature_scale": scale}
    partial = checkpoint.with_name(checkpoint.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, checkpoint)


def _heldout_tau(
    model: torch.nn.Module,
    embed: torch.Tensor,
    head: torch.Tensor,
    data: Sequences,
    label_map: torch.Tensor,
    scale: torch.Tensor,
    settings: TrainSettings,
    device: str,
) -> float:
    """The drafter's tau at the training block size on the first held-out sequences (evaluate's greedy walk)."""
    model.eval()
    heldout = data.heldout[: settings.eval_sequences]
    with _autocast(device):
        found = evaluate(model, embed, head, data, heldout, label_map, scale, (settings.block_size,))
    return found.tau.get(settings.block_size, 0.0)


def train(
    embed: torch.Tensor,
    head: torch.Tensor,
    data: Sequences,
    config: dict,
    out: Path,
    work: Path,
    settings: TrainSettings,
    resume: bool,
    device: str = "cpu",
    d2t: torch.Tensor | None = None,
    initial: dict[str, torch.Tensor] | None = None,
) -> Iterator[TrainEvent]:
    """Optimise a drafter, yielding a TrainEvent per step; writes checkpoints to work and the drafter to out.
    With d2t the drafter's head is those rows of the target's, and labels outside them count as misses; initial:
    tensors to start from (a warm start) instead of random ones, unless a checkpoint is resumed."""
    checkpoint = work / "checkpoint.pt"
    resuming = resume and checkpoint.is_file()
    scale = data.feature_scale()
    model = new_drafter(config, settings.seed, d2t, None if resuming else initial, scale).to(device)
    label_map = label_map_of(d2t, len(embed))
    if d2t is not None:
        head = head[d2t]
        label_map = label_map.to(device)
    params, optimizer = _optimizer(model, settings)
    step = 0
    if resuming:
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        scale = state["feature_scale"]
    scale = scale.to(device)
    mask_id = int(config["dflash_config"]["mask_token_id"])
    generator = torch.Generator().manual_seed(settings.seed + step)
    order_rng = random.Random(settings.seed + step)
    embed, head = embed.to(device), head.to(device)
    while step < settings.steps:
        began = time.perf_counter()
        model.train()
        indices = order_rng.sample(data.train, min(settings.batch_size, len(data.train)))
        tokens, features, lengths, prompts = data.batch(indices)
        soft = data.soft(indices, tokens.shape[1]) if settings.soft_weight else None
        blocks = make_blocks(
            tokens, lengths, prompts, settings.block_size, settings.anchors, mask_id, generator, soft, settings.gamma
        )
        blocks = _to(blocks, device)
        lr = _lr(step, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs = features.to(device).float() / scale
        with _autocast(device):
            result = block_loss(
                model, embed, head, inputs, blocks, settings.block_size, True, label_map, settings.soft_weight
            )
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        tau = None
        if step % settings.eval_every == 0 or step == settings.steps:
            tau = _heldout_tau(model, embed, head, data, label_map, scale, settings, device)
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            _save_checkpoint(checkpoint, model, optimizer, step, scale)
            save_drafter(model, config, out, scale)
        elapsed = time.perf_counter() - began
        yield TrainEvent(step, settings.steps, float(result.loss.detach()), lr, int(lengths.sum()) / elapsed, tau)


def default_layer_ids(target: TargetConfig, layers: int) -> list[int]:
    """Target layers to read features from: the published spread, at least 3 when the target allows."""
    return default_target_layer_ids(target.dims.layers, max(layers, min(3, target.dims.layers)))
