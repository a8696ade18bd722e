"""The reference oracle: transformers + PyPI `dflash`, run by .venv-oracle's python, never imported by the tests.

It reads one JSON command per line on stdin ({"op": ..., "args": {...}}) and answers one JSON line on stdout
({"result": ...} or {"error": traceback}); tensors travel as safetensors files at paths the caller names.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import dflash.model
import torch
from dflash.model import DFlashDraftModel, build_target_layer_ids, dflash_generate, extract_context_feature
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

dflash.model._cuda_time = time.perf_counter  # the reference synchronizes CUDA unconditionally


def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(std * noise)


def make_target(
    folder: str,
    kind: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    seed: int,
    std: float,
    tied: bool,
    eos_token_id: int | None,
) -> str:
    """Save a random-weight LlamaForCausalLM or Qwen3ForCausalLM with save_pretrained."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=2 * hidden_size // num_heads, **common))
    _randomize(model, seed, std)
    model.save_pretrained(folder)
    return folder


def make_drafter(
    folder: str,
    target_folder: str,
    num_layers: int,
    target_layer_ids: list[int] | None,
    block_size: int,
    seed: int,
    std: float,
    extra: dict,
) -> str:
    """Save a random-weight reference `dflash.model.DFlashDraftModel` shaped for the target."""
    target = AutoConfig.from_pretrained(target_folder)
    dflash_config = {"mask_token_id": target.vocab_size - 1}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = target_layer_ids
    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        block_size=block_size,
        num_target_layers=target.num_hidden_layers,
        dflash_config=dflash_config,
        **extra,
    )
    model = DFlashDraftModel(config)
    _randomize(model, seed, std)
    model.save_pretrained(folder)
    return folder


def _target(folder: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def generate(
    target_folder: str,
    drafter_folder: str,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int,
    stop_ids: list[int] | None,
) -> dict:
    """New token ids and acceptance lengths from dflash.model.dflash_generate at temperature 0."""
    drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.float32).eval()
    result = dflash_generate(
        drafter,
        _target(target_folder),
        torch.tensor([prompt]),
        max_new_tokens,
        stop_ids,
        block_size=block_size,
        return_stats=True,
    )
    return {"ids": result.output_ids[0, len(prompt) :].tolist(), "lengths": list(result.acceptance_lengths)}


def forward(folder: str, ids: list[int], out: str) -> None:
    """The transformers target's logits and every hidden state (hidden.{i}) for ids, saved to out."""
    with torch.no_grad():
        result = _target(folder)(torch.tensor([ids]), output_hidden_states=True)
    tensors = {"logits": result.logits[0]} | {f"hidden.{i}": h[0] for i, h in enumerate(result.hidden_states)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)


def next_logits(folder: str, prefixes: list[list[int]], out: str) -> None:
    """The transformers target's logits of the token after each prefix (row.{i}), one forward per prefix."""
    target = _target(folder)
    with torch.no_grad():
        rows = {f"row.{i}": target(torch.tensor([ids])).logits[0, -1].contiguous() for i, ids in enumerate(prefixes)}
    save_file(rows, out)


def draft_logits(target_folder: str, drafter_folder: str, ids: list[int], steps: list[dict], out: str) -> None:
    """The reference drafter's logits (step.{i}) for consecutive steps {begin, end, first, length} sharing a cache."""
    target = _target(target_folder)
    drafter = DFlashDraftModel.from_pretrained(drafter_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        hidden = extract_context_feature(states, drafter.target_layer_ids)
    cache = dflash.model._make_cache(drafter.config)  # as dflash_generate's: sliding layers keep what a crop needs
    scale = float(dflash.model._draft_value(drafter.config, "input_embedding_scale", 1.0))  # as dflash_generate
    logits = {}
    for index, step in enumerate(steps):
        begin, end, length = step["begin"], step["end"], step["length"]
        block = torch.tensor([[step["first"]] + [drafter.mask_token_id] * (length - 1)])
        with torch.no_grad():
            states = drafter(
                target_hidden=hidden[:, begin:end],
                noise_embedding=dflash.model._raw_input_embeddings(target, block, scale),
                position_ids=torch.arange(begin, end + length)[None],
                past_key_values=cache,
                use_cache=True,
            )[:, 1:]
            logits[f"step.{index}"] = drafter.compute_logits(states, target.lm_head)[0].contiguous()
        dflash.model._crop_to(cache, end)
    save_file(logits, out)


def save_sharded(source: str, folder: str, max_shard_size: str) -> None:
    """Load a target with transformers and save it again in shards of at most max_shard_size."""
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(folder, max_shard_size=max_shard_size)


def layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default target_layer_ids."""
    return build_target_layer_ids(num_target_layers, num_draft_layers)


OPS = {
    "make_target": make_target,
    "make_drafter": make_drafter,
    "generate": generate,
    "forward": forward,
    "next_logits": next_logits,
    "draft_logits": draft_logits,
    "save_sharded": save_sharded,
    "layer_ids": layer_ids,
}


def main() -> None:
    """Answer commands until stdin closes; anything the libraries print goes to stderr, not into the answers."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(1)  # as the tests run our engine: same kernels, same float sums
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = {"result": OPS[command["op"]](**command["args"])}
        except Exception:
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
