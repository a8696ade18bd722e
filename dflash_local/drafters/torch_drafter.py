"""The DFlash drafter: a few non-causal layers over the target's context features, plus its KV cache."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..cuda_graphs import StepGraphs, cache_span
from ..errors import DFlashError
from ..kernels import block_attention, visibility_mask
from ..layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, set_kernels
from ..quant import DRAFTER_QUANT_TYPES, check_quantize, quantized_linear
from ..runtime import LoadSpec, check_kernels, pick_dtype
from ..targets.base import Target
from ..weights import read_config, read_weights
from .base import DraftContext
from .config import DrafterConfig, check_fits


class DraftAttention(nn.Module):
    """Attention of block queries over [context K/V ; block K/V]; non-causal unless the layer says otherwise."""

    kernels: str = "auto"  # the kernel mode (layers.set_kernels)

    def __init__(self, cfg: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.dims.heads, cfg.dims.kv_heads, cfg.dims.head_dim
        self.q_proj = nn.Linear(cfg.dims.hidden, cfg.dims.heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.dims.hidden, cfg.dims.kv_heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.dims.hidden, cfg.dims.kv_heads * cfg.dims.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.dims.heads * cfg.dims.head_dim, cfg.dims.hidden, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.dims.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.dims.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_index] == "sliding_attention"
        self.is_causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.sliding_window = cfg.sliding_window if sliding else None

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V of shape [batch, kv_heads, len, head_dim] for x [batch, len, hidden]."""
        batch, steps, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def visibility(self, num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor | None:
        """Boolean mask for the last num_queries positions over num_keys keys, or None when all see all."""
        return visibility_mask(num_queries, num_keys, self.is_causal, self.sliding_window, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor | None = None,
        context_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block x [batch, steps, hidden] attends to [past K/V ; its own K/V]; mask defaults to the layer type's.

        context_len (fixed shapes): past K/V is the whole cache, of which the first context_len positions count.
        """
        batch, steps, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, steps, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        if mask is None:
            out = block_attention(
                q, past_k, past_v, k, v, self.is_causal, self.sliding_window, context_len, kernels=self.kernels
            )
        else:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            gqa = self.num_heads != self.num_kv_heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))


class DraftLayer(nn.Module):
    """Pre-norm layer; context K/V come from the projected target features, not from this layer's input."""

    def __init__(self, cfg: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_index)
        self.mlp = MLP(cfg.dims.hidden, cfg.dims.intermediate)
        self.input_layernorm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos, sin, past_k: torch.Tensor, past_v: torch.Tensor, mask=None, context_len=None
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, mask, context_len)
        normed, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(normed)


class DFlashModel(nn.Module):
    """The drafter's parameters, named exactly as in published checkpoints."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.dims.layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.dims.hidden, cfg.dims.hidden, bias=False)
        self.hidden_norm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.dims.hidden, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.raw, cfg.dims.head_dim), persistent=False)
        if cfg.draft_vocab_size:  # target id of each draft-head row
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(concatenated target features))."""
        return self.hidden_norm(self.fc(features))

    def logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """Borrowed LM head, then the optional output multiplier and logit softcap."""
        logits = lm_head(hidden).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class DFlashDrafter(DraftContext):
    """A loaded DFlash drafter with its context KV cache; proposes a block of tokens in one forward."""

    source = "dflash"

    def __init__(self, model: DFlashModel, max_context: int, cuda_graphs: bool = True, kernels: str = "auto") -> None:
        super().__init__()
        set_kernels(model, kernels)  # before any forward: a CUDA graph captures the kernels of its first run
        self.model = model
        self.cfg = model.cfg
        param = model.fc.weight
        self.device, self.dtype = param.device, param.dtype
        shape = (self.cfg.dims.layers, 1, self.cfg.dims.kv_heads, max_context, self.cfg.dims.head_dim)
        self.cache_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cache_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cache_owner: object | None = None  # the Session that last filled its cache
        self.graphs = StepGraphs() if cuda_graphs and self.device.type == "cuda" else None
        self._draft_head: tuple[int, torch.Tensor] | None = None  # (id of its target, the head's d2t rows)

    @classmethod
    def load(cls, folder: str | Path, spec: LoadSpec) -> DFlashDrafter:
        """Build the drafter from a published-layout folder (config.json + model.safetensors) as `spec` says, its
        cache spec.max_context long.

        spec.drafter_quantize="int8" or "nf4" makes its layers' linears 8- or 4-bit (see quant.py); drafts may change,
        output not. Unquantized in fp32 on the CPU, 16-bit stored linears run as quant.Fp16Linear (the same weights,
        faster). Its layers run kernels in spec.runtime.kernels' mode.
        """
        folder = Path(folder)
        runtime, max_context, quantize = spec.runtime, spec.max_context, spec.drafter_quantize
        device, cuda_graphs, kernels = runtime.device, runtime.cuda_graphs, runtime.kernels
        dtype = pick_dtype(runtime.dtype, device)
        check_kernels(kernels, device)
        check_quantize(quantize, DRAFTER_QUANT_TYPES)
        cfg = DrafterConfig.from_dict(read_config(folder), folder)
        if cfg.dflash2 is not None:
            raise DFlashError(
                f"{folder} is a DFlash2 drafter (local convolutions and a candidate selector), which runs only on "
                "llama.cpp's native drafter beside a GGUF target (--drafter-kind native), not on the torch drafter."
            )
        with torch.device("meta"):
            model = DFlashModel(cfg)
        expected = model.state_dict()
        # linears to quantize (or pack as fp16) are read as stored and converted as soon as read: never all held at
        # once, nor in dtype
        cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
        kind = quantize or ("fp16" if cpu_fp32 else None)
        unquantized = {f"layers.{n}" for n, m in model.layers.named_modules() if isinstance(m, nn.Linear) and kind}
        stored = frozenset(f"{owner}.weight" for owner in unquantized)
        tensors: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        for name, tensor in read_weights(folder, dtype, "cpu" if kind else device, stored):
            param = expected.get(name)
            if param is None and name.startswith("layers."):
                raise DFlashError(
                    f"{folder}: drafter tensor {name} belongs to a layer part this drafter does not have (attention "
                    "sinks, say), so it cannot draft as it was trained."
                )
            if param is None:
                continue
            if tensor.shape != param.shape:
                raise DFlashError(
                    f"{folder}: drafter tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(param.shape)}."
                )
            seen.add(name)
            owner, _, attr = name.rpartition(".")
            if owner not in unquantized:
                tensors[name] = tensor
                continue
            layer = model.get_submodule(owner)
            setattr(layer, attr, nn.Parameter(tensor, requires_grad=False))
            if not any(p.is_meta for p in layer.parameters()):
                model.set_submodule(owner, quantized_linear(layer, kind, dtype, device))
                unquantized.discard(owner)
        missing = [name for name in expected if name not in seen]
        if missing:
            raise DFlashError(f"{folder} lacks the drafter tensor {missing[0]}.")
        model.load_state_dict(tensors, assign=True, strict=False)
        model.inv_freq = rope_inv_freq(cfg.raw, cfg.dims.head_dim).to("cpu" if kind else device)
        model.to(device)
        return cls(model.eval(), max_context, cuda_graphs, kernels)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.cfg.target_layer_ids

    def check_target(self, target: Target) -> None:
        """Raise a DFlashError if this drafter cannot work with the target."""
        check_fits(self.cfg, target)
        if self.cache_k.shape[3] < target.max_context:
            raise DFlashError("The drafter's cache is shorter than the target's context.")
        if self.cfg.draft_vocab_size and (self._draft_head is None or self._draft_head[0] != id(target)):
            self._draft_head = (id(target), target.head_rows(self.model.d2t).to(self.device, self.dtype))

    def draft_logits(self, hidden: torch.Tensor, target: Target) -> torch.Tensor:
        """Logits over the target's vocabulary: from its head, or from the draft vocabulary's rows of it (every other
        id at -inf: never drafted, and of probability 0 for rejection sampling)."""
        if self._draft_head is None:
            return self.model.logits(hidden, target.lm_head)
        head = self._draft_head[1]
        rows = self.model.logits(hidden, lambda h: h.to(head.dtype) @ head.T)
        full = rows.new_full((rows.shape[0], target.vocab_size), float("-inf"))
        return full.index_copy_(1, self.model.d2t, rows)

    def _save_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the cached context K/V up to length."""
        return self.cache_k[..., : self.length, :].clone(), self.cache_v[..., : self.length, :].clone()

    def _load_cache(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Hold saved context K/V again."""
        for cache, saved in zip((self.cache_k, self.cache_v), state, strict=True):
            cache[..., : saved.shape[-2], :] = saved

    @torch.inference_mode()
    def propose(
        self,
        target: Target,
        new_features: torch.Tensor,
        tokens: list[int],
        start: int,
        size: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Cache the features of positions [length, start) (those held, then new_features); draft [tokens[start], MASK
        x size-1] at start and return the logits of its first `rows` drafted positions (default all size-1): the LM
        head runs on those rows only.

        Runs `step`: eagerly over exactly the cached context, or on CUDA, for steps with at most `size` new positions,
        as a replayed graph over a power-of-two span of the cache (the head on all size-1 rows, one graph per size).
        """
        rows = size - 1 if rows is None else rows
        new_features = self._take(new_features, start)
        if new_features is None:
            new_features = torch.zeros(0, self.model.fc.in_features, dtype=self.dtype, device=self.device)
        num_new = new_features.shape[0]
        block_ids = torch.full((size,), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[0] = tokens[start]
        block_positions = torch.arange(start, start + size, device=self.device)
        if self.graphs is None or num_new > size:
            context_positions = torch.arange(self.length, start, device=self.device)
            features = new_features.to(self.dtype)
            logits = self.step(target, features, block_ids, context_positions, block_positions, None, start, rows)
        else:
            features = torch.zeros(size, new_features.shape[1], dtype=self.dtype, device=self.device)
            features[:num_new] = new_features
            capacity = self.cache_k.shape[3]
            # Rows past the new ones land at or after start (clamped into the cache), where nothing reads them.
            context_positions = (self.length + torch.arange(size, device=self.device)).clamp_max(capacity - 1)
            context_len = torch.tensor([start], device=self.device)
            span = cache_span(start, capacity)

            def step(*inputs: torch.Tensor) -> tuple[torch.Tensor]:
                return (self.step(target, *inputs, span, size - 1),)

            key = (size, id(target), span)
            inputs = (features, block_ids, context_positions, block_positions, context_len)
            logits = self.graphs.run(key, step, *inputs)[0][:rows]
        self.length = start
        return logits

    def step(
        self,
        target: Target,
        features: torch.Tensor,
        block_ids: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        context_len: torch.Tensor | None,
        span: int,
        rows: int,
    ) -> torch.Tensor:
        """The one drafter step, fixed-shape for CUDA graphs: cache the projected features at context_positions, draft
        block_ids at block_positions against the first span cache positions (of which the first context_len count;
        None: all), return the logits of drafted rows 1..rows. Leaves `length`."""
        model = self.model
        cos_c, sin_c = (t[None, None] for t in rope_cos_sin(model.inv_freq, context_positions, self.dtype))
        cos_b, sin_b = (t[None, None] for t in rope_cos_sin(model.inv_freq, block_positions, self.dtype))
        context = model.project_context(features)[None]
        x = target.embed(block_ids).to(self.dtype)[None] * self.cfg.input_embedding_scale
        for index, layer in enumerate(model.layers):
            k, v = layer.self_attn.key_value(context, cos_c, sin_c)
            cache_k, cache_v = self.cache_k[index], self.cache_v[index]
            cache_k.index_copy_(2, context_positions, k)
            cache_v.index_copy_(2, context_positions, v)
            x = layer(x, cos_b, sin_b, cache_k[:, :, :span], cache_v[:, :, :span], context_len=context_len)
        return self.draft_logits(model.norm(x[0, 1 : rows + 1]), target)
