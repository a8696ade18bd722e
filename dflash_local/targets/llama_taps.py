"""ctypes bindings of libllama's output rows, and llama.cpp's logs kept quiet (its errors kept for our sentences)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from ..llama_lib import llama_cpp

GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level
_quiet_callback = None
_errors: list[str] = []


def output_functions() -> tuple[Callable, Callable]:
    """(logits(ctx), embeddings(ctx)) -> address of llama.cpp's output rows, as an int: bindings of our own, since
    llama_cpp's return ctypes pointers, which cost more to turn into arrays than a small model's decode step."""
    address_of = ctypes.CFUNCTYPE(ctypes.c_void_p, llama_cpp.llama_context_p_ctypes)
    lib = llama_cpp.llama_cpp._lib
    return address_of(("llama_get_logits", lib)), address_of(("llama_get_embeddings", lib))


def _keep_errors(level: int, text: bytes, user_data) -> None:
    if level == GGML_LOG_LEVEL_ERROR and text:
        _errors[:] = [*_errors[-9:], text.decode(errors="replace").strip()]


def quiet_llama_logs() -> None:
    """Silence llama.cpp's and ggml's log lines (they would flood stderr), keeping the errors from now on."""
    global _quiet_callback
    _errors.clear()
    if _quiet_callback is None:
        _quiet_callback = llama_cpp.llama_log_callback(_keep_errors)
    llama_cpp.llama_log_set(_quiet_callback, ctypes.c_void_p(0))


def first_llama_error() -> str:
    """llama.cpp's first error line since quiet_llama_logs(), without its function-name prefix ('' if none)."""
    return _errors[0].split(": ", 1)[-1] if _errors else ""
