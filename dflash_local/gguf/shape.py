"""What llama.cpp reads of a transformer's shape: the GGUF hyperparameter keys, layer tensor names, RoPE factors."""

from __future__ import annotations

import gguf
import torch

from ..layers import rope_inv_freq, rope_parameters

# HF layer tensor -> GGUF layer tensor (blk.{i}.<name>)
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def rope_factors(config: dict, head_dim: int) -> torch.Tensor | None:
    """llama.cpp's rope_freqs (plain frequency / scaled frequency), or None for unscaled RoPE."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        return None
    return rope_inv_freq({"rope_theta": params["rope_theta"]}, head_dim) / rope_inv_freq(config, head_dim)


def add_shape(writer: gguf.GGUFWriter, cfg, context_length: int) -> None:
    """The transformer hyperparameters llama.cpp reads, from a target or drafter config (same field names)."""
    writer.add_context_length(context_length)
    writer.add_embedding_length(cfg.dims.hidden)
    writer.add_block_count(cfg.dims.layers)
    writer.add_feed_forward_length(cfg.dims.intermediate)
    writer.add_head_count(cfg.dims.heads)
    writer.add_head_count_kv(cfg.dims.kv_heads)
    writer.add_key_length(cfg.dims.head_dim)
    writer.add_value_length(cfg.dims.head_dim)
    writer.add_rope_dimension_count(cfg.dims.head_dim)
    writer.add_rope_freq_base(float(rope_parameters(cfg.raw)["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
