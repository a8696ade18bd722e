"""Llama-family target (Llama 2/3.x, Qwen3) in plain PyTorch with a preallocated, trimmable KV cache."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..cuda_graphs import StepGraphs, cache_span
from ..errors import DFlashError
from ..layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, set_kernels
from ..quant import GroupQuantEmbedding, GroupQuantLinear, check_quantize, install_4bit, install_int4, prequantized
from ..runtime import LoadSpec, check_kernels, pick_dtype
from ..target_config import TargetConfig
from ..weights import load_weights, read_config
from .base import TargetOutput

GRAPH_MAX_STEPS = 32  # forwards of at most this many tokens (decode, verify) run as CUDA graphs on CUDA


class Attention(nn.Module):
    """Grouped-query self-attention that writes K/V into a preallocated cache."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.dims.heads, cfg.dims.kv_heads, cfg.dims.head_dim
        self.q_proj = nn.Linear(cfg.dims.hidden, cfg.dims.heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.dims.hidden, cfg.dims.kv_heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.dims.hidden, cfg.dims.kv_heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.dims.heads * cfg.dims.head_dim, cfg.dims.hidden, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.dims.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.dims.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [batch, steps, hidden]; caches [batch, kv_heads, max_len, head_dim]; K/V written at the cache slots
        [steps], then every step attends to the first mask.shape[-1] cache positions under mask."""
        batch, steps, _ = x.shape
        q = self.q_proj(x).view(batch, steps, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        cache_k.index_copy_(2, slots, k)
        cache_v.index_copy_(2, slots, v.transpose(1, 2))
        span = mask.shape[-1]
        out = F.scaled_dot_product_attention(
            q,
            cache_k[:, :, :span],
            cache_v[:, :, :span],
            attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.dims.hidden, cfg.dims.intermediate, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos, sin, cache_k, cache_v, slots: torch.Tensor, mask) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, slots, mask)
        normed, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(normed)


class Backbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        # built on the meta device, then loaded: no random init (a meta normal_ imports torch._dynamo, 2-3 s)
        self.embed_tokens = nn.Embedding(
            cfg.dims.vocab, cfg.dims.hidden, _weight=torch.empty(cfg.dims.vocab, cfg.dims.hidden)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dims.layers))
        self.norm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """A Llama-family causal LM whose parameter names match HF checkpoints."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.dims.hidden, cfg.dims.vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.raw, cfg.dims.head_dim), persistent=False)

    def new_cache(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V caches of shape [layers, batch, kv_heads, length, head_dim]."""
        cfg, weight = self.cfg, self.model.norm.weight
        shape = (cfg.dims.layers, batch, cfg.dims.kv_heads, length, cfg.dims.head_dim)
        return (
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )

    def run_layers(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        mask: torch.Tensor,
        feature_layer_ids: list[int] | tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids [batch, steps] at positions [batch or 1, steps], K/V cached at slots [steps], attending under mask
        [batch or 1, 1 or heads, steps, span] to the first span cache positions; return the final-normed hidden
        states and the concatenated outputs of feature_layer_ids (HF `hidden_states[id + 1]`)."""
        dtype = self.model.norm.weight.dtype
        batch, steps = ids.shape
        cos, sin = rope_cos_sin(self.inv_freq, positions.reshape(-1), dtype)
        cos, sin = (t.view(positions.shape[0], 1, steps, -1) for t in (cos, sin))
        x = self.model.embed_tokens(ids)
        captured: dict[int, torch.Tensor] = {}
        wanted = set(feature_layer_ids)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache[0][index], cache[1][index], slots, mask)
            if index in wanted:
                captured[index] = x
        hidden = self.model.norm(x)
        last = self.cfg.dims.layers - 1
        if last in wanted:
            captured[last] = hidden
        features = torch.cat([captured[i] for i in feature_layer_ids], dim=-1) if wanted else None
        return hidden, features


def load_gguf_model(path: Path, dtype: torch.dtype, device: str) -> tuple[LlamaModel, frozenset[int]]:
    """The LlamaModel of a GGUF file (quantized matrices as GroupQuantLinear, on device) and its end-of-sequence ids."""
    from ..gguf.file import read_header  # the gguf extra
    from ..gguf.tensors import HF_NAMES, GGUFReader, gguf_config

    try:
        header = read_header(path)
    except (ValueError, KeyError, OSError) as exc:
        raise DFlashError(f"{path} is not a complete, readable GGUF file ({exc}).") from None
    config = gguf_config(path, header.fields, header.tensors)
    cfg = TargetConfig.from_dict(config, path)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    reader = GGUFReader(path, header, dtype, device)
    hidden, inner = cfg.dims.hidden, cfg.dims.intermediate
    shapes = {
        "q_proj": (cfg.dims.heads * cfg.dims.head_dim, hidden),
        "k_proj": (cfg.dims.kv_heads * cfg.dims.head_dim, hidden),
        "v_proj": (cfg.dims.kv_heads * cfg.dims.head_dim, hidden),
        "o_proj": (hidden, cfg.dims.heads * cfg.dims.head_dim),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }
    rope_heads = {"q_proj": cfg.dims.heads, "k_proj": cfg.dims.kv_heads} if cfg.model_type == "llama" else {}
    with torch.no_grad():
        for index in range(cfg.dims.layers):
            for gguf_name, hf_name in HF_NAMES.items():
                name = f"model.layers.{index}.{hf_name.removesuffix('.weight')}"
                if hf_name.endswith("norm.weight"):
                    if hf_name.startswith("self_attn.") and not cfg.qk_norm:
                        continue
                    norm = model.get_submodule(name)
                    norm.weight = nn.Parameter(reader.floats(f"blk.{index}.{gguf_name}"), requires_grad=False)
                    continue
                short = hf_name.split(".")[1]
                module = reader.matrix(f"blk.{index}.{gguf_name}", shapes[short], rope_heads.get(short))
                model.set_submodule(name, module)
        model.model.norm.weight = nn.Parameter(reader.floats("output_norm.weight"), requires_grad=False)
        table = reader.matrix("token_embd.weight", (cfg.dims.vocab, hidden))
        if isinstance(table, GroupQuantLinear):
            model.model.embed_tokens = GroupQuantEmbedding(table, dtype)
        else:
            model.model.embed_tokens = nn.Embedding(cfg.dims.vocab, hidden, _weight=table.weight, _freeze=True)
        model.lm_head = table if cfg.dims.tied else reader.matrix("output.weight", (cfg.dims.vocab, hidden))
    inv_freq = rope_inv_freq(cfg.raw, cfg.dims.head_dim)
    if "rope_freqs.weight" in header.tensors:
        inv_freq = inv_freq / reader.floats("rope_freqs.weight").float().cpu()
    model.inv_freq = inv_freq.to(device)
    eos = header.fields.get("tokenizer.ggml.eos_token_id")
    return model.eval(), frozenset() if eos is None else frozenset([int(eos)])


class TorchLlamaTarget:
    """A target model plus its KV cache: feed tokens, read logits and context features, roll back."""

    def __init__(
        self,
        model: LlamaModel,
        max_context: int,
        cuda_graphs: bool = True,
        stop_ids: frozenset[int] = frozenset(),
        kernels: str = "auto",
    ) -> None:
        set_kernels(model, kernels)  # before any forward: a CUDA graph captures the kernels of its first run
        self.model = model
        self.kernels = kernels
        self.cfg = model.cfg
        param = model.model.norm.weight
        self.device, self.dtype = param.device, param.dtype
        self.stop_ids = stop_ids  # a GGUF file's end-of-sequence ids (HF folders keep theirs in their config files)
        self.max_context = min(max_context, self.cfg.max_position_embeddings)
        self.cache = model.new_cache(1, self.max_context)
        self.length = 0
        self.cache_owner: object | None = None  # the Session that last filled its cache
        self.verify_rows: int | None = None  # a whole block in one forward
        self.recurrent = False  # every cached position can be dropped
        self.window = 0  # a full-size cache
        self.feature_layer_ids: list[int] = []
        self.graphs = StepGraphs() if cuda_graphs and self.device.type == "cuda" else None

    @classmethod
    def load(cls, folder: str | Path, spec: LoadSpec) -> TorchLlamaTarget:
        """Build the model from an HF-layout folder (config.json + safetensors) or a GGUF file (load_gguf_model: its
        quantized blocks as int4/int8 group linears), as `spec` says (its device planned: runtime.plan_load).

        spec.quantize="int4" makes the decoder layers' linears int4 groups (kernels.wq_matmul), "nf4" NF4
        (bitsandbytes); a bnb-4bit checkpoint loads as NF4. Its layers run kernels in spec.runtime.kernels' mode.
        """
        folder = Path(folder)
        runtime, max_context, quantize = spec.runtime, spec.max_context, spec.quantize
        device, cuda_graphs, kernels = runtime.device, runtime.cuda_graphs, runtime.kernels
        dtype = pick_dtype(runtime.dtype, device)
        check_kernels(kernels, device)
        check_quantize(quantize)
        if folder.suffix == ".gguf":
            if quantize is not None:
                raise DFlashError("--quantize applies to safetensors targets; a GGUF file is already quantized.")
            model, stop_ids = load_gguf_model(folder, dtype, device)
            return cls(model, max_context, cuda_graphs, stop_ids, kernels)
        config = read_config(folder)
        cfg = TargetConfig.from_dict(config, folder)
        nf4 = prequantized(config) or quantize == "nf4"
        quantized = nf4 or quantize is not None
        with torch.device("meta"):
            model = LlamaModel(cfg)
        tensors = load_weights(folder, None if nf4 else dtype, "cpu" if quantized else device)
        install = install_4bit if nf4 else install_int4
        swapped = install(model, tensors, "model.layers", dtype, device, str(folder)) if quantized else []
        if quantized:
            tensors = {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors.items()}
        if cfg.dims.tied and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        expected = {
            name: param
            for name, param in model.state_dict().items()
            if not any(name.startswith(module + ".") for module in swapped)
        }
        for name, param in expected.items():
            tensor = tensors.get(name)
            if tensor is None:
                raise DFlashError(f"{folder} lacks the tensor {name}.")
            if tensor.shape != param.shape:
                raise DFlashError(
                    f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}."
                )
        model.load_state_dict({name: tensors[name] for name in expected}, assign=True, strict=not swapped)
        model.inv_freq = rope_inv_freq(cfg.raw, cfg.dims.head_dim).to(device)
        return cls(model.eval(), max_context, cuda_graphs, kernels=kernels)

    @property
    def vocab_size(self) -> int:
        return self.cfg.dims.vocab

    @property
    def hidden_size(self) -> int:
        return self.cfg.dims.hidden

    @property
    def num_layers(self) -> int:
        return self.cfg.dims.layers

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Choose which decoder layers' outputs `forward` returns as context features."""
        self.feature_layer_ids = list(layer_ids)

    def save_state(self) -> tuple[torch.Tensor, ...]:
        """Copies of the cached K/V up to length, for load_state (the prompt cache)."""
        return tuple(cache[..., : self.length, :].clone() for cache in self.cache)

    def load_state(self, state: tuple[torch.Tensor, ...], tokens: list[int]) -> None:
        """Hold a saved state again: the cache of `tokens` (as save_state gave it)."""
        for cache, saved in zip(self.cache, state, strict=True):
            cache[..., : saved.shape[-2], :] = saved
        self.length = len(tokens)

    @property
    def trim_floor(self) -> int:
        return 0

    def trim(self, length: int) -> None:
        """Forget every cached position at or after `length` (0: all)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim the cache to {length} from {self.length}")
        self.length = length

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model.lm_head, GroupQuantLinear):
            return self.model.lm_head.rows(ids.to(self.device), self.dtype)
        weight = self.model.lm_head.weight
        if not weight.is_floating_point():
            raise DFlashError("A reduced-vocabulary drafter needs the target's head unquantized.")
        return weight[ids.to(weight.device)].to(self.dtype)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, all_logits: bool = True, features: bool = True, greedy: bool = False
    ) -> TargetOutput:
        """Append ids at the cache end; return logits (all positions or the last) and layer features (greedy or not:
        greedy acceptance reads the logits where they are, on CUDA in one kernel).

        Runs `step`: eagerly over exactly the used cache, or on CUDA for decode and verify (all logits, at most
        GRAPH_MAX_STEPS tokens) as a replayed graph over a power-of-two span of it.
        """
        steps, start = ids.shape[0], self.length
        end = start + steps
        if end > self.max_context:
            raise DFlashError(f"The context is full ({self.max_context} tokens).")
        positions = torch.arange(start, end, device=self.device)
        layer_ids = tuple(self.feature_layer_ids) if features else ()
        head_rows = steps if all_logits else 1
        if self.graphs is None or not all_logits or steps > GRAPH_MAX_STEPS:
            logits, feats = self.step(ids, positions, layer_ids, end, head_rows)
        else:
            span = cache_span(end, self.max_context)

            def step(step_ids: torch.Tensor, step_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
                return self.step(step_ids, step_positions, layer_ids, span, head_rows)

            logits, feats = self.graphs.run((steps, layer_ids, span, head_rows), step, ids, positions)
        self.length = end
        return TargetOutput(logits=logits, features=feats)

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, layer_ids: tuple[int, ...], span: int, head_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one forward, fixed-shape for CUDA graphs: write K/V at positions (all below span), attend to the first
        span cache positions under a position mask; return the logits of the last head_rows positions and the
        features. Leaves `length`."""
        mask = torch.arange(span, device=self.device)[None, :] <= positions[:, None]
        hidden, feats = self.model.run_layers(ids[None], positions[None], self.cache, positions, mask, layer_ids)
        return self.lm_head(hidden[0, -head_rows:]).float(), None if feats is None else feats[0]
