"""Random-weight models with the exact configs and tensor names of real target/drafter pairs, for measuring memory
and speed at real sizes without downloads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import DFlashError


@dataclass(frozen=True)
class Shape:
    """A target's architecture and the shape of the DFlash drafter published (or sized) for it."""

    family: str  # llama or qwen3
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    rope_theta: float
    drafter_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int


SHAPES = {
    "llama3.1-8b": Shape(
        "llama", 4096, 14336, 32, 32, 8, 128, 128256, False, 500000.0, 5, 10, (1, 8, 15, 22, 29), 128002
    ),
    "qwen3-8b": Shape("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, 1e6, 5, 16, (1, 9, 17, 25, 33), 151669),
    "qwen3-4b": Shape("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True, 1e6, 5, 16, (1, 9, 17, 25, 33), 151669),
    "llama3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 500000.0, 5, 16, (1, 4, 8, 11, 14), 128002),
    "qwen3-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, 5, 16, (1, 7, 13, 19, 25), 151669),
}


def _layer_config(shape: Shape, layers: int) -> dict:
    return {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6 if shape.family == "qwen3" else 1e-5,
        "attention_bias": False,
        "max_position_embeddings": 40960 if shape.family == "qwen3" else 131072,
        "vocab_size": shape.vocab,
        "rope_theta": shape.rope_theta,
        "torch_dtype": "bfloat16",
    }


def target_config(shape: Shape) -> dict:
    config = _layer_config(shape, shape.layers) | {"tie_word_embeddings": shape.tied, "bos_token_id": 1}
    config["eos_token_id"] = 2
    if shape.family == "llama":
        config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    else:
        config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    return config


def drafter_config(shape: Shape) -> dict:
    return _layer_config(shape, shape.drafter_layers) | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "block_size": shape.block_size,
        "num_target_layers": shape.layers,
        "dflash_config": {"mask_token_id": shape.mask_token_id, "target_layer_ids": list(shape.target_layer_ids)},
    }


def _layer_tensors(shape: Shape, prefix: str, generator: torch.Generator, qk_norm: bool):
    """(name, tensor) of one decoder layer in HF naming, random projections and unit norms."""
    h, q, kv, inter = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    yield f"{prefix}.input_layernorm.weight", _ones(h)
    yield f"{prefix}.post_attention_layernorm.weight", _ones(h)
    yield f"{prefix}.self_attn.q_proj.weight", _rand(generator, q, h)
    yield f"{prefix}.self_attn.k_proj.weight", _rand(generator, kv, h)
    yield f"{prefix}.self_attn.v_proj.weight", _rand(generator, kv, h)
    yield f"{prefix}.self_attn.o_proj.weight", _rand(generator, h, q)
    if qk_norm:
        yield f"{prefix}.self_attn.q_norm.weight", _ones(shape.head_dim)
        yield f"{prefix}.self_attn.k_norm.weight", _ones(shape.head_dim)
    yield f"{prefix}.mlp.gate_proj.weight", _rand(generator, inter, h)
    yield f"{prefix}.mlp.up_proj.weight", _rand(generator, inter, h)
    yield f"{prefix}.mlp.down_proj.weight", _rand(generator, h, inter)


class ShardWriter:
    """Writes tensors into ~2 GB safetensors shards plus the index, so peak memory stays near one shard."""

    def __init__(self, folder: Path, limit: int = 2 << 30) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.shards: list[dict[str, torch.Tensor]] = []
        self.weight_map: dict[str, str] = {}
        self.count = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.limit:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        self.count += 1
        file = f"model-{self.count:05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.weight_map |= dict.fromkeys(self.pending, file)
        self.pending = {}

    def close(self) -> None:
        """Write the last shard and the index (a single shard is renamed model.safetensors)."""
        self._flush()
        if self.count == 1:
            (self.folder / "model-00001.safetensors").rename(self.folder / "model.safetensors")
            return
        index = {"metadata": {}, "weight_map": self.weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_pair(name: str, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write folder/target and folder/drafter (config.json + bf16 safetensors) for a shape in SHAPES."""
    if name not in SHAPES:
        raise DFlashError(f"Unknown synthetic shape '{name}' (known: {', '.join(SHAPES)}).")
    shape = SHAPES[name]
    generator = torch.Generator().manual_seed(seed)
    target, drafter = folder / "target", folder / "drafter"
    for path in (target, drafter):
        path.mkdir(parents=True, exist_ok=True)
    for path, tensors in ((target, _target_tensors(shape, generator)), (drafter, _drafter_tensors(shape, generator))):
        writer = ShardWriter(path)
        for tensor_name, tensor in tensors:
            writer.add(tensor_name, tensor)
        writer.close()
    (target / "config.json").write_text(json.dumps(target_config(shape), indent=2))
    (drafter / "config.json").write_text(json.dumps(drafter_config(shape), indent=2))
    return target, drafter


def _rand(generator: torch.Generator, *size: int) -> torch.Tensor:
    return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)


def _ones(size: int) -> torch.Tensor:
    return torch.ones(size, dtype=torch.bfloat16)


def _target_tensors(shape: Shape, generator: torch.Generator):
    yield "model.embed_tokens.weight", _rand(generator, shape.vocab, shape.hidden)
    for index in range(shape.layers):
        yield from _layer_tensors(shape, f"model.layers.{index}", generator, shape.family == "qwen3")
    yield "model.norm.weight", _ones(shape.hidden)
    if not shape.tied:
        yield "lm_head.weight", _rand(generator, shape.vocab, shape.hidden)


def _drafter_tensors(shape: Shape, generator: torch.Generator):
    for index in range(shape.drafter_layers):
        yield from _layer_tensors(shape, f"layers.{index}", generator, True)
    yield "fc.weight", _rand(generator, shape.hidden, shape.hidden * len(shape.target_layer_ids))
    yield "hidden_norm.weight", _ones(shape.hidden)
    yield "norm.weight", _ones(shape.hidden)
