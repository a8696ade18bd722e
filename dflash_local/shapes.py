"""The architectures of real target/drafter pairs (sizes, special tokens, config.json dicts): what the synthetic
models are written with and what memory estimates are computed from, their dimensions in dimensions.Dimensions.
No torch: the catalog reads it."""

from __future__ import annotations

from dataclasses import dataclass

from .dimensions import Dimensions


@dataclass(frozen=True)
class Shape:
    """A target's architecture and the shape of the DFlash drafter published (or sized) for it."""

    family: str  # llama or qwen3
    dims: Dimensions  # the target's
    rope_theta: float
    drafter_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_factor: float = 32.0  # llama3 RoPE scaling: 32 for Llama 3.2, 8 for Llama 3.1


SHAPES = {
    "llama3.1-8b": Shape(
        "llama",
        Dimensions(4096, 14336, 32, 32, 8, 128, 128256, False),
        500000.0,
        5,
        10,
        (1, 8, 15, 22, 29),
        128002,
        8.0,
    ),
    "qwen3-8b": Shape(
        "qwen3", Dimensions(4096, 12288, 36, 32, 8, 128, 151936, False), 1e6, 5, 16, (1, 9, 17, 25, 33), 151669
    ),
    "qwen3-4b": Shape(
        "qwen3", Dimensions(2560, 9728, 36, 32, 8, 128, 151936, True), 1e6, 5, 16, (1, 9, 17, 25, 33), 151669
    ),
    "llama3.2-1b": Shape(
        "llama", Dimensions(2048, 8192, 16, 32, 8, 64, 128256, True), 500000.0, 5, 16, (1, 4, 8, 11, 14), 128002
    ),
    "qwen3-0.6b": Shape(
        "qwen3", Dimensions(1024, 3072, 28, 16, 8, 128, 151936, True), 1e6, 5, 16, (1, 7, 13, 19, 25), 151669
    ),
}


def _layer_config(shape: Shape, layers: int) -> dict:
    dims = shape.dims
    return {
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6 if shape.family == "qwen3" else 1e-5,
        "attention_bias": False,
        "max_position_embeddings": 40960 if shape.family == "qwen3" else 131072,
        "vocab_size": dims.vocab,
        "rope_theta": shape.rope_theta,
        "torch_dtype": "bfloat16",
    }


# The real special tokens of each family: (name, id), the first is BOS, the second EOS.
SPECIAL_TOKENS = {
    "llama": (("<|begin_of_text|>", 128000), ("<|eot_id|>", 128009), ("<|end_of_text|>", 128001)),
    "qwen3": (("<|endoftext|>", 151643), ("<|im_end|>", 151645), ("<|im_start|>", 151644)),
}


def target_config(shape: Shape) -> dict:
    specials = [index for _, index in SPECIAL_TOKENS[shape.family] if index < shape.dims.vocab]
    config = _layer_config(shape, shape.dims.layers) | {"tie_word_embeddings": shape.dims.tied}
    if len(specials) > 1:
        config |= {"bos_token_id": specials[0], "eos_token_id": specials[1]}
    if shape.family == "llama":
        config |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": shape.rope_factor,
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
        "num_target_layers": shape.dims.layers,
        "dflash_config": {"mask_token_id": shape.mask_token_id, "target_layer_ids": list(shape.target_layer_ids)},
    }
