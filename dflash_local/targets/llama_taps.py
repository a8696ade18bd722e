"""ctypes bindings for libllama's layer-input taps (staging API, exported only under C++-mangled names)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from ..errors import DFlashError
from ..llama_lib import llama_cpp

# Itanium (Linux/macOS) and MSVC manglings of the llama-ext.h declarations, then the plain C name.
_SET_NAMES = (
    "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z",
    "llama_set_embeddings_layer_inp",
)
_GET_NAMES = (
    "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z",
    "llama_get_embeddings_layer_inp",
)

GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level
_quiet_callback = None
_errors: list[str] = []


def _bind(names: tuple[str, ...], argtypes: list, restype) -> Callable:
    for name in names:
        func = getattr(llama_cpp.llama_cpp._lib, name, None)
        if func is not None:
            func.argtypes, func.restype = argtypes, restype
            return func
    raise DFlashError(
        "This libllama exports no layer-input taps (llama_get_embeddings_layer_inp); install llama-cpp-python==0.3.36."
    )


def tap_functions() -> tuple[Callable, Callable]:
    """(set(ctx, layer, on), get(ctx, layer) -> address of the rows) for llama.cpp's layer-input taps."""
    ctx_type = llama_cpp.llama_context_p_ctypes
    set_tap = _bind(_SET_NAMES, [ctx_type, ctypes.c_uint32, ctypes.c_bool], None)
    get_tap = _bind(_GET_NAMES, [ctx_type, ctypes.c_uint32], ctypes.c_void_p)
    return set_tap, get_tap


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
