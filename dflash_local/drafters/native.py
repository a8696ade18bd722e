"""llama.cpp's own DFlash drafter (GGUF architecture `dflash`) beside a GGUF target, fed through llama_process.

The published-layout drafter folder is written once per (drafter, target) pair to a `dflash` GGUF in dflash's
state folder and loaded into a llama.cpp context whose ctx_other is the target's, so it borrows the target's
embeddings and head. Accepted context features go in as embedding batches (llama.cpp projects them and fills the
draft KV cache); the noise block goes in as tokens with non-causal attention.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import DFlashError
from ..gguf.file import read_header
from ..gguf.shape import LAYER_TENSORS, add_shape, rope_factors
from ..kv_cache import KVCache
from ..llama_context import LlamaContext, load_model
from ..llama_lib import dflash2_functions, llama_cpp
from ..offload import Placement
from ..paths import files_identity, identity_key, state_dir
from ..runtime import LoadSpec
from ..targets.llamacpp import BATCH, LlamaCppTarget, context_params, model_params
from ..weights import load_weights, read_config
from .base import DraftContext
from .config import DrafterConfig, check_fits
from .gguf_drafter import gguf_drafter_config, is_drafter_gguf

CACHE_FORMAT = 2  # part of the cache key: bump when write_drafter_gguf writes something different
CACHE_KEY_FIELD = "dflash_local.cache_key"
# DFlash2's tensors (a folder's names, z-lab's layout: no "model." prefix) and llama.cpp's names for them (gguf-py's
# tensor map, as its converter writes them)
DFLASH2_TENSORS = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
DFLASH2_LAYER_TENSORS = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
)


def _copy_tokenizer(writer: gguf.GGUFWriter, target: LlamaCppTarget) -> None:
    """The target's vocabulary metadata (llama.cpp loads a vocabulary for every model)."""
    fields = read_header(target.info.path, strings=_TOKENIZER_KEYS).fields
    for key in _TOKENIZER_KEYS:
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))


def write_drafter_gguf(folder: Path, cfg: DrafterConfig, target: LlamaCppTarget, out: Path, key: str | None) -> None:
    """A published-layout drafter as a `dflash` GGUF whose target_layers are llama.cpp tap ids (id + 1), its sliding
    layers' window and pattern as llama.cpp's converter writes them, stamped with its cache key (None: an exported
    file, unstamped): matrices F16 but fc,
    which takes the target's raw features, F32 (llama.cpp's CPU matmul rounds an F16 weight's activations to F16,
    and Gemma's features exceed its range: seen 1.0e5), norms F32."""
    refusal = cfg.native_refusal()
    if refusal is not None:
        raise DFlashError(f"{folder}: {refusal}; use --drafter-kind torch.")
    sliding = [kind == "sliding_attention" for kind in cfg.layer_types]
    weights = load_weights(folder, None, "cpu")
    writer = gguf.GGUFWriter(str(out), "dflash")
    if key is not None:
        writer.add_string(CACHE_KEY_FIELD, key)
    add_shape(writer, cfg, int(cfg.raw.get("max_position_embeddings", 4096)))
    writer.add_uint32("dflash.block_size", cfg.block_size)
    for name, value in (cfg.dflash2 or {}).items():  # DFlash2's convolutions and selector, as llama.cpp's converter
        writer.add_uint32(f"dflash.{name}", value)
    if any(sliding):
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern(sliding)
    writer.add_array("dflash.target_layers", [i + 1 for i in cfg.target_layer_ids])
    if cfg.input_embedding_scale != 1.0:
        writer.add_float32("dflash.embedding_scale", cfg.input_embedding_scale)
    _copy_tokenizer(writer, target)
    writer.add_mask_token_id(cfg.mask_token_id)
    names = {
        "fc.weight": "fc.weight",
        "hidden_norm.weight": "enc.output_norm.weight",
        "norm.weight": "output_norm.weight",
    }
    d2t = weights.pop("d2t", None)
    if d2t is not None:  # llama.cpp's reduced draft vocabulary: its own head, the target's rows for d2t
        writer.add_tensor("d2t", d2t.to(torch.int64).numpy())
        writer.add_tensor("output.weight", target.head_rows(d2t).to(torch.float16).cpu().numpy())
    layer_names = LAYER_TENSORS
    if cfg.dflash2 is not None:  # DFlash2's convolutions and selector besides
        names, layer_names = names | DFLASH2_TENSORS, layer_names | DFLASH2_LAYER_TENSORS
    for name, tensor in weights.items():
        array = tensor.to(torch.float16 if tensor.dim() == 2 and name != "fc.weight" else torch.float32).numpy()
        if name in names:
            writer.add_tensor(names[name], array)
        elif name.startswith("layers.") and name.split(".", 2)[2] in layer_names:
            index, rest = name.split(".", 2)[1:]
            writer.add_tensor(f"blk.{index}.{layer_names[rest]}", array)
        else:
            raise DFlashError(f"{folder}: drafter tensor {name} has no llama.cpp counterpart.")
    factors = rope_factors(cfg.raw, cfg.dims.head_dim)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _holds(path: Path, key: str) -> bool:
    """Whether path is a whole drafter GGUF written under this cache key (llama.cpp may abort on a broken one)."""
    try:
        return read_header(path).fields.get(CACHE_KEY_FIELD) == key
    except (ValueError, KeyError, OSError):
        return False


def cached_drafter_gguf(folder: Path, cfg: DrafterConfig, target: LlamaCppTarget) -> Path:
    """The drafter's GGUF for this target in dflash's state folder, one file per pair of paths: written (atomically)
    on first use, reused while neither model's files change, rewritten when they do or when it is broken."""
    place = identity_key({"drafter": str(folder.resolve()), "target": str(target.info.path.resolve())})
    identity = {"drafter": files_identity(folder), "target": files_identity(target.info.path), "format": CACHE_FORMAT}
    key = identity_key(identity)
    path = state_dir() / "native-drafters" / f"{place}.gguf"
    if _holds(path, key):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        write_drafter_gguf(folder, cfg, target, partial, key)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return path


class NativeDrafter(DraftContext):
    """The Drafter interface (drafters.base) over a llama.cpp `dflash` context tied to one GGUF target."""

    source = "dflash"

    def __init__(self, cfg: DrafterConfig, context: LlamaContext, target: LlamaCppTarget) -> None:
        super().__init__()
        self.cfg, self.target = cfg, target
        self.context = context  # llama.cpp's dflash context and model, reading the target's context
        self.cache_owner: object | None = None  # the Session that last filled its cache
        self.selector_top_k = 0  # a DFlash2 drafter's candidates per row (0: a DFlash drafter, drafting by logits)
        self.seq = 0  # its llama.cpp sequence id (serve --parallel: one view per sequence, see `sequence`)

    def sequence(self, seq: int, target: LlamaCppTarget) -> NativeDrafter:
        """A view of this drafter for llama.cpp sequence `seq` beside target's view of it (its own length, held
        features and cache, empty), sharing the context; its proposals run one sequence at a time."""
        view = copy.copy(self)
        view.seq, view.target, view.cache_owner = seq, target, None
        view.length, view._held = 0, []
        return view

    @classmethod
    def load(cls, folder: str | Path, target: LlamaCppTarget, spec: LoadSpec) -> NativeDrafter:
        """Load beside `target`, on spec's CPU threads, a drafter GGUF as llama.cpp's converter writes it, as it is,
        or a drafter folder's cached GGUF (written on first use)."""
        folder = Path(folder)
        made = is_drafter_gguf(folder)
        cfg = gguf_drafter_config(folder) if made else DrafterConfig.from_dict(read_config(folder), folder)
        if not isinstance(target, LlamaCppTarget):
            raise DFlashError("The native llama.cpp drafter needs a GGUF target (the llamacpp backend).")
        check_fits(cfg, target)
        path = folder if made else cached_drafter_gguf(folder, cfg, target)
        placement = spec.placement or Placement()  # every drafter layer on the target's device, if it has one
        # -1: all layers. Its cache stays f16 whatever the target's (--cache-type): the features it attends to as it was
        # trained, about a seventh of the target's cache at real sizes (5 of 36 layers), and drafts decide no output
        on_device = replace(spec, placement=replace(placement, gpu_layers=-1, cpu_moe=False), kv_cache=KVCache())
        model = load_model(path, model_params(on_device).params, f"the drafter {folder}")
        params = context_params(on_device, target.max_context)
        context = LlamaContext(model, params, "the drafter context", other=target.context)
        ctx = context.ctx
        llama_cpp.llama_set_causal_attn(ctx, bool(cfg.is_causal))  # a GGUF may say causal; drafters are not
        drafter = cls(cfg, context, target)
        if cfg.dflash2 is not None:
            top_k, set_nextn, drafter._get_lattice = dflash2_functions()
            drafter.selector_top_k = top_k(model)
            if drafter.selector_top_k != cfg.dflash2["selector_top_k"]:
                raise DFlashError(f"llama.cpp did not load the DFlash2 drafter {folder} with its candidate selector.")
            set_nextn(ctx, True, False)  # every block row's lattice, not only output rows' (as llama.cpp's own loop)
        return drafter

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.cfg.target_layer_ids

    def check_target(self, target) -> None:
        """Raise a DFlashError unless target is the GGUF target this drafter was loaded beside and fits it."""
        if target is not self.target:
            raise DFlashError("The native llama.cpp drafter serves only the GGUF target it was loaded with.")
        check_fits(self.cfg, target)
        target.set_feature_layers(self.cfg.target_layer_ids)

    def _cut(self, length: int) -> None:
        """Cut the draft KV cache to `length` positions: llama.cpp's cells at the next propose, all of them now at 0."""
        if length == 0:
            self.context.clear(self.seq)
        self.length = length

    def _save_cache(self) -> bytearray:
        """The draft KV cache's state."""
        return self.context.save(self.seq)

    def _load_cache(self, state: bytearray) -> None:
        """Hold a saved draft KV cache again."""
        self.context.load(state, self.seq)

    def _add(self, index: int, position: int) -> None:
        if index < 0:
            raise DFlashError("llama.cpp's drafter batch is full.")
        pos = llama_cpp.llama_pos(position)
        llama_cpp.llama_batch_ext_set_pos(self.context.batch, index, ctypes.byref(pos))

    def _inject(self, features: np.ndarray, start: int) -> None:
        """Append context features for positions start.. to the draft KV cache."""
        width, batch = features.shape[1], self.context.batch
        for offset in range(0, features.shape[0], BATCH):
            chunk = np.ascontiguousarray(features[offset : offset + BATCH], dtype=np.float32)
            llama_cpp.llama_batch_ext_clear(batch)
            base = chunk.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            for row in range(chunk.shape[0]):
                row_ptr = ctypes.cast(ctypes.addressof(base.contents) + row * width * 4, ctypes.POINTER(ctypes.c_float))
                embd = llama_cpp.llama_embd(row_ptr, 1, width)
                self._add(llama_cpp.llama_batch_ext_add_embd(batch, self.seq, embd), start + offset + row)
            self.context.process()

    def propose(
        self,
        target,
        new_features: torch.Tensor | None,
        tokens: list[int],
        start: int,
        size: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Cache the features of positions [length, start) (those held, then new_features); draft [tokens[start], MASK
        x size-1] at start and return the logits of its first `rows` drafted positions (default all size-1).
        llama.cpp's dflash graph computes the head on every row (it has no output pruning) and hands back the first
        n_outputs rows, so the batch flags rows 0..rows as outputs: a smaller `rows` saves the copy, not the compute."""
        rows = size - 1 if rows is None else rows
        if self.selector_top_k and size > self.block_size:  # llama.cpp's selector scores the trained block only
            raise ValueError(f"a DFlash2 block holds at most {self.block_size} tokens, got {size}")
        new_features = self._take(new_features, start)
        with self.context.lock:  # the context's batch and outputs, which other sequences' views share
            self.context.trim(self.length, self.seq)
            if new_features is not None:
                self._inject(new_features.float().cpu().numpy(), self.length)
            batch = self.context.batch
            llama_cpp.llama_batch_ext_clear(batch)
            for index in range(size):
                token = tokens[start] if index == 0 else self.cfg.mask_token_id
                slot = llama_cpp.llama_batch_ext_add_token(batch, self.seq, token)
                self._add(slot, start + index)
                # DFlash2 reads no logits: its selector's lattice comes from the nextn rows of every block position
                llama_cpp.llama_batch_ext_set_output_logits(batch, slot, index <= rows and not self.selector_top_k)
            self.context.process()
            self.length = start
            vocab = target.vocab_size
            if self.selector_top_k:
                return self._walked(rows, size, vocab, target.device)
            drafted = np.stack(
                [
                    np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.context.ctx, i), shape=(vocab,))
                    for i in range(1, rows + 1)
                ]
            )
        logits = torch.from_numpy(drafted).to(target.device) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        # ids outside a reduced draft vocabulary come at -inf and stay there, as in the torch drafter
        return torch.where(logits.isinf(), logits, torch.tanh(logits / cap) * cap) if cap else logits

    def _walked(self, rows: int, size: int, vocab: int, device: torch.device) -> torch.Tensor:
        """A DFlash2 block's drafts as rows of scores, 0 at the drafted id and -inf elsewhere (a point mass: argmax
        and rejection sampling keep them exact), walked over its selector's lattice as llama.cpp's loop walks it.
        Row i of the lattice holds row i's top_k candidate ids (as floats), then a top_k x top_k matrix whose row p
        scores each candidate after candidate p of row i-1; row 1 starts from row 0, and each row's pick is the
        argmax of its predecessor's scores (llama.cpp stops early only under a p_min, which dflash does not set)."""
        top_k = self.selector_top_k
        width = self.cfg.dims.hidden
        lattice = np.ctypeslib.as_array(self._get_lattice(self.context.ctx), shape=(size * width,)).reshape(size, width)
        scores = torch.full((rows, vocab), float("-inf"), device=device)
        predecessor = 0
        for row in range(1, rows + 1):
            following = lattice[row, top_k + predecessor * top_k : top_k + (predecessor + 1) * top_k]
            predecessor = int(np.argmax(following))
            scores[row - 1, int(lattice[row, predecessor])] = 0.0
        return scores
