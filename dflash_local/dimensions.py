"""A Llama/Qwen3-style decoder's dimensions, read once from a config.json dict: the one record that targets, drafters,
memory estimates and benchmarks share. No torch: the catalog's estimates read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Dimensions:
    """Widths, depth, heads, vocabulary (0: not given, as a drafter may leave it) and whether the head is the
    embedding."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Dimensions:
        """From a config.json dict (checked by its reader); a missing required field raises KeyError."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config.get("vocab_size") or 0),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def layer_matrices(self) -> dict[str, int]:
        """Weights of one decoder layer's matrices, by llama.cpp tensor kind."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "attn_q": q * self.hidden,
            "attn_k": kv * self.hidden,
            "attn_v": kv * self.hidden,
            "attn_output": q * self.hidden,
            "ffn_gate": self.intermediate * self.hidden,
            "ffn_up": self.intermediate * self.hidden,
            "ffn_down": self.intermediate * self.hidden,
        }

    def kv_bytes(self, context: int, element: int = 2) -> int:
        """K and V of every layer for context tokens (llama.cpp and torch both keep them in 16 bits)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * context * element
