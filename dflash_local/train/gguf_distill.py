"""Self-distillation through llama.cpp for a GGUF target: many prompts continue at once, one llama.cpp sequence each,
and the layer taps give the features of every position as it is fed (what the drafter conditions on at inference)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError
from ..gguf.file import read_gguf
from ..llama_context import LlamaContext, load_model
from ..llama_lib import llama_cpp, output_functions, tap_functions
from ..runtime import LoadSpec
from ..sampling import SamplingParams, pick
from ..tap_probe import layer_taps
from ..targets.llamacpp import BATCH, context_params, model_params
from .selfdistill import Continuation, top_k


class ParallelTarget:
    """A llama.cpp context over a GGUF file holding up to `sequences` sequences of `length` tokens at once, with the
    feature layers' inputs tapped (HF hidden_states[id + 1] for each id in layer_ids)."""

    def __init__(self, path: Path, sequences: int, length: int, layer_ids: list[int], spec: LoadSpec) -> None:
        self.info = read_gguf(path)
        if not layer_taps(path, self.info.architecture).layers:
            raise DFlashError(
                f"{path.name} holds a '{self.info.architecture}' model, whose layer features this libllama does not "
                "read, so no drafter can be trained for it."
            )
        if any(not 0 <= i < self.info.dims.layers - 1 for i in layer_ids):
            raise DFlashError(f"Target layer ids {layer_ids} must lie in 0..{self.info.dims.layers - 2} for a GGUF.")
        model = load_model(path, model_params(spec).params, str(path))
        params = context_params(spec, sequences * length)
        params.n_seq_max, params.kv_unified = sequences, True  # one stream: batches keep their order in the taps
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        name = f"a context of {sequences} x {length} tokens for {path}"
        self.context = LlamaContext(model, params, name, rows=BATCH)
        set_tap, self._get_tap = tap_functions()
        self._logits_at, _ = output_functions()
        self.layer_ids = list(layer_ids)
        for layer in self.layer_ids:
            set_tap(self.context.ctx, layer + 1, True)

    def clear(self) -> None:
        self.context.reset()

    def _rows(self, address: int | None, rows: int, width: int) -> np.ndarray:
        if not address:
            raise DFlashError("llama.cpp returned no output rows for the batch.")
        return np.frombuffer((ctypes.c_float * (rows * width)).from_address(address), np.float32).reshape(rows, width)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> tuple[torch.Tensor, np.ndarray]:
        """Feed (sequence, position, token, wants_logits) rows, at most BATCH; return the logits of the rows that want
        them, in order (a view, valid until the next decode), and every row's concatenated features (a copy)."""
        self.context.decode(rows)
        ctx, width = self.context.ctx, self.info.dims.hidden
        features = np.concatenate(
            [self._rows(self._get_tap(ctx, i + 1), len(rows), width) for i in self.layer_ids], axis=1
        )
        wanted = sum(1 for row in rows if row[3])
        logits = torch.from_numpy(self._rows(self._logits_at(ctx), wanted, self.info.dims.vocab))
        return logits, features


def continue_prompts(
    target: ParallelTarget,
    prompts: list[list[int]],
    new_tokens: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    generator: torch.Generator,
    soft_top_k: int = 0,
) -> list[Continuation]:
    """Continue the prompts together (one sequence each); one Continuation per prompt (bf16 features)."""
    target.clear()
    ids = [list(prompt) for prompt in prompts]
    features: list[list[np.ndarray]] = [[] for _ in prompts]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    pending = [
        (seq, pos, token, pos == len(prompt) - 1)
        for seq, prompt in enumerate(prompts)
        for pos, token in enumerate(prompt)
    ]
    live = list(range(len(prompts)))
    for _ in range(new_tokens + 1):
        picked: list[int] = []
        top_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for begin in range(0, len(pending), BATCH):
            chunk = pending[begin : begin + BATCH]
            logits, feats = target.decode(chunk)
            for row, (seq, _, _, _) in enumerate(chunk):
                features[seq].append(feats[row : row + 1])
            if len(logits):
                found = top_k(logits, soft_top_k)
                if found is not None:
                    top_rows += list(zip(*found, strict=True))
                picked += pick(logits, params, generator).tolist()
        wanting = [seq for seq, _, _, wants in pending if wants]
        for seq, top in zip(wanting, top_rows, strict=False):
            tops[seq].append(top)
        live = []
        for seq, token in zip(wanting, picked, strict=True):
            ids[seq].append(token)
            if token not in stop_ids and len(ids[seq]) < len(prompts[seq]) + new_tokens:
                live.append(seq)
        pending = [(seq, len(ids[seq]) - 1, ids[seq][-1], True) for seq in live]
        if not pending:
            break
    out = []
    for seq in range(len(prompts)):
        rows = torch.from_numpy(np.concatenate(features[seq])).to(torch.bfloat16)
        found = Continuation(ids[seq], rows[: len(ids[seq]) - 1])
        if soft_top_k:
            found.top_ids = torch.stack([ids_ for ids_, _ in tops[seq]])
            found.top_logits = torch.stack([values for _, values in tops[seq]])
        out.append(found)
    return out
