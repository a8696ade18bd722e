"""A DFlash drafter GGUF as llama.cpp's converter writes it (architecture `dflash`, e.g. ggml-org's dflash-*.gguf):
its DrafterConfig read from the metadata, so llama.cpp's native drafter can load the file as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..defaults import DRAFTER_BLOCK
from ..errors import DFlashError
from ..gguf.file import read_header
from .config import DFLASH2_FIELDS, DrafterConfig

ARCHITECTURE = "dflash"


def is_drafter_gguf(path: Path) -> bool:
    """Whether path names a GGUF file (a drafter folder is a directory)."""
    return path.suffix == ".gguf" and path.is_file()


def _drafter_fields(path: Path) -> dict[str, Any]:
    """The file's metadata, once it is a readable GGUF of the dflash architecture."""
    try:
        fields = read_header(path).fields
    except (ValueError, KeyError, OSError) as exc:
        raise DFlashError(f"{path} is not a complete, readable GGUF file ({exc}).") from None
    architecture = fields.get("general.architecture")
    if architecture != ARCHITECTURE:
        raise DFlashError(f"{path} is a {architecture} model, not a DFlash drafter (GGUF architecture dflash).")
    return fields


def gguf_drafter_config(path: Path) -> DrafterConfig:
    """The DrafterConfig of a llama.cpp drafter GGUF: shapes, block size, the target layers (llama.cpp's layer-input
    ids minus one), mask token, embedding scale, logit scale and soft-cap, sliding layers and causality, and a DFlash2
    drafter's convolution and selector fields."""
    fields = _drafter_fields(path)

    def key(name: str, default: Any = KeyError) -> Any:
        value = fields.get(f"{ARCHITECTURE}.{name}", default)
        if value is KeyError:
            raise DFlashError(f"{path} is not a DFlash drafter GGUF: it lacks {ARCHITECTURE}.{name}.")
        return value

    layers = int(key("block_count"))
    config: dict[str, Any] = {
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers,
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        "block_size": key("block_size", DRAFTER_BLOCK),
        "input_embedding_scale": key("embedding_scale", 1.0),
        "output_multiplier": key("logit_scale", 1.0),
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "is_causal": key("attention.causal", None),
        "dflash_config": {
            "mask_token_id": fields.get("tokenizer.ggml.mask_token_id"),
            "target_layer_ids": [int(i) - 1 for i in key("target_layers")],
        },
    }
    if f"{ARCHITECTURE}.selector_rank" in fields:  # DFlash2: its convolutions' and selector's shapes
        config["dflash_config"] |= {name: key(name) for name in DFLASH2_FIELDS}
    if "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    window = key("attention.sliding_window", 0)
    if window:
        pattern = key("attention.sliding_window_pattern", [True] * layers)
        config |= {
            "use_sliding_window": True,
            "sliding_window": window,
            "layer_types": ["sliding_attention" if slides else "full_attention" for slides in pattern],
        }
    return DrafterConfig.from_dict(config, path)
