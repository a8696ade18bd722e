"""Random-weight models with the exact configs and tensor names of real target/drafter pairs, for measuring memory
and speed at real sizes without downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_local.errors import DFlashError
from dflash_local.shapes import SHAPES, SPECIAL_TOKENS, Shape, drafter_config, target_config


def _layer_tensors(shape: Shape, prefix: str, generator: torch.Generator, qk_norm: bool):
    """(name, tensor) of one decoder layer in HF naming, random projections and unit norms."""
    dims = shape.dims
    h, q, kv, inter = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.intermediate
    yield f"{prefix}.input_layernorm.weight", _ones(h)
    yield f"{prefix}.post_attention_layernorm.weight", _ones(h)
    yield f"{prefix}.self_attn.q_proj.weight", _rand(generator, q, h)
    yield f"{prefix}.self_attn.k_proj.weight", _rand(generator, kv, h)
    yield f"{prefix}.self_attn.v_proj.weight", _rand(generator, kv, h)
    yield f"{prefix}.self_attn.o_proj.weight", _rand(generator, h, q)
    if qk_norm:
        yield f"{prefix}.self_attn.q_norm.weight", _ones(dims.head_dim)
        yield f"{prefix}.self_attn.k_norm.weight", _ones(dims.head_dim)
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
    write_tokenizer(shape, target)
    (drafter / "config.json").write_text(json.dumps(drafter_config(shape), indent=2))
    return target, drafter


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in kept else chr(next(shifted)) for byte in range(256)]


def write_tokenizer(shape: Shape, folder: Path) -> None:
    """A byte-level BPE tokenizer.json (bytes, merges of lowercase letter pairs as the vocabulary allows, the family's
    special tokens at their real ids) and tokenizer_config.json: enough for `dflash convert` and text prompts."""
    vocab = {symbol: index for index, symbol in enumerate(_byte_symbols())}
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [[a, b] for a in letters for b in letters][: shape.dims.vocab - len(vocab) - 3]  # room for the specials
    for first, second in merges:
        vocab[first + second] = len(vocab)
    specials = [(name, index) for name, index in SPECIAL_TOKENS[shape.family] if len(vocab) <= index < shape.dims.vocab]
    added = [
        {"id": index, "content": name, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for name, index in specials
    ]
    vocab |= dict(specials)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
        | {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
        | {"vocab": vocab, "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {"add_bos_token": False}
    if len(specials) > 1:
        config |= {"bos_token": specials[0][0], "eos_token": specials[1][0]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _rand(generator: torch.Generator, *size: int) -> torch.Tensor:
    return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)


def _ones(size: int) -> torch.Tensor:
    return torch.ones(size, dtype=torch.bfloat16)


def _target_tensors(shape: Shape, generator: torch.Generator):
    yield "model.embed_tokens.weight", _rand(generator, shape.dims.vocab, shape.dims.hidden)
    for index in range(shape.dims.layers):
        yield from _layer_tensors(shape, f"model.layers.{index}", generator, shape.family == "qwen3")
    yield "model.norm.weight", _ones(shape.dims.hidden)
    if not shape.dims.tied:
        yield "lm_head.weight", _rand(generator, shape.dims.vocab, shape.dims.hidden)


def _drafter_tensors(shape: Shape, generator: torch.Generator):
    for index in range(shape.drafter_layers):
        yield from _layer_tensors(shape, f"layers.{index}", generator, True)
    yield "fc.weight", _rand(generator, shape.dims.hidden, shape.dims.hidden * len(shape.target_layer_ids))
    yield "hidden_norm.weight", _ones(shape.dims.hidden)
    yield "norm.weight", _ones(shape.dims.hidden)
