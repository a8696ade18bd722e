"""A drafter's config.json (published layout: Qwen3-style layers plus the DFlash fields), checked field by field,
and whether a drafter of it fits a target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..defaults import DRAFTER_BLOCK, MIN_BLOCK
from ..dimensions import Dimensions
from ..errors import DFlashError
from ..layers import check_rope
from ..targets.base import Target
from ..weights import check_attention_shape, check_int, check_number, check_optional, need


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: target layers spread evenly between layer 1 and layer N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
QWEN3_WINDOW = 4096  # transformers' Qwen3Config: sliding_window when use_sliding_window is set and the key is absent
QWEN3_MAX_WINDOW_LAYERS = 28  # Qwen3Config: layers from this index slide when layer_types is absent


def is_dflash2(config: dict[str, Any]) -> bool:
    """Whether a drafter config is DFlash2's (local convolutions and a candidate selector): its architecture, or any
    of its fields in dflash_config or at the top level."""
    dflash = config.get("dflash_config")
    dflash = dflash if isinstance(dflash, dict) else {}
    return "DFlash2DraftModel" in (config.get("architectures") or []) or any(
        key in dflash or key in config for key in DFLASH2_FIELDS
    )


def _check_dflash2(config: dict[str, Any], path: Path) -> None:
    """Raise one sentence unless a DFlash2 config has all four of its fields, positive integers, in shapes llama.cpp's
    graph takes (hidden size divisible by the group size, and room for the selector's lattice in a hidden row)."""
    dflash = config.get("dflash_config") or {}
    values = {}
    for key in DFLASH2_FIELDS:
        name, value = (f"dflash_config.{key}", dflash[key]) if key in dflash else (key, config.get(key))
        if value is None:
            raise DFlashError(f"{path} is a DFlash2 drafter config without dflash_config.{key}.")
        check_int(value, name, path, minimum=1)
        values[key] = value
    hidden, top_k = config.get("hidden_size"), values["selector_top_k"]
    if isinstance(hidden, int) and hidden % values["conv_group_size"]:
        raise DFlashError(f"{path}: hidden_size {hidden} is not a multiple of conv_group_size.")
    if isinstance(hidden, int) and hidden < top_k * (top_k + 1):
        raise DFlashError(f"{path}: hidden_size {hidden} is too small for a selector_top_k of {top_k}.")


def check_drafter_config(config: dict[str, Any], path: Path) -> None:
    """Raise one sentence naming the file and field for any value of the wrong type or range in a drafter config."""
    dflash = config.get("dflash_config")
    if dflash is not None and not isinstance(dflash, dict):
        raise DFlashError(f"{path}: dflash_config must be an object, got {json.dumps(dflash)}.")
    dflash = dflash or {}

    def field(name: str, default: Any = None) -> tuple[str, Any]:
        """Where a DFlash field is read from (dflash_config first, as from_dict reads it) and its value."""
        return (f"dflash_config.{name}", dflash[name]) if name in dflash else (name, config.get(name, default))

    check_attention_shape(config, path)
    if config.get("vocab_size") is not None:
        check_int(config["vocab_size"], "vocab_size", path)
    if config.get("draft_vocab_size") is not None:
        check_int(config["draft_vocab_size"], "draft_vocab_size", path, minimum=2)
    name, value = field("block_size", DRAFTER_BLOCK)
    check_int(value, name, path, minimum=MIN_BLOCK)
    name, value = field("mask_token_id")
    if value is not None:
        check_int(value, name, path, minimum=0)
    name, layer_ids = field("target_layer_ids")
    if layer_ids is None:
        check_int(need(config, "num_target_layers", path), "num_target_layers", path)
    elif not isinstance(layer_ids, list) or not layer_ids:
        raise DFlashError(f"{path}: {name} must be a non-empty list of layer numbers, got {json.dumps(layer_ids)}.")
    for layer_id in layer_ids or []:
        check_int(layer_id, name, path, minimum=0)
    for key in ("input_embedding_scale", "output_multiplier"):
        name, value = field(key, 1.0)
        check_number(value, name, path)
    name, value = field("final_logit_softcapping")
    if value is not None:
        check_number(value, name, path, positive=False)
    layer_types = config.get("layer_types")
    layers = config["num_hidden_layers"]
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) < layers
        or not all(isinstance(kind, str) for kind in layer_types)
    ):
        raise DFlashError(f"{path}: layer_types must list one attention type per layer ({layers}).")
    check_optional(config, "sliding_window", path, int)
    check_optional(config, "use_sliding_window", path, bool)
    check_optional(config, "max_window_layers", path, int)
    check_optional(config, "is_causal", path, bool)
    window, kinds = sliding_layers(config, layers)
    if window is None and "sliding_attention" in kinds:
        raise DFlashError(
            f"{path}: layer_types has sliding layers but no window (transformers reads sliding_window only with "
            "use_sliding_window true)."
        )
    check_rope(config, path)
    if is_dflash2(config):
        _check_dflash2(config, path)


def sliding_layers(config: dict[str, Any], layers: int) -> tuple[int | None, list[str]]:
    """The sliding window and each layer's attention type as transformers' Qwen3Config reads them (the reference
    drafter's config class): the window counts only with use_sliding_window; without layer_types, layers from
    max_window_layers on slide when it does."""
    window = config.get("sliding_window", QWEN3_WINDOW) if config.get("use_sliding_window") else None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
        slides = [window is not None and i >= first for i in range(layers)]
        layer_types = ["sliding_attention" if slide else "full_attention" for slide in slides]
    return window, list(layer_types[:layers])


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter's config.json: Qwen3-style layer fields plus the DFlash fields."""

    dims: Dimensions  # vocab 0 where the config gives none
    rms_norm_eps: float
    attention_bias: bool
    draft_vocab_size: int | None  # drafts over these target ids only (the d2t tensor), as llama.cpp's reduced vocab
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    layer_types: list[str]
    sliding_window: int | None  # the window of sliding layers; None: they see all keys (causal unless is_causal says)
    is_causal: bool | None
    dflash2: dict[str, int] | None  # DFlash2's DFLASH2_FIELDS; None for a DFlash drafter
    raw: dict[str, Any]
    source: Path  # the drafter's folder (or file), named in errors

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: Path) -> DrafterConfig:
        source = Path(source)
        where = source if source.suffix == ".gguf" else source / "config.json"  # a GGUF's metadata (gguf_drafter)
        check_drafter_config(config, where)
        dflash = config.get("dflash_config") or {}

        def field(name: str, default: Any = None) -> Any:
            return dflash.get(name, config.get(name, default))

        try:
            dims = Dimensions.from_config(config)
            layers = dims.layers
            layer_ids = field("target_layer_ids")
            if layer_ids is None:
                layer_ids = default_target_layer_ids(int(config["num_target_layers"]), layers)
            mask_token_id = field("mask_token_id")
            if mask_token_id is None:
                raise KeyError("dflash_config.mask_token_id")
            softcap = field("final_logit_softcapping")
            window, layer_types = sliding_layers(config, layers)
            return cls(
                dims=dims,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)),
                draft_vocab_size=int(config["draft_vocab_size"]) if config.get("draft_vocab_size") else None,
                block_size=int(field("block_size", DRAFTER_BLOCK)),
                mask_token_id=int(mask_token_id),
                target_layer_ids=[int(i) for i in layer_ids],
                input_embedding_scale=float(field("input_embedding_scale", 1.0)),
                output_multiplier=float(field("output_multiplier", 1.0)),
                final_logit_softcapping=float(softcap) if softcap else None,
                layer_types=layer_types,
                sliding_window=window,
                is_causal=config.get("is_causal"),
                dflash2={key: int(field(key)) for key in DFLASH2_FIELDS} if is_dflash2(config) else None,
                raw=config,
                source=source,
            )
        except KeyError as exc:
            raise DFlashError(f"{where} is not a DFlash drafter config: it lacks {exc.args[0]}.") from None

    def native_refusal(self) -> str | None:
        """Why llama.cpp's native drafter cannot run this drafter folder, or None: it runs non-causal drafters whose
        sliding window (if any) covers a block."""
        sliding = any(kind == "sliding_attention" for kind in self.layer_types)
        causal = self.is_causal if self.is_causal is not None else sliding  # sliding layers: causal by default
        if causal or (sliding and self.sliding_window < self.block_size):
            return (
                "the native drafter handles only non-causal drafters whose sliding window (if any) covers a block "
                "(llama.cpp's window limits earlier keys only)"
            )
        return None


def _target_name(target: Target) -> str:
    """The target's file or folder where the target records it, for error messages."""
    info = getattr(target, "info", None)  # a llama.cpp target's GGUF record
    source = getattr(target, "source", None) or getattr(info, "path", None)
    return f"the target {source}" if source is not None else "the target"


def check_fits(cfg: DrafterConfig, target: Target) -> None:
    """Raise one sentence naming both models unless a drafter of this config can read the target's features and
    vocabulary."""
    pair = f"The drafter {cfg.source} does not fit {_target_name(target)}"
    if cfg.dims.hidden != target.hidden_size:
        raise DFlashError(
            f"{pair}: its hidden size {cfg.dims.hidden} does not match the target's {target.hidden_size}."
        )
    if any(not 0 <= i < target.num_layers for i in cfg.target_layer_ids):
        raise DFlashError(
            f"{pair}: it reads target layers {cfg.target_layer_ids}, "
            f"but the target has only {target.num_layers} layers."
        )
    if cfg.dims.vocab and cfg.dims.vocab != target.vocab_size:
        raise DFlashError(
            f"{pair}: its vocabulary ({cfg.dims.vocab} tokens) does not match the target's ({target.vocab_size})."
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError(
            f"{pair}: its mask token id {cfg.mask_token_id} is outside the target's vocabulary "
            f"({target.vocab_size} tokens)."
        )
