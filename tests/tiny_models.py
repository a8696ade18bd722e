"""Tiny random-weight targets (transformers) and drafters (reference `dflash`) saved to disk for tests."""

from __future__ import annotations

from pathlib import Path

import torch


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
    folder: Path,
    kind: str = "llama",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    std: float = 0.08,
    tied: bool = False,
    eos_token_id: int | None = None,
) -> Path:
    """Save a random-weight LlamaForCausalLM or Qwen3ForCausalLM with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

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
    folder: Path,
    target_folder: Path,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    block_size: int = 16,
    seed: int = 1,
    std: float = 0.08,
    **extra,
) -> Path:
    """Save a random-weight reference `dflash.model.DFlashDraftModel` shaped for the target."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig, Qwen3Config

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


def add_char_tokenizer(folder: Path, vocab_size: int) -> None:
    """Write a character-level tokenizer.json (printable ASCII, then <unk>) that fits vocab_size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)][: vocab_size - 2]
    vocab = {char: index for index, char in enumerate(chars)}
    vocab["<unk>"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
