"""Self-distillation data: the target continues each prompt (greedy or sampled), in batches, and the
token ids, the target's context features and (optionally) its top-k logits before each written token are written
to disk in shards so a run can resume."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..sampling import SamplingParams, pick
from ..targets.torch_llama import LlamaModel
from .settings import DistillSettings


@dataclass
class Continuation:
    """One continued prompt: prompt + continuation ids, the features of every position fed to the target
    ([len(ids) - 1, features]) and, with soft labels, the target's top-k ids and logits before each written token
    ([len(ids) - len(prompt), k]; None without)."""

    ids: list[int]
    features: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logits: torch.Tensor | None = None


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The k largest logits of each row and their ids (int32, bf16), or None for k = 0."""
    if k <= 0:
        return None
    values, ids = torch.topk(logits.float(), k, dim=-1)
    return ids.to(torch.int32).cpu(), values.to(torch.bfloat16).cpu()


@torch.inference_mode()
def continue_batch(
    model: LlamaModel,
    prompts: list[list[int]],
    new_tokens: int,
    layer_ids: list[int],
    params: SamplingParams,
    stop_ids: frozenset[int],
    generator: torch.Generator,
    soft_top_k: int = 0,
) -> list[Continuation]:
    """Continue left-padded prompts together; one Continuation per prompt."""
    device = model.lm_head.weight.device
    batch, longest = len(prompts), max(map(len, prompts))
    total = longest + new_tokens
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.zeros(batch, total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) : longest] = torch.tensor(prompt)
    slots = torch.arange(total, device=device)
    valid = slots[None, :] >= pad[:, None]
    cache = model.new_cache(batch, total)
    features = []
    # Prefill: causal over real tokens; padded queries see themselves so no row is fully masked.
    causal = slots[:longest, None] >= slots[None, :longest]
    mask = (causal[None] & valid[:, None, :longest]) | torch.eye(longest, dtype=torch.bool, device=device)[None]
    positions = (slots[None, :longest] - pad[:, None]).clamp_min(0)
    hidden, feats = model.run_layers(ids[:, :longest], positions, cache, slots[:longest], mask[:, None], layer_ids)
    features.append(feats)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    ends = torch.full((batch,), total, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    tops = []
    for step in range(longest, total):
        logits = model.lm_head(hidden[:, -1]).float()
        tops.append(top_k(logits, soft_top_k))
        token = pick(logits, params, generator)
        ids[:, step] = token
        hit = torch.isin(token, stops) & ~done
        ends = torch.where(hit, step + 1, ends)
        done |= hit
        if bool(done.all()) or step == total - 1:
            break
        positions = (step - pad)[:, None]
        mask = valid[:, None, None, : step + 1]
        hidden, feats = model.run_layers(ids[:, step : step + 1], positions, cache, slots[step, None], mask, layer_ids)
        features.append(feats)
    features = torch.cat(features, dim=1)
    out = []
    for row in range(batch):
        begin, end = int(pad[row]), int(ends[row])
        found = Continuation(ids[row, begin:end].tolist(), features[row, begin : end - 1])
        if soft_top_k:
            found.top_ids = torch.stack([t[0][row] for t in tops[: end - longest]])
            found.top_logits = torch.stack([t[1][row] for t in tops[: end - longest]])
        out.append(found)
    return out


def _save_atomically(tensors: dict[str, torch.Tensor], path: Path) -> None:
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    os.replace(partial, path)


def pack_shard(rows: list[tuple[Continuation, int, bool]], path: Path) -> None:
    """Write (continuation, prompt length, sampled) rows, right-padded, as one safetensors shard. Soft labels, where
    the continuations carry them, go to soft_ids / soft_logits [rows, width, k] at the position of the token they
    predict (zeros over the prompt)."""
    width = max(len(row[0].ids) for row in rows)
    dim = rows[0][0].features.shape[-1]
    tokens = torch.zeros(len(rows), width, dtype=torch.int32)
    feats = torch.zeros(len(rows), width, dim, dtype=torch.bfloat16)
    for row, (found, _, _) in enumerate(rows):
        tokens[row, : len(found.ids)] = torch.tensor(found.ids, dtype=torch.int32)
        feats[row, : found.features.shape[0]] = found.features.to(torch.bfloat16)
    tensors = {
        "tokens": tokens,
        "features": feats,
        "lengths": torch.tensor([len(row[0].ids) for row in rows], dtype=torch.int32),
        "prompt_lengths": torch.tensor([row[1] for row in rows], dtype=torch.int32),
        "sampled": torch.tensor([row[2] for row in rows], dtype=torch.bool),
    }
    if rows[0][0].top_ids is not None:
        k = rows[0][0].top_ids.shape[-1]
        tensors["soft_ids"] = torch.zeros(len(rows), width, k, dtype=torch.int32)
        tensors["soft_logits"] = torch.zeros(len(rows), width, k, dtype=torch.bfloat16)
        for row, (found, prompt_length, _) in enumerate(rows):
            end = prompt_length + len(found.top_ids)
            tensors["soft_ids"][row, prompt_length:end] = found.top_ids
            tensors["soft_logits"][row, prompt_length:end] = found.top_logits
    _save_atomically(tensors, path)


# Continues a batch of prompts: (prompts, sampling, generator) -> one Continuation per prompt.
Continuer = Callable[[list[list[int]], SamplingParams, torch.Generator], list[Continuation]]


def torch_continuer(
    model: LlamaModel, new_tokens: int, layer_ids: list[int], stop_ids: frozenset[int], soft_top_k: int = 0
) -> Continuer:
    """continue_batch on a torch target."""

    device = model.lm_head.weight.device

    def run(prompts: list[list[int]], params: SamplingParams, generator: torch.Generator):
        on_device = torch.Generator(device=device).manual_seed(generator.initial_seed())
        return continue_batch(model, prompts, new_tokens, layer_ids, params, stop_ids, on_device, soft_top_k)

    return run


def generate_shards(
    make_continuer: Callable[[], Continuer], prompts: list[list[int]], folder: Path, settings: DistillSettings
) -> Iterator[tuple[int, int]]:
    """Write shard_NNNNN.safetensors files under folder, skipping shards already written (the continuer is made only
    when one is missing); yields (prompts done, prompts total) as it goes."""
    continuer: Continuer | None = None
    folder.mkdir(parents=True, exist_ok=True)
    total = len(prompts)
    for shard_index, first in enumerate(range(0, total, settings.shard_size)):
        path = folder / f"shard_{shard_index:05d}.safetensors"
        chunk = prompts[first : first + settings.shard_size]
        if path.exists() and _rows_in(path) == len(chunk):
            yield first + len(chunk), total
            continue
        rows = []
        for offset in range(0, len(chunk), settings.batch_size):
            batch = chunk[offset : offset + settings.batch_size]
            number = first + offset
            sampled = random.Random(settings.seed + number).random() < settings.sampled_fraction
            params = SamplingParams(temperature=settings.temperature if sampled else 0.0)
            generator = torch.Generator().manual_seed(settings.seed + number)
            continuer = continuer or make_continuer()
            results = continuer(batch, params, generator)
            rows += [(found, len(prompt), sampled) for found, prompt in zip(results, batch, strict=True)]
            yield first + offset + len(batch), total
        pack_shard(rows, path)


def _rows_in(path: Path) -> int:
    """How many sequences a shard holds (0 when it cannot be read)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_slice("lengths").get_shape()[0]
    except (SafetensorError, OSError):
        return 0


def load_shards(folder: Path) -> list[dict[str, torch.Tensor]]:
    """Every complete shard in folder."""
    return [load_file(str(path)) for path in sorted(folder.glob("shard_*.safetensors"))]
