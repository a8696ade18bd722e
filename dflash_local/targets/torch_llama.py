"""Llama-family target (Llama 2/3.x, Qwen3) in plain PyTorch with a preallocated, rollback-able KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import DFlashError
from ..layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from ..weights import load_weights, read_config
from .base import TargetOutput

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


@dataclass(frozen=True)
class TargetConfig:
    """The fields of an HF config.json that a Llama-family decoder needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"{source}: model_type '{model_type}' is not supported by the torch backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                model_type=model_type,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                raw=config,
            )
        except KeyError as exc:
            raise DFlashError(f"{source}/config.json lacks the field {exc.args[0]}.") from None


class Attention(nn.Module):
    """Grouped-query self-attention that writes K/V into a preallocated cache."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        steps = x.shape[0]
        q = self.q_proj(x).view(steps, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(steps, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(steps, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        k = apply_rope(k.transpose(0, 1), cos, sin)
        end = start + steps
        cache_k[:, start:end] = k
        cache_v[:, start:end] = v.transpose(0, 1)
        mask = None
        if steps > 1:
            query_pos = torch.arange(start, end, device=x.device)[:, None]
            mask = torch.arange(end, device=x.device)[None, :] <= query_pos
        out = F.scaled_dot_product_attention(
            q, cache_k[:, :end], cache_v[:, :end], attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(0, 1).reshape(steps, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k, cache_v, start: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """A Llama-family causal LM whose parameter names match HF checkpoints."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.raw, cfg.head_dim), persistent=False)


class TorchLlamaTarget:
    """A target model plus its KV cache: feed tokens, read logits and context features, roll back."""

    def __init__(self, model: LlamaModel, max_context: int) -> None:
        self.model = model
        self.cfg = model.cfg
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.max_context = min(max_context, self.cfg.max_position_embeddings)
        shape = (self.cfg.num_layers, self.cfg.num_kv_heads, self.max_context, self.cfg.head_dim)
        self.cache_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cache_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.length = 0
        self.feature_layer_ids: list[int] = []

    @classmethod
    def load(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", max_context: int = 4096
    ) -> TorchLlamaTarget:
        """Build the model from an HF-layout folder (config.json + safetensors)."""
        folder = Path(folder)
        cfg = TargetConfig.from_dict(read_config(folder), folder)
        with torch.device("meta"):
            model = LlamaModel(cfg)
        tensors = load_weights(folder, dtype, device)
        if cfg.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        expected = model.state_dict()
        for name, param in expected.items():
            tensor = tensors.get(name)
            if tensor is None:
                raise DFlashError(f"{folder} lacks the tensor {name}.")
            if tensor.shape != param.shape:
                raise DFlashError(
                    f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}."
                )
        model.load_state_dict({name: tensors[name] for name in expected}, assign=True)
        model.inv_freq = rope_inv_freq(cfg.raw, cfg.head_dim).to(device)
        return cls(model.eval(), max_context)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Choose which decoder layers' outputs `forward` returns as context features."""
        self.feature_layer_ids = list(layer_ids)

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        self.length = length

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.model.model.embed_tokens.weight)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, all_logits: bool = True, features: bool = True) -> TargetOutput:
        """Append ids at the cache end; return logits (all positions or the last) and layer features."""
        steps, start = ids.shape[0], self.length
        if start + steps > self.max_context:
            raise DFlashError(f"The context is full ({self.max_context} tokens).")
        cos, sin = rope_cos_sin(self.model.inv_freq, torch.arange(start, start + steps, device=self.device), self.dtype)
        x = self.embed(ids)
        wanted = set(self.feature_layer_ids) if features else set()
        captured: dict[int, torch.Tensor] = {}
        backbone = self.model.model
        last = self.cfg.num_layers - 1
        for index, layer in enumerate(backbone.layers):
            x = layer(x, cos, sin, self.cache_k[index], self.cache_v[index], start)
            if index in wanted and index != last:
                captured[index] = x
        self.length = start + steps
        hidden = backbone.norm(x if all_logits else x[-1:])
        if last in wanted:
            captured[last] = backbone.norm(x) if not all_logits else hidden
        feats = torch.cat([captured[i] for i in self.feature_layer_ids], dim=-1) if wanted else None
        return TargetOutput(logits=self.lm_head(hidden).float(), features=feats)
