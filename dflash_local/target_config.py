"""The fields of an HF config.json that the torch Llama-family target, the GGUF converter and training read,
checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dimensions import Dimensions
from .errors import DFlashError
from .layers import check_rope
from .weights import check_attention_shape, check_int, check_optional, need

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


@dataclass(frozen=True)
class TargetConfig:
    """The fields of an HF config.json that a Llama-family decoder needs."""

    model_type: str
    dims: Dimensions
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    raw: dict[str, Any]

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: Path) -> TargetConfig:
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"{source}: model_type '{model_type}' is not supported by the torch backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        check_target_config(config, Path(source) / "config.json")
        try:
            return cls(
                model_type=model_type,
                dims=Dimensions.from_config(config),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                raw=config,
            )
        except KeyError as exc:
            raise DFlashError(f"{source}/config.json lacks the field {exc.args[0]}.") from None


def check_target_config(config: dict[str, Any], path: Path) -> None:
    """Raise one sentence naming the file and field for any value of the wrong type or range in a target config."""
    check_int(need(config, "vocab_size", path), "vocab_size", path)
    check_attention_shape(config, path)
    check_int(config.get("max_position_embeddings", 4096), "max_position_embeddings", path)
    for key in ("tie_word_embeddings", "mlp_bias"):
        check_optional(config, key, path, bool)
    check_rope(config, path)
