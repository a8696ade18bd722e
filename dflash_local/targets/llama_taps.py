"""ctypes bindings of libllama's output rows."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from ..llama_lib import llama_cpp


def output_functions() -> tuple[Callable, Callable]:
    """(logits(ctx), embeddings(ctx)) -> address of llama.cpp's output rows, as an int: bindings of our own, since
    llama_cpp's return ctypes pointers, which cost more to turn into arrays than a small model's decode step."""
    address_of = ctypes.CFUNCTYPE(ctypes.c_void_p, llama_cpp.llama_context_p_ctypes)
    lib = llama_cpp.llama_cpp._lib
    return address_of(("llama_get_logits", lib)), address_of(("llama_get_embeddings", lib))
