"""The target's own multi-token-prediction (MTP) block as the drafter (`--drafter mtp`): llama.cpp's MTP context over
the target GGUF's nextn layer, which drafts one token per step, as llama.cpp's own MTP driver does.

Its KV cache holds position p from (token p, the target's final-normed hidden state at p - 1, zeros at 0); a draft
chains the block's own hidden state from one step to the next. The architectures are those whose llama.cpp graph
hands the MTP block the final-normed hidden state, which is the target's last-layer feature.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import torch

from ..errors import DFlashError
from ..kv_cache import KVCache
from ..llama_context import LlamaContext
from ..llama_lib import llama_cpp, mtp_functions
from ..runtime import LoadSpec
from ..targets.llamacpp import BATCH, LlamaCppTarget, context_params
from .base import DraftContext

MTP_ARCHITECTURES = ("qwen35", "qwen35moe")
MTP_BLOCK = 8  # the most positions one verify takes from a chain (each draft step is one more MTP forward)
HISTORY = 64  # the target's hidden states kept for trims; one further back starts the chain from zeros


class MtpDrafter(DraftContext):
    """The Drafter interface (drafters.base) over llama.cpp's MTP context of one GGUF target."""

    source = "mtp"

    def __init__(self, target: LlamaCppTarget, context: LlamaContext) -> None:
        super().__init__()
        self.target = target
        self.context = context  # llama.cpp's MTP context over the target's model, reading the target's context
        set_nextn, self._nextn_at = mtp_functions()
        set_nextn(context.ctx, True, True)  # the block's hidden state for each output row
        self.block_size = MTP_BLOCK
        self.target_layer_ids = [target.num_layers - 1]
        self.cache_owner: object | None = None  # the Session that last filled its cache
        self._hidden = np.zeros((0, target.hidden_size), dtype=np.float32)  # positions [_first, _first + len)
        self._first = 0

    @classmethod
    def load(cls, target: LlamaCppTarget, spec: LoadSpec) -> MtpDrafter:
        """The MTP context beside a GGUF target loaded with its MTP layers (LoadSpec.mtp), on spec's threads."""
        if not isinstance(target, LlamaCppTarget):
            raise DFlashError("MTP drafting (--drafter mtp) runs in llama.cpp: it needs a GGUF target on llama.cpp.")
        if spec.runtime.drafter == "torch":
            raise DFlashError("MTP drafting runs in llama.cpp, not on the torch drafter (--drafter-kind auto).")
        info = target.info
        if info.mtp_layers < 1:
            raise DFlashError(
                f"--drafter mtp: {info.path.name} carries no MTP (nextn) layers; use a GGUF converted with them, or a "
                "DFlash drafter."
            )
        if info.architecture not in MTP_ARCHITECTURES:
            raise DFlashError(
                f"--drafter mtp drafts with the MTP layers of {' and '.join(MTP_ARCHITECTURES)} GGUFs; "
                f"{info.path.name} holds a '{info.architecture}' model."
            )
        if not target.with_mtp:
            raise DFlashError("The target was loaded without its MTP layers (LoadSpec.mtp), so it cannot draft.")
        params = context_params(replace(spec, kv_cache=KVCache()), target.max_context)  # f16, as drafters.native's
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        context = target.context
        return cls(target, LlamaContext(context.model, params, "the MTP context", owns_model=False, other=context))

    def check_target(self, target) -> None:
        """Raise a DFlashError unless target is the GGUF target whose MTP layers these are."""
        if target is not self.target:
            raise DFlashError("An MTP drafter drafts only for the GGUF target it belongs to.")
        target.set_feature_layers(self.target_layer_ids)

    def _cut(self, length: int) -> None:
        """Cut the MTP cache to `length` positions: llama.cpp's cells at the next propose (the hidden states kept stay
        usable), all of them and the hidden states now at 0."""
        if length == 0:
            self.context.reset()
            self._first, self._hidden = 0, self._hidden[:0]
        self.length = length

    def _save_cache(self) -> tuple[bytearray, np.ndarray, int]:
        """The MTP cache's state and the target's hidden states kept."""
        return self.context.save(), self._hidden.copy(), self._first

    def _load_cache(self, state: tuple[bytearray, np.ndarray, int]) -> None:
        """Hold a saved MTP cache again (its hidden states with it)."""
        self.context.load(state[0])
        self._hidden, self._first = state[1].copy(), state[2]

    def _state(self, position: int) -> np.ndarray:
        """The target's hidden state at position (kept since the last trim past it), else zeros."""
        index = position - self._first
        if position < 0 or not 0 <= index < len(self._hidden):
            return np.zeros(self.target.hidden_size, dtype=np.float32)
        return self._hidden[index]

    def _add(self, token: int, position: int, state: np.ndarray, output: bool) -> None:
        batch = self.context.batch
        index = llama_cpp.llama_batch_ext_add_token(batch, 0, token)
        if index < 0:
            raise DFlashError("llama.cpp's MTP batch is full.")
        pos = llama_cpp.llama_pos(position)
        llama_cpp.llama_batch_ext_set_pos(batch, index, ctypes.byref(pos))
        embd = llama_cpp.llama_embd(state.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, state.shape[0])
        llama_cpp.llama_batch_ext_set_embd_token(batch, index, embd)
        llama_cpp.llama_batch_ext_set_output_logits(batch, index, output)

    def _catch_up(self, features: np.ndarray, tokens: list[int], start: int) -> None:
        """Cache positions [length, start) from their tokens and the hidden states before them, then keep the last
        HISTORY hidden states (features: positions length..start-1)."""
        states = np.concatenate([self._state(self.length - 1)[None], features[:-1]]) if len(features) else features
        states = np.ascontiguousarray(states, dtype=np.float32)
        for offset in range(0, len(states), BATCH):
            llama_cpp.llama_batch_ext_clear(self.context.batch)
            for row in range(offset, min(offset + BATCH, len(states))):
                self._add(tokens[self.length + row], self.length + row, states[row], False)
            self.context.process()
        kept = self._hidden[: max(self.length - self._first, 0)]
        self._hidden = np.concatenate([kept, features])[-HISTORY:].astype(np.float32)
        self._first = start - len(self._hidden)

    def propose(
        self,
        target,
        new_features: torch.Tensor | None,
        tokens: list[int],
        start: int,
        size: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Cache the positions up to start (from the features held, then new_features), then chain `rows` drafts
        (default size - 1) from tokens[start]: the logits [rows, vocab] of positions start+1..start+rows, each step's
        argmax being the next step's token."""
        rows = size - 1 if rows is None else rows
        width, ctx = target.hidden_size, self.context.ctx
        new_features = self._take(new_features, start)
        features = np.zeros((0, width), np.float32) if new_features is None else new_features.float().cpu().numpy()
        self.context.trim(self.length)
        self._catch_up(features, tokens, start)
        self.length = start
        token, state, drafted = tokens[start], self._state(start - 1), []
        for step in range(rows):
            llama_cpp.llama_batch_ext_clear(self.context.batch)
            self._add(token, start + step, np.ascontiguousarray(state), True)
            self.context.process()
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, 0), shape=(target.vocab_size,))
            drafted.append(logits.copy())
            token = int(np.argmax(drafted[-1]))
            state = np.ctypeslib.as_array(self._nextn_at(ctx, 0), shape=(width,)).copy()
        if not drafted:
            return torch.empty((0, target.vocab_size), device=target.device)
        return torch.from_numpy(np.stack(drafted)).to(target.device)
