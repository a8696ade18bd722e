"""A drafter's config.json (published layout: Qwen3-style layers plus the DFlash fields), checked field by field,
and whether a drafter of it fits a target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    name, value = field("block_size", 16)
    check_int(value, name, path, minimum=2)
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
    check_optional(config, "is_causal", path, bool)
    check_rope(config, path)


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
    sliding_window: int | None
    is_causal: bool | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: Path) -> DrafterConfig:
        check_drafter_config(config, Path(source) / "config.json")
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
            return cls(
                dims=dims,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)),
                draft_vocab_size=int(config["draft_vocab_size"]) if config.get("draft_vocab_size") else None,
                block_size=int(field("block_size", 16)),
                mask_token_id=int(mask_token_id),
                target_layer_ids=[int(i) for i in layer_ids],
                input_embedding_scale=float(field("input_embedding_scale", 1.0)),
                output_multiplier=float(field("output_multiplier", 1.0)),
                final_logit_softcapping=float(softcap) if softcap else None,
                layer_types=list(config.get("layer_types") or ["full_attention"] * layers),
                sliding_window=config.get("sliding_window"),
                is_causal=config.get("is_causal"),
                raw=config,
            )
        except KeyError as exc:
            raise DFlashError(f"{source}/config.json is not a DFlash drafter config: it lacks {exc.args[0]}.") from None


def check_fits(cfg: DrafterConfig, target: Target) -> None:
    """Raise a DFlashError unless a drafter of this config can read the target's features and vocabulary."""
    if cfg.dims.hidden != target.hidden_size:
        raise DFlashError(
            f"The drafter's hidden size {cfg.dims.hidden} does not match the target's {target.hidden_size}."
        )
    if any(not 0 <= i < target.num_layers for i in cfg.target_layer_ids):
        raise DFlashError(
            f"The drafter reads target layers {cfg.target_layer_ids}, "
            f"but the target has only {target.num_layers} layers."
        )
    if cfg.dims.vocab and cfg.dims.vocab != target.vocab_size:
        raise DFlashError(
            f"The drafter's vocabulary ({cfg.dims.vocab} tokens) does not match the target's ({target.vocab_size})."
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError(f"The drafter's mask token id {cfg.mask_token_id} is outside the target's vocabulary.")
