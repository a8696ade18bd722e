"""GGUF target through llama-cpp-python: llama.cpp runs the model, its layer-input taps give the features."""

from __future__ import annotations

import copy
import ctypes
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import DFlashError
from ..gguf.file import GGUFModel, read_gguf
from ..llama_context import LlamaContext, load_model
from ..llama_lib import llama_cpp, output_functions, tap_functions
from ..offload import ModelParams, Placement
from ..runtime import LoadSpec, pick_dtype
from ..tap_probe import layer_taps
from .base import TargetOutput
from .gguf_rows import GGUFRows

if TYPE_CHECKING:
    from ..lanes import Lanes

BATCH = 512
STATE_SNAPSHOTS = 16  # per-token recurrent-state snapshots llama.cpp keeps for a hybrid target: the most positions
# one rollback can drop without re-feeding (a verify of up to 17 tokens); llama.cpp keeps none for a plain target
FIXED_ROWS = 8  # a verify forward's rows on a GPU backend: every verify and every plain step runs as forwards of
# exactly this many rows (padded past the block, the padding dropped after), so that a row meets the same kernels (GPU
# backends choose matrix and attention kernels by row count) and the same KV cell count in plain decoding as in DFlash;
# 8 is the widest batch llama.cpp's CUDA and Vulkan matrix-vector kernels take, where 8 rows cost about what one does.
# A hybrid's padding leaves its recurrent state until the next trim or forward, which drops it and any rejected
# rows in one step through llama.cpp's snapshots (it takes back one suffix per decode, within that decode)
VERIFY_ROWS = 63  # the most rows of a CPU forward whose every row's logits are read (a verify): dflash's libllama
# takes the fast kernels for batches of 64 rows or more, all rows but the last (tools/patch_ggml_cpu.py)


def model_params(spec: LoadSpec | None = None) -> ModelParams:
    """llama.cpp's model parameters for a target or its native drafter: the planned placement (the CPU alone where
    none was planned), the CPU's weights unrepacked."""
    params = ModelParams(spec.placement if spec and spec.placement else Placement(), llama_cpp)
    # Read into llama.cpp's own buffers (memory-mapped weights that llama.cpp repacked would count twice).
    params.params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    # No repacking for the CPU's kernels (Q4_0 and Q4_K on AVX2): repacked Q4_K computes a batch (gemm) and one
    # token (gemv) in different orders, so verification would not be batch-invariant.
    params.params.use_extra_bufts = False
    params.params.load_mtp = spec is not None and spec.mtp  # the MTP (nextn) layers, for drafters.mtp
    return params


def context_params(spec: LoadSpec, context: int) -> llama_cpp.llama_context_params:
    """llama.cpp's context parameters shared by a target and its drafters: the context (for each of spec.sequences
    sequences, each in its own KV cells: kv_unified stays off), batch, threads and the KV cache's types (flash
    attention stays llama.cpp's auto, which it turns on for a quantized V cache); on the CPU alone, no operation is
    sent to a GPU the library may offer (the CPU's kernels decide every bit)."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = context * spec.sequences, BATCH, BATCH
    params.n_seq_max, params.kv_unified = spec.sequences, False
    params.n_threads = params.n_threads_batch = spec.runtime.threads or torch.get_num_threads()
    params.op_offload = spec.placement is not None and spec.placement.device is not None
    cache = spec.kv_cache
    params.type_k, params.type_v = (getattr(llama_cpp, f"GGML_TYPE_{kind.upper()}") for kind in (cache.k, cache.v))
    return params


class LlamaCppTarget:
    """A llama.cpp context over a GGUF file; the torch drafter borrows its embeddings and head from the file
    (`rows`: nothing is dequantized at load). The native drafter reads both inside llama.cpp and uses neither."""

    def __init__(
        self,
        info: GGUFModel,
        tensors: dict,
        context: LlamaContext,
        max_context: int,
        dtype: torch.dtype,
        device: str,
        kernels: str = "auto",
    ) -> None:
        self.info = info
        self.context = context  # llama.cpp's context and model (a drafter's context reads it, a tokenizer the model)
        self._set_tap, self._get_tap = tap_functions()
        self._logits_at, self._embeddings_at = output_functions()
        self._views: dict[tuple[int, int, int], np.ndarray] = {}
        self.device, self.dtype = torch.device(device), dtype
        self.rows = GGUFRows(tensors, info.dims.hidden, info.dims.vocab, dtype, self.device)  # for a torch drafter
        self.max_context = max_context
        self.kernels = kernels  # the mode it was loaded with (llama.cpp runs the model itself)
        self.length = 0
        model = context.model
        self.recurrent = llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        self.window = 0  # a sliding window whose window-sized cache reuses cells (0: every position's cells kept)
        self._fed: list[int] = []  # the cached tokens (-1: an image's row), re-fed where the cells cannot roll back
        self._last_decode = 0  # tokens in llama.cpp's last decode since the last trim
        self._padding = 0  # padding cells past `length` that a hybrid's last forward left in llama.cpp's memory
        self.cache_owner: object | None = None  # the Session that last filled its cache
        self.feature_layer_ids: list[int] = []
        self.seq = 0  # its llama.cpp sequence id (serve --parallel: one view per sequence, see `sequence`)
        self.lanes: Lanes | None = None  # where sequences sharing the context meet to decode together
        self.fixed_rows: int | None = None  # FIXED_ROWS where verification runs on a GPU backend, else any width
        self.verify_rows: int | None = None  # the decode loop's verify forwards' most rows (see targets.base)
        self.on_gpu = False  # some of its layers run on a GPU backend
        self.with_mtp = False  # llama.cpp loaded its MTP layers (an MTP context can draft beside it)

    @classmethod
    def load(cls, path: str | Path, spec: LoadSpec) -> LlamaCppTarget:
        """Validate the GGUF file's header, then load it into llama.cpp as `spec` says (all layers on the GPU for cuda);
        its kernel mode is recorded for the decode loop (greedy acceptance reads llama.cpp's argmax, so no kernel
        runs); spec.int8_head (planned): the head a torch drafter borrows as packed int8 rows (on the CPU faster than
        fp32, a quarter of the size)."""
        runtime, max_context = spec.runtime, spec.max_context
        device, kernels = runtime.device, runtime.kernels
        dtype = pick_dtype(runtime.dtype, device)
        info = read_gguf(Path(path))
        tensors = {name: t for name, t in info.tensors.items() if name in ("token_embd.weight", "output.weight")}
        if "token_embd.weight" not in tensors:
            raise DFlashError(f"{path} lacks the tensor token_embd.weight.")
        model = load_model(Path(path), model_params(spec).params, str(path))
        max_context = min(max_context, info.context_length)
        params = context_params(spec, max_context)
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # per-token output embeddings (last-layer features)
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            params.n_rs_seq = STATE_SNAPSHOTS  # llama.cpp sets 0 for architectures it cannot roll back
        # sliding-window layers keep a window-sized cache, as llama-server's (llama.cpp's default is full-size): a
        # verify and its trim leave the cells where one-token steps put them (docs/gguf.md)
        params.swa_full = False
        context = LlamaContext(model, params, f"a {max_context}-token context for {path}", rows=BATCH)
        target = cls(info, tensors, context, max_context, dtype, device, kernels)
        target.window = max(llama_cpp.llama_model_n_swa(model), 0)
        target.rows.int8_head = spec.int8_head
        on_gpu = spec.placement is not None and spec.placement.device is not None and spec.placement.gpu_layers > 0
        target.fixed_rows = FIXED_ROWS if on_gpu else None
        target.verify_rows = target.fixed_rows
        target.on_gpu = on_gpu
        target.with_mtp = spec.mtp
        return target

    @property
    def vocab_size(self) -> int:
        return self.info.dims.vocab

    @property
    def hidden_size(self) -> int:
        return self.info.dims.hidden

    @property
    def num_layers(self) -> int:
        return self.info.dims.layers

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.info.eos_ids

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Tap llama.cpp's input of layer id + 1 (= HF output of layer id) in the forwards that want features; the
        last layer's is the final-normed hidden state, read as llama.cpp's output embeddings (which makes every
        position an output). Switching taps makes llama.cpp's next decode re-plan its graph: only forward switches."""
        arch, name = self.info.architecture, self.info.path.name
        taps = layer_taps(self.info.path, arch)
        if not taps.layers:
            hint = ", and tools/build_libllama.sh (run by install.sh) builds a libllama that reads gemma3's"
            raise DFlashError(
                f"{name} holds a '{arch}' model, whose layer features this libllama does not read, so DFlash cannot "
                f"draft for it; plain decoding works (--no-draft){hint if arch == 'gemma3' else ''}."
            )
        if self.recurrent and llama_cpp.llama_n_rs_seq(self.context.ctx) == 0:
            raise DFlashError(
                f"{name} holds a '{arch}' model, whose recurrent state llama.cpp cannot roll back to the accepted "
                "tokens, so DFlash cannot draft for it; plain decoding works (--no-draft)."
            )
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(f"The GGUF target has {self.num_layers} layers, so it has no layer {bad[0]} to read.")
        if self.num_layers - 1 in layer_ids and not taps.last_layer:
            raise DFlashError(
                f"{name} holds a '{arch}' model, whose llama.cpp graph computes no logits while it hands out the last "
                f"layer's output, so a drafter cannot read layer {self.num_layers - 1}; use one whose target layers "
                "end before it, or plain decoding (--no-draft)."
            )
        if list(layer_ids) != self.feature_layer_ids:
            self._set_tapping(False)
            self.feature_layer_ids = list(layer_ids)

    def _set_tapping(self, on: bool) -> None:
        """Have llama.cpp keep the feature layers' rows from the next decode on, or not (a decode without them
        costs a few percent less on a small model)."""
        last = self.num_layers - 1
        with self.context.lock:  # other sequences' threads share the context (serve --parallel)
            if on == self.context.tapping:
                return
            for layer in self.feature_layer_ids:
                if layer != last:
                    self._set_tap(self.context.ctx, layer + 1, on)
            llama_cpp.llama_set_embeddings(self.context.ctx, on and last in self.feature_layer_ids)
            self.context.tapping = on

    def sequence(self, seq: int, lanes: Lanes) -> LlamaCppTarget:
        """A view of this target for llama.cpp sequence `seq` (its own length and cache, empty), sharing the context,
        whose forwards meet the other sequences' at `lanes` (one llama_decode for every sequence's rows)."""
        view = copy.copy(self)
        view.seq, view.lanes, view.cache_owner = seq, lanes, None
        view.length = view._last_decode = view._padding = 0
        view._fed, view.feature_layer_ids = [], list(self.feature_layer_ids)
        return view

    @property
    def trim_floor(self) -> int:
        """The shortest length `trim` keeps without feeding the kept tokens again: all cached positions for a recurrent
        state; with a window-sized cache, the first length whose next position finds its whole window (cells of older
        positions were reused); else 0."""
        if self.recurrent:
            return self.length
        first = self.context.first_position(self.seq) if self.window and self.length else 0
        return first + self.window - 1 if first > 0 else 0

    def trim(self, length: int) -> None:
        """Forget every cached position at or after `length` (0: every cell), and a hybrid's padding cells past the
        end. A recurrent state goes back through llama.cpp's per-token snapshots (the last STATE_SNAPSHOTS positions,
        once per decode); further back, or below a window-sized cache's trim_floor, the kept tokens are fed again from
        an empty state."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim the cache to {length} from {self.length}")
        if length == 0:
            self.context.clear(self.seq)
            self.length = self._last_decode = self._padding = 0
            self._fed.clear()
            return
        dropped = self.length + self._padding - length
        self._padding = 0
        if dropped:
            self._drop(length, dropped)
        self.length = length
        del self._fed[length:]

    def _drop(self, length: int, dropped: int) -> None:
        """Drop the `dropped` cells llama.cpp holds from `length` on. llama.cpp's snapshots hold the states inside
        its last decode only (dropping all of it would leave its end), one rollback per decode."""
        snapshot = dropped < self._last_decode
        refeed = not snapshot if self.recurrent else length < self.trim_floor
        self._last_decode = 0
        if refeed:
            self._refeed(self._fed[:length])
        elif not self.context.trim(length, self.seq):
            if not self.recurrent:
                raise DFlashError("llama.cpp could not roll its KV cache back.")
            self._refeed(self._fed[:length])

    def _refeed(self, tokens: list[int]) -> None:
        """Empty the sequence's cache and feed it tokens for their state alone (the last logits row only; the taps stay
        as they are, since switching them makes llama.cpp re-plan its next graph). Image rows cannot be fed again."""
        if any(token < 0 for token in tokens):
            raise DFlashError("The cache cannot roll back past an image's rows: they would have to be fed again.")
        self.context.clear(self.seq)
        self._last_decode = 0
        for offset in range(0, len(tokens), BATCH):
            self._decode(tokens[offset : offset + BATCH], offset, all_logits=False)
        self._fed[:] = tokens

    def save_state(self) -> bytearray:
        """The cached positions' state (KV cells, a recurrent state), for load_state (the prompt cache)."""
        if self._padding:
            self.trim(self.length)
        return self.context.save(self.seq)

    def load_state(self, state: bytearray, tokens: list[int]) -> None:
        """Hold a saved state again: the cache of `tokens` (as save_state gave it)."""
        self.context.load(state, self.seq)
        self.length, self._last_decode, self._padding = len(tokens), 0, 0
        self._fed[:] = tokens

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.embed(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rows.lm_head(hidden)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.head_rows(ids)

    def _decode(self, ids: list[int], start: int, all_logits: bool) -> None:
        last = len(ids) - 1
        rows = [(self.seq, start + index, token, all_logits or index == last) for index, token in enumerate(ids)]
        self.context.decode(rows)
        self._last_decode = len(ids)

    def forward_embeddings(self, rows: np.ndarray, non_causal: bool, features: bool = True) -> TargetOutput:
        """Append embedding rows (an image's, from dflash_local.vision) at the cache end as prompt rows, in one batch
        that attends both ways inside it where non_causal (as llama.cpp's mtmd helper feeds Gemma 3's images); return
        the last row's logits and, as `forward`, the rows' tapped features."""
        count, start = len(rows), self.length
        if start + count > self.max_context:
            raise DFlashError(f"The context is full ({self.max_context} tokens).")
        if count > BATCH or self.recurrent:
            raise DFlashError("This target takes no image rows (a recurrent state, or more rows than one batch).")
        features = features and bool(self.feature_layer_ids)
        if self._padding:
            self.trim(start)
        self._set_tapping(features)
        every_output = features and self.num_layers - 1 in self.feature_layer_ids
        data = np.ascontiguousarray(rows, dtype=np.float32)
        ctx, width = self.context.ctx, data.shape[1]
        batch = llama_cpp.llama_batch_ext_init(ctx)
        llama_cpp.llama_set_causal_attn(ctx, not non_causal)
        try:
            for index in range(count):
                row = ctypes.cast(data.ctypes.data + index * width * 4, ctypes.POINTER(ctypes.c_float))
                at = llama_cpp.llama_batch_ext_add_embd(batch, 0, llama_cpp.llama_embd(row, 1, width))
                llama_cpp.llama_batch_ext_set_pos(batch, at, ctypes.byref(llama_cpp.llama_pos(start + index)))
                llama_cpp.llama_batch_ext_set_output_logits(batch, at, every_output or index == count - 1)
            status = llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        finally:
            llama_cpp.llama_set_causal_attn(ctx, True)
            llama_cpp.llama_batch_ext_free(batch)
        if status != 0:
            raise DFlashError(f"llama.cpp failed to evaluate an image's rows (status {status}).")
        self._last_decode = count
        logits = self._view(self._logits_at(ctx), count if every_output else 1, self.vocab_size)[-1:].copy()
        feats = None
        if features:
            joined = np.concatenate([self._features(i, count) for i in self.feature_layer_ids], axis=1)
            feats = torch.from_numpy(joined).to(self.device, self.dtype)
        self.length = start + count
        self._fed.extend([-1] * count)
        return TargetOutput(torch.from_numpy(logits).to(self.device), feats)

    def _view(self, address: int | None, rows: int, width: int) -> np.ndarray:
        """llama.cpp's float rows at address, in place (valid until its next decode). Views are kept per address:
        llama.cpp reuses its output buffers, and making a view costs more than a small model's decode step."""
        key = (address or 0, rows, width)
        view = self._views.get(key)
        if view is None:
            if not address:
                raise DFlashError("llama.cpp returned no output rows for the batch.")
            if len(self._views) >= 256:
                self._views.clear()
            floats = (ctypes.c_float * (rows * width)).from_address(address)
            view = self._views[key] = np.frombuffer(floats, dtype=np.float32).reshape(rows, width)
        return view

    def _features(self, layer: int, rows: int) -> np.ndarray:
        """HF hidden_states[layer + 1] for the last decoded rows, in place."""
        if layer == self.num_layers - 1:
            return self._view(self._embeddings_at(self.context.ctx), rows, self.hidden_size)
        return self._view(self._get_tap(self.context.ctx, layer + 1), rows, self.hidden_size)

    def _chunk(
        self, chunk: list[int], padding: int, start: int, wants: tuple[bool, bool, bool, bool]
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Decode one chunk at start (and `padding` copies of its last token past it); read its logits and features
        as `_read` says (wants: all_logits, wanted, greedy, features). Alone, or with lanes: a verify chunk in one
        llama_decode with the other sequences' verify rows, a prompt chunk in one of its own."""
        all_logits, features = wants[0], wants[3]
        if self.lanes is not None and all_logits:
            self._last_decode = len(chunk)
            read = partial(self._read, wants)
            return self.lanes.together(self.seq, (start, chunk), features, self._set_tapping, read)

        def alone() -> tuple[np.ndarray | None, np.ndarray | None]:
            self._set_tapping(features)
            self._decode(chunk + chunk[-1:] * padding, start, all_logits)
            every_output = features and self.num_layers - 1 in self.feature_layer_ids
            outputs = len(chunk) + padding if all_logits or every_output else 1
            return self._read(wants, slice(0, len(chunk)), outputs)

        return alone() if self.lanes is None else self.lanes.alone(self.seq, alone)

    def _read(
        self, wants: tuple[bool, bool, bool, bool], rows: slice, outputs: int
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The last decode's logits for the batch rows `rows` (all of them with all_logits, else the last output row;
        each row's argmax with greedy; None unless wanted) and the rows' features (None unless features), as copies;
        `outputs`: the decode's output rows (every row where they are read by batch row)."""
        all_logits, wanted, greedy, features = wants
        ctx, logits, feats = self.context.ctx, None, None
        if wanted:
            view = self._view(self._logits_at(ctx), outputs, self.vocab_size)
            view = view[rows] if all_logits else view[-1:]
            logits = view.argmax(axis=1) if greedy else view.copy()
        if features:
            count = max(outputs, rows.stop)
            feats = np.concatenate([self._features(i, count)[rows] for i in self.feature_layer_ids], axis=1)
        return logits, feats

    def forward(
        self, ids: torch.Tensor, all_logits: bool = True, features: bool = True, greedy: bool = False
    ) -> TargetOutput:
        """Append ids at the cache end; return logits (all positions or the last) and the tapped features (with
        features=False llama.cpp does not keep them for these positions).

        greedy: return each row's argmax instead, taken over the logits where llama.cpp holds them (no copy)."""
        tokens = ids.tolist()
        start = self.length
        if start + len(tokens) > self.max_context:
            raise DFlashError(f"The context is full ({self.max_context} tokens).")
        features = features and bool(self.feature_layer_ids)
        if self._padding:  # a hybrid's last forward left padding behind
            self.trim(start)
        logits, feats = [], []
        width = (self.fixed_rows or VERIFY_ROWS) if all_logits else BATCH
        for offset in range(0, len(tokens), width):
            chunk = tokens[offset : offset + width]
            padding = 0
            if all_logits and self.fixed_rows:
                padding = min(width - len(chunk), self.max_context - start - offset - len(chunk))
            wanted = all_logits or offset + width >= len(tokens)
            out, feat = self._chunk(chunk, padding, start + offset, (all_logits, wanted, greedy, features))
            logits += [] if out is None else [out]
            feats += [] if feat is None else [feat]
            self.length = start + offset + len(chunk)
            self._fed.extend(chunk)
            if self._last_decode > len(chunk):  # the padding's cells: a hybrid's stay until its next trim
                self._padding = self._last_decode - len(chunk)
                if not self.recurrent:
                    self.trim(self.length)
        out = torch.from_numpy(logits[0] if len(logits) == 1 else np.concatenate(logits)).to(self.device)
        out_feats = None
        if feats:
            joined = feats[0] if len(feats) == 1 else np.concatenate(feats)
            out_feats = torch.from_numpy(joined).to(self.device, self.dtype)
        return TargetOutput(logits=None, features=out_feats, argmax=out) if greedy else TargetOutput(out, out_feats)
