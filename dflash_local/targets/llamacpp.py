"""GGUF target through llama-cpp-python: llama.cpp runs the model, its layer-input taps give the features."""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import llama_cpp
import numpy as np
import torch

from ..errors import DFlashError
from ..gguf_file import GGUFModel, read_gguf
from .base import TargetOutput
from .llama_taps import first_llama_error, quiet_llama_logs, tap_functions

BATCH = 512


def _free(batch, ctx, model) -> None:
    """Release llama.cpp's batch, context and model (runs when the target is collected, or at exit)."""
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


class LlamaCppTarget:
    """A llama.cpp context over a GGUF file plus the embeddings and head the drafter borrows (torch)."""

    def __init__(self, info: GGUFModel, model, ctx, max_context: int, dtype: torch.dtype, device: str) -> None:
        self.info = info
        self._model, self._ctx = model, ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(BATCH, 0, 1)
        weakref.finalize(self, _free, self._batch, ctx, model)
        self._set_tap, self._get_tap = tap_functions()
        self.device, self.dtype = torch.device(device), dtype
        self.max_context = max_context
        self.length = 0
        self.feature_layer_ids: list[int] = []
        self._embed = info.tensor("token_embd.weight", dtype, device)
        has_head = any(t.name == "output.weight" for t in info.reader.tensors)
        self._head = info.tensor("output.weight", dtype, device) if has_head else self._embed

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_context: int = 4096,
        threads: int | None = None,
    ) -> LlamaCppTarget:
        """Validate the GGUF file with the gguf reader, then load it into llama.cpp (all layers on the GPU for cuda)."""
        info = read_gguf(Path(path))
        quiet_llama_logs()
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = -1 if str(device).startswith("cuda") else 0
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise DFlashError(f"llama.cpp could not load {path} ({first_llama_error() or 'no reason given'}).")
        max_context = min(max_context, info.context_length)
        threads = threads or torch.get_num_threads()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = max_context, BATCH, BATCH, 1
        params.n_threads = params.n_threads_batch = threads
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # per-token output embeddings (last-layer features)
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise DFlashError(f"llama.cpp could not create a {max_context}-token context for {path}.")
        return cls(info, model, ctx, max_context, dtype, device)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.info.eos_ids

    def set_feature_layers(self, layer_ids: list[int]) -> None:
        """Tap llama.cpp's input of layer id + 1 (= HF output of layer id); the last layer's is the final-normed
        hidden state, read as llama.cpp's output embeddings (which makes every position an output)."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(f"The GGUF target has {self.num_layers} layers, so it has no layer {bad[0]} to read.")
        last = self.num_layers - 1
        old, new = set(self.feature_layer_ids) - {last}, set(layer_ids) - {last}
        for layer in old - new:
            self._set_tap(self._ctx, layer + 1, False)
        for layer in new - old:
            self._set_tap(self._ctx, layer + 1, True)
        llama_cpp.llama_set_embeddings(self._ctx, last in layer_ids)
        self.feature_layer_ids = list(layer_ids)

    def reset(self) -> None:
        llama_cpp.llama_memory_clear(self._memory, True)
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length} from {self.length}")
        if not llama_cpp.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise DFlashError("llama.cpp could not roll its KV cache back.")
        self.length = length

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids.to(self.device), self._embed)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self._head.dtype) @ self._head.T

    def _decode(self, ids: list[int], start: int, all_logits: bool) -> None:
        batch = self._batch
        batch.n_tokens = len(ids)
        for index, token in enumerate(ids):
            batch.token[index] = token
            batch.pos[index] = start + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = 0
            batch.logits[index] = all_logits or index == len(ids) - 1
        status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            raise DFlashError(f"llama.cpp failed to evaluate the batch (status {status}).")

    def _rows(self, pointer, rows: int, width: int) -> np.ndarray:
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(rows, width)).copy()

    def _features(self, layer: int, rows: int) -> np.ndarray:
        """HF hidden_states[layer + 1] for the last decoded rows."""
        if layer == self.num_layers - 1:
            return self._rows(llama_cpp.llama_get_embeddings(self._ctx), rows, self.hidden_size)
        return self._rows(self._get_tap(self._ctx, layer + 1), rows, self.hidden_size)

    def forward(self, ids: torch.Tensor, all_logits: bool = True, features: bool = True) -> TargetOutput:
        """Append ids at the cache end; return logits (all positions or the last) and the tapped features."""
        tokens = ids.tolist()
        start = self.length
        if start + len(tokens) > self.max_context:
            raise DFlashError(f"The context is full ({self.max_context} tokens).")
        logits, feats = [], []
        every_output = self.num_layers - 1 in self.feature_layer_ids
        for offset in range(0, len(tokens), BATCH):
            chunk = tokens[offset : offset + BATCH]
            self._decode(chunk, start + offset, all_logits)
            if all_logits or offset + BATCH >= len(tokens):
                rows = len(chunk) if all_logits or every_output else 1
                chunk_logits = self._rows(llama_cpp.llama_get_logits(self._ctx), rows, self.vocab_size)
                logits.append(chunk_logits if all_logits else chunk_logits[-1:])
            if features and self.feature_layer_ids:
                feats.append(np.concatenate([self._features(i, len(chunk)) for i in self.feature_layer_ids], axis=1))
            self.length = start + offset + len(chunk)
        out_logits = torch.from_numpy(np.concatenate(logits)).to(self.device)
        out_feats = None
        if feats:
            out_feats = torch.from_numpy(np.concatenate(feats)).to(self.device, self.dtype)
        return TargetOutput(logits=out_logits, features=out_feats)
