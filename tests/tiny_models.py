"""Tiny random-weight targets (transformers) and drafters (reference `dflash`) saved to disk for tests.

The oracle process (tests/oracle.py in .venv-oracle) builds them; the tests' own venv has no transformers.
"""

from __future__ import annotations

from pathlib import Path

from reference import oracle


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
    oracle().call(
        "make_target",
        folder=str(folder),
        kind=kind,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        seed=seed,
        std=std,
        tied=tied,
        eos_token_id=eos_token_id,
    )
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
    oracle().call(
        "make_drafter",
        folder=str(folder),
        target_folder=str(target_folder),
        num_layers=num_layers,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        seed=seed,
        std=std,
        extra=extra,
    )
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
