"""Tiny random-weight models of the 2026 architectures: a transformers model of tiny sizes, written to GGUF by
llama.cpp's own converter, with a real vocabulary copied from llama.cpp's models/ggml-vocab-*.gguf.

Runs in the oracle environment (torch + transformers), with llama.cpp's source tree (the llama-cpp-python sdist's
vendor/llama.cpp: its converter and gguf-py) on the path:
  python tests/tiny_archs.py LLAMA_CPP_DIR OUT_DIR ARCH...   # writes OUT_DIR/ARCH/model.gguf and OUT_DIR/ARCH/hf/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
# The transformers config of each architecture (TINY's sizes, and its own) and the vocabulary file its GGUF gets.
ARCHS: dict[str, tuple[str, str, dict]] = {
    "qwen35": (
        "Qwen3_5TextConfig",
        "qwen2",
        dict(
            **TINY,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]
            ),
            tie_word_embeddings=True,
        ),
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "qwen2",
        dict(
            **TINY,
            moe_intermediate_size=32,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,  # as the published Qwen3 MoE models (llama.cpp's qwen3moe graph normalizes)
            tie_word_embeddings=True,
        ),
    ),
    "gemma4": (
        "Gemma4TextConfig",
        "gemma-4",
        dict(
            **TINY,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
        ),
    ),
    "gpt-oss": (
        "GptOssConfig",
        "gpt-2",
        dict(
            **(TINY | dict(intermediate_size=32)),
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        "llama-bpe",
        dict(
            **TINY,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            block_auto_adjust_ff_dim=False,  # the feed-forward width as given
            tie_word_embeddings=True,
        ),
    ),
}
ARCH_NAMES = {"Qwen3_5TextConfig": "Qwen3_5ForCausalLM"}  # the architectures entry the converter knows


def vocabulary(llama_cpp: Path, name: str) -> list:
    """The tokenizer.* fields of llama.cpp's vocabulary file `name`, as gguf-py reader fields."""
    import gguf

    reader = gguf.GGUFReader(llama_cpp / "models" / f"ggml-vocab-{name}.gguf")
    return [field for key, field in reader.fields.items() if key.startswith("tokenizer.")]


def copy_vocabulary(writer, fields: list) -> None:
    """Add the vocabulary fields to a GGUF writer (in place of the converter's HF tokenizer reading)."""
    import gguf

    for field in fields:
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)


def build(llama_cpp: Path, arch: str, out: Path) -> Path:
    """Write a seeded random tiny model of `arch` to out/hf and its GGUF (F32) to out/model.gguf."""
    import torch
    import transformers

    config_name, vocab_name, sizes = ARCHS[arch]
    fields = vocabulary(llama_cpp, vocab_name)
    tokens = next(f for f in fields if f.name == "tokenizer.ggml.tokens")
    config = getattr(transformers, config_name)(vocab_size=len(tokens.data), max_position_embeddings=4096, **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits far from uniform, so greedy ids differ
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.config.architectures = [ARCH_NAMES.get(config_name, type(model).__name__)]
    model.save_pretrained(out / "hf")
    if arch == "gemma4":  # the converter reads the full-attention layers' head size from a field transformers omits,
        # and the vocabulary's size from tokenizer.json
        written = json.loads((out / "hf" / "config.json").read_text())
        (out / "hf" / "config.json").write_text(json.dumps({**written, "global_head_dim": written["head_dim"]}))
        vocab = {str(i): i for i in range(config.vocab_size)}
        (out / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    import gguf
    from conversion import get_model_class

    cls = get_model_class(model.config.architectures[0])
    cls.no_mtp = True  # no multi-token-prediction layers (the converter's --no-mtp)
    converter = cls(out / "hf", gguf.LlamaFileType.ALL_F32, out / "model.gguf.partial", eager=True)
    converter.set_vocab = lambda: copy_vocabulary(converter.gguf_writer, fields)
    with torch.inference_mode():
        converter.write()
    (out / "model.gguf.partial").rename(out / "model.gguf")
    return out / "model.gguf"


if __name__ == "__main__":
    source = Path(sys.argv[1])
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    for name in sys.argv[3:]:
        build(source, name, Path(sys.argv[2]) / name)
