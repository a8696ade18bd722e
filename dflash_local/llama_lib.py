"""The one place dflash sets llama.cpp's environment, then imports llama-cpp-python: import llama_cpp from here.

Both settings keep a verify batch's logits bitwise equal to those of one-token decodes (benchmarks/batch_invariance.py),
and each is left alone where the user has already set it:
- GGML_CPU_TILED_MM=0: ggml's tiled matmul (Q4_0 and K-quants, batches of 8 rows or more) sums in another order than
  the one-token path. ggml reads it once, at the process's first matmul. Export 1 to trade that for faster prefill.
- LLAMA_CPP_LIB_PATH: the libllama that tools/build_libllama.sh (run by install.sh on CPU machines) builds with
  llamafile's tinyBLAS off, which otherwise takes every F16/BF16/F32 batch of 2 rows or more; used where it exists for
  the installed llama-cpp-python. llama_cpp loads its library on import, so this module must import it first.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

INVARIANT_LIB = Path(sys.prefix) / "lib" / "dflash-libllama"
BUILT_FOR = "llama-cpp-python.version"  # the file in INVARIANT_LIB naming the llama-cpp-python it was built from
TAPS_ADDED = "tapped-architectures"  # the file in INVARIANT_LIB naming the architectures it added layer taps to
STOCK_TAPS = ("llama", "qwen3")  # architectures whose stock llama.cpp graphs set the taps, as far as dflash reads them


def invariant_lib() -> Path | None:
    """The batch-invariant libllama folder built for the installed llama-cpp-python, or None."""
    try:
        built_for = (INVARIANT_LIB / BUILT_FOR).read_text().strip()
        installed = metadata.version("llama_cpp_python")
    except (OSError, metadata.PackageNotFoundError):
        return None
    return INVARIANT_LIB if built_for == installed and (INVARIANT_LIB / "libllama.so").is_file() else None


os.environ.setdefault("GGML_CPU_TILED_MM", "0")
if (_folder := invariant_lib()) is not None:
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_folder))

import llama_cpp  # noqa: E402


def loaded_library() -> Path:
    """The libllama file this process loaded."""
    return Path(llama_cpp.llama_cpp._lib._name)


def tapped_architectures() -> tuple[str, ...]:
    """GGUF architectures whose layer features the loaded libllama exposes: the stock ones, plus those that
    tools/build_libllama.sh added taps to where that library is the one loaded."""
    added: list[str] = []
    if loaded_library().parent == invariant_lib():
        try:
            added = (INVARIANT_LIB / TAPS_ADDED).read_text().split()
        except OSError:  # built by an older build_libllama.sh, before it added taps
            pass
    return (*STOCK_TAPS, *added)
