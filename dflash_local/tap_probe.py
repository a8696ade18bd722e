"""Whether the loaded libllama's graph for an architecture sets the layer-input taps, and still computes logits while
it hands out the final hidden state (the last layer's feature), asked of the library itself.

llama.cpp aborts the process when a tapped layer's graph sets no tap, so a child process asks: it loads the GGUF,
taps every layer's input and decodes one token, then asks for the output embeddings too and decodes another (some
graphs, lfm2's, skip the head then: the logits stay zero). The answer is kept per (library file, architecture) in
dflash's state folder, so each architecture is asked once per libllama build.
  python -m dflash_local.tap_probe MODEL.gguf   # exit 0: both; exit 3: the taps, but no logits beside the embeddings
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .atomic import write_text_atomic
from .errors import DFlashError
from .llama_lib import llama_cpp, loaded_library, tap_functions
from .paths import files_identity, identity_key, state_dir

NO_TAP = "layer input tensor is null"  # llama.cpp's assertion when a tapped layer's graph sets no tap
NO_LOGITS_WITH_EMBEDDINGS = 3  # the child's exit status when the logits are zero while embeddings are asked for


class LayerTaps(NamedTuple):
    """What this libllama reads of an architecture: every layer's input, and the final hidden state beside logits."""

    layers: bool
    last_layer: bool


_known: dict[tuple[str, str], LayerTaps] = {}


def _answers_file() -> Path:
    return state_dir() / "layer-taps.json"


def _library_key() -> str:
    return identity_key({"library": files_identity(loaded_library())})


def layer_taps(path: Path, architecture: str) -> LayerTaps:
    """What this libllama reads of `architecture` (the model in `path`): remembered, else asked of a child process
    that tries it on `path`."""
    key = (_library_key(), architecture)
    if key not in _known:
        answers = _read_answers()
        known = answers.get(key[0], {}).get(architecture)
        if not isinstance(known, list):  # never asked (or asked before the last layer was)
            known = answers.setdefault(key[0], {})[architecture] = list(_ask_child(path))
            _write_answers(answers)
        _known[key] = LayerTaps(*map(bool, known))
    return _known[key]


def _read_answers() -> dict:
    try:
        answers = json.loads(_answers_file().read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _write_answers(answers: dict) -> None:
    try:
        _answers_file().parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(_answers_file(), json.dumps(answers, indent=1))
    except OSError:  # an unwritable state folder: asked again next time
        pass


def _ask_child(path: Path) -> LayerTaps:
    """Run this module on `path` in a child process: what its two decodes showed (llama.cpp aborting on a missing
    tap: neither)."""
    run = subprocess.run(
        [sys.executable, "-m", __name__, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},  # ggml's backtrace runs a debugger, which can hang
    )
    if run.returncode in (0, NO_LOGITS_WITH_EMBEDDINGS):
        return LayerTaps(True, run.returncode == 0)
    if NO_TAP in run.stderr:
        return LayerTaps(False, False)
    last = (run.stderr.strip().splitlines() or ["no reason given"])[-1]
    raise DFlashError(f"Checking whether llama.cpp reads the layer features of {path.name} failed ({last}).")


def tap_every_layer(path: Path) -> int:
    """Load `path` on the CPU, tap every layer's input and decode one token (llama.cpp aborts on a missing tap); then
    with the output embeddings asked for, another: the exit status, 0 if its logits are there."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    context = llama_cpp.llama_context_default_params()
    context.n_ctx, context.n_batch, context.n_ubatch, context.n_seq_max = 16, 1, 1, 1
    context.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # per-token embeddings, as the target reads them
    ctx = llama_cpp.llama_init_from_model(model, context)
    if not ctx:
        raise SystemExit(f"llama.cpp could not create a context for {path}")
    set_tap, _ = tap_functions()
    for layer in range(1, llama_cpp.llama_model_n_layer(model)):
        set_tap(ctx, layer, True)
    for embeddings in (False, True):
        llama_cpp.llama_set_embeddings(ctx, embeddings)
        batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(0), 1)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama.cpp could not decode a token of {path}")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
    return 0 if np.any(logits != 0.0) else NO_LOGITS_WITH_EMBEDDINGS


if __name__ == "__main__":
    sys.exit(tap_every_layer(Path(sys.argv[1])))
