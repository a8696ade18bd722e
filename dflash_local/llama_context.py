"""One llama.cpp context and what it owns (its memory, its batch, the model where it loaded it): the one place dflash
creates, feeds, trims, saves, restores and frees a context, for the GGUF target, its drafters and distillation."""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path

from .errors import DFlashError
from .llama_lib import first_llama_error, llama_cpp, quiet_llama_logs


def load_model(path: Path, params: llama_cpp.llama_model_params, name: str) -> llama_cpp.llama_model_p:
    """The model in a GGUF file as llama.cpp loads it with params (its logs quieted); name: the model, for an error."""
    quiet_llama_logs()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise DFlashError(f"llama.cpp could not load {name} ({first_llama_error() or 'no reason given'}).")
    return model


def _free(batch, extended: bool, ctx, model) -> None:
    """Release llama.cpp's batch, context and (where the context owns it) model: when collected, or at exit."""
    (llama_cpp.llama_batch_ext_free if extended else llama_cpp.llama_batch_free)(batch)
    llama_cpp.llama_free(ctx)
    if model is not None:
        llama_cpp.llama_model_free(model)


class LlamaContext:
    """A llama.cpp context over a model, with its memory and one batch: a token batch of `rows` rows (fed through
    `decode`), or with rows=0 an extended batch (tokens and embeddings, filled by the caller, run by `process`).

    owns_model: free the model with the context (and on a failed creation); other: the context it reads
    (llama.cpp's ctx_other), kept alive while this one is, whose lock it shares. Every call into llama.cpp holds the
    lock, so that threads decoding several sequences of one context (serve --parallel) take turns."""

    def __init__(
        self,
        model: llama_cpp.llama_model_p,
        params: llama_cpp.llama_context_params,
        name: str,
        rows: int = 0,
        owns_model: bool = True,
        other: LlamaContext | None = None,
    ) -> None:
        if other is not None:
            params.ctx_other = other.ctx
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            if owns_model:
                llama_cpp.llama_model_free(model)
            raise DFlashError(f"llama.cpp could not create {name} ({first_llama_error() or 'no reason given'}).")
        self.model, self.ctx, self.name, self.other = model, ctx, name, other
        self.sequences = params.n_seq_max  # sequence ids 0..sequences-1, each with its own KV cells
        self.lock = threading.RLock() if other is None else other.lock
        self.tapping = False  # llama.cpp keeps the feature layers' rows (a target's taps: targets.llamacpp)
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.extended = not rows
        self.batch = llama_cpp.llama_batch_ext_init(ctx) if self.extended else llama_cpp.llama_batch_init(rows, 0, 1)
        weakref.finalize(self, _free, self.batch, self.extended, ctx, model if owns_model else None)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """Feed (sequence, position, token, wants_logits) rows through the token batch."""
        with self.lock:
            batch = self.batch
            batch.n_tokens = len(rows)
            # the arrays read once: each read of a ctypes struct's field makes a new pointer object
            tokens, positions, outputs = batch.token, batch.pos, batch.logits
            counts, sequences = batch.n_seq_id, batch.seq_id
            for index, (sequence, position, token, wants) in enumerate(rows):
                tokens[index], positions[index], outputs[index] = token, position, wants
                counts[index], sequences[index][0] = 1, sequence
            self.process()

    def process(self) -> None:
        """Run the batch as it stands; a DFlashError (with llama.cpp's first error) where llama.cpp fails."""
        with self.lock:
            if self.extended:
                status = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
            else:
                status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            reason = first_llama_error()
            said = f"status {status}: {reason}" if reason else f"status {status}"
            raise DFlashError(f"llama.cpp failed to evaluate a batch of {self.name} ({said}).")

    def trim(self, length: int, sequence: int = 0) -> bool:
        """Forget a sequence's cells from position `length` on; False where llama.cpp cannot (a recurrent state)."""
        with self.lock:
            return llama_cpp.llama_memory_seq_rm(self.memory, sequence, length, -1)

    def first_position(self, sequence: int = 0) -> int:
        """The earliest position whose cells a sequence holds (-1: none; past 0 where a sliding window reused cells)."""
        with self.lock:
            return llama_cpp.llama_memory_seq_pos_min(self.memory, sequence)

    def reset(self) -> None:
        """Forget every sequence's cells."""
        with self.lock:
            llama_cpp.llama_memory_clear(self.memory, True)

    def clear(self, sequence: int) -> None:
        """Forget one sequence's cells (with one sequence, every cell: `reset`)."""
        if self.sequences == 1:
            self.reset()
        elif not self.trim(0, sequence):
            raise DFlashError(f"llama.cpp could not empty sequence {sequence}'s cache.")

    def save(self, sequence: int = 0) -> bytearray:
        """A sequence's memory (KV cells, a recurrent state) as llama.cpp serializes it, for `load`."""
        with self.lock:
            state = bytearray(llama_cpp.llama_state_seq_get_size(self.ctx, sequence))
            buffer = (ctypes.c_uint8 * len(state)).from_buffer(state)
            if not llama_cpp.llama_state_seq_get_data(self.ctx, buffer, len(state), sequence):
                raise DFlashError("llama.cpp could not save a sequence's state for the prompt cache.")
        return state

    def load(self, state: bytearray, sequence: int = 0) -> None:
        """Replace a sequence's memory with a state from `save`."""
        with self.lock:
            self.clear(sequence)
            buffer = (ctypes.c_uint8 * len(state)).from_buffer(state)
            if not llama_cpp.llama_state_seq_set_data(self.ctx, buffer, len(state), sequence):
                raise DFlashError("llama.cpp could not restore a sequence's state from the prompt cache.")
