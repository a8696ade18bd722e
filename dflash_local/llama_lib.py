"""The one place dflash sets llama.cpp's environment, then imports llama-cpp-python: import llama_cpp from here.

Both settings keep a verify batch's logits bitwise equal to those of one-token decodes (benchmarks/batch_invariance.py),
and each is left alone where the user has already set it:
- LLAMA_CPP_LIB_PATH: the libllama that tools/build_libllama.sh (run by install.sh) builds with ggml's CPU matmul
  patched: batches of 64 rows or more (prompt chunks) take the fast kernels for all rows but their last, smaller ones
  (verify blocks, one-token decodes) sum in the one-token order; used where it exists for the installed
  llama-cpp-python. A GPU build (CUDA or Vulkan, with the same CPU backend inside) is preferred to the CPU-only one
  where it loads; llama_cpp loads its library on import, so this module must import it first.
- GGML_CPU_TILED_MM=0, only where another library loads (llama-cpp-python's own, or a dflash build older than that
  patch): ggml's tiled matmul (K-quants, batches of 8 rows or more) sums in another order than the one-token path.
  ggml reads it once, at the process's first matmul.
- MTMD_CPP_LIB: the same folder, where its build holds libmtmd (image projectors), so that llama_cpp.mtmd_cpp binds
  the libmtmd linked to the libllama loaded here (`mtmd_library`), not llama-cpp-python's own.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import ModuleType

from .errors import DFlashError

# Itanium (Linux/macOS) and MSVC manglings of llama-ext.h's layer-input taps (a staging API), then the plain C name.
_SET_TAP_NAMES = (
    "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z",
    "llama_set_embeddings_layer_inp",
)
_GET_TAP_NAMES = (
    "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z",
    "llama_get_embeddings_layer_inp",
)
# llama.cpp's nextn outputs (where a DFlash2 drafter's selector leaves its lattice) and the selector's top-k, the same
# staging API; only the Itanium manglings are bound here (the MSVC ones are unchecked), then the plain C names.
_SET_NEXTN_NAMES = ("_Z26llama_set_embeddings_nextnP13llama_contextbb", "llama_set_embeddings_nextn")
_GET_NEXTN_NAMES = ("_Z26llama_get_embeddings_nextnP13llama_context", "llama_get_embeddings_nextn")
_GET_NEXTN_ITH_NAMES = ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti", "llama_get_embeddings_nextn_ith")
_SELECTOR_TOP_K_NAMES = ("_Z33llama_model_dflash_selector_top_kPK11llama_model", "llama_model_dflash_selector_top_k")
LIB_ROOT = Path(sys.prefix) / "lib"
GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level
_quiet_callback = None
_errors: list[str] = []
INVARIANT_LIB = LIB_ROOT / "dflash-libllama"  # the CPU build
GPU_LIBS = {"cuda": LIB_ROOT / "dflash-libllama-cuda", "vulkan": LIB_ROOT / "dflash-libllama-vulkan"}
BUILT_FOR = "llama-cpp-python.version"  # the file in each build's folder naming the llama-cpp-python it was built from
PATCHES = "patches"  # the file in each build's folder naming tools/build_libllama.sh's patches in it
PROMPT_ROWS_PATCH = "prompt-rows"  # tools/patch_ggml_cpu.py's: verify rows apart from prompt rows
MTMD = "libmtmd.so"  # llama.cpp's multimodal library, built beside libllama by tools/build_libllama.sh
UNLOADABLE: list[str] = []  # GPU builds found but not loadable here (their runtime is missing), for `dflash doctor`


def _current(folder: Path) -> bool:
    """Whether folder holds a libllama built for the installed llama-cpp-python."""
    try:
        built_for = (folder / BUILT_FOR).read_text().strip()
        installed = metadata.version("llama_cpp_python")
    except (OSError, metadata.PackageNotFoundError):
        return False
    return built_for == installed and (folder / "libllama.so").is_file()


def invariant_lib() -> Path | None:
    """The libllama folder to load: a current GPU build that loads here (CUDA first), else the CPU build, or None."""
    for backend, folder in GPU_LIBS.items():
        if not _current(folder):
            continue
        try:
            ctypes.CDLL(str(folder / f"libggml-{backend}.so"))  # its GPU runtime (libcuda, libvulkan) must load
        except OSError as exc:
            UNLOADABLE.append(f"{folder.name}: {exc}")
            continue
        return folder
    return INVARIANT_LIB if _current(INVARIANT_LIB) else None


def splits_prompt_rows(folder: Path) -> bool:
    """Whether the libllama in folder is a dflash build whose CPU matmul keeps verify rows apart from prompt rows."""
    try:
        return PROMPT_ROWS_PATCH in (folder / PATCHES).read_text().split()
    except OSError:
        return False


if (_folder := invariant_lib()) is not None:
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(_folder))
if not splits_prompt_rows(Path(os.environ.get("LLAMA_CPP_LIB_PATH", "."))):
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")

if (Path(os.environ.get("LLAMA_CPP_LIB_PATH", ".")) / MTMD).is_file():
    os.environ.setdefault("MTMD_CPP_LIB", os.environ["LLAMA_CPP_LIB_PATH"])

import llama_cpp  # noqa: E402


def loaded_library() -> Path:
    """The libllama file this process loaded."""
    return Path(llama_cpp.llama_cpp._lib._name)


def mtmd_library() -> ModuleType:
    """llama-cpp-python's libmtmd bindings (llama_cpp.mtmd_cpp), bound to the libmtmd built beside the loaded libllama
    (MTMD_CPP_LIB, else llama-cpp-python's own folder, as mtmd_cpp loads it); a DFlashError where that build has none
    (another libmtmd would load a second libllama). Quiets its logs."""
    folder = Path(os.environ.get("MTMD_CPP_LIB") or Path(llama_cpp.__file__).parent / "lib")
    if folder.resolve() != loaded_library().resolve().parent or not (folder / MTMD).is_file():
        raise DFlashError(
            f"The libllama loaded ({loaded_library()}) has no libmtmd beside it, which images need; rebuild it with "
            "tools/build_libllama.sh (install.sh runs it)."
        )
    from llama_cpp import mtmd_cpp

    quiet_llama_logs()
    mtmd_cpp.mtmd_helper_log_set(_quiet_callback, ctypes.c_void_p(0))  # its errors kept beside llama.cpp's
    return mtmd_cpp


def output_functions() -> tuple[Callable, Callable]:
    """(logits(ctx), embeddings(ctx)) -> address of llama.cpp's output rows, as an int: bindings of our own, since
    llama_cpp's return ctypes pointers, which cost more to turn into arrays than a small model's decode step."""
    address_of = ctypes.CFUNCTYPE(ctypes.c_void_p, llama_cpp.llama_context_p_ctypes)
    lib = llama_cpp.llama_cpp._lib
    return address_of(("llama_get_logits", lib)), address_of(("llama_get_embeddings", lib))


def function_address(name: str) -> int:
    """The address of one of libllama's C functions (for a library that calls it itself)."""
    return ctypes.cast(getattr(llama_cpp.llama_cpp._lib, name), ctypes.c_void_p).value


def _bind(names: tuple[str, ...], argtypes: list, restype, what: str = "layer-input taps") -> Callable:
    for name in names:
        func = getattr(llama_cpp.llama_cpp._lib, name, None)
        if func is not None:
            func.argtypes, func.restype = argtypes, restype
            return func
    raise DFlashError(f"This libllama exports no {what} ({names[-1]}); install llama-cpp-python==0.3.36.")


def tap_functions() -> tuple[Callable, Callable]:
    """(set(ctx, layer, on), get(ctx, layer) -> address of the rows) for llama.cpp's layer-input taps."""
    ctx_type = llama_cpp.llama_context_p_ctypes
    set_tap = _bind(_SET_TAP_NAMES, [ctx_type, ctypes.c_uint32, ctypes.c_bool], None)
    get_tap = _bind(_GET_TAP_NAMES, [ctx_type, ctypes.c_uint32], ctypes.c_void_p)
    return set_tap, get_tap


def dflash2_functions() -> tuple[Callable, Callable, Callable]:
    """(selector_top_k(model) -> int, set_nextn(ctx, on, masked), get_nextn(ctx) -> float pointer) for a DFlash2
    drafter: its selector's top-k (0 for a DFlash drafter) and the nextn rows that hold its lattice."""
    what = "DFlash2 selector outputs"
    ctx_type, model_type = llama_cpp.llama_context_p_ctypes, llama_cpp.llama_model_p_ctypes
    top_k = _bind(_SELECTOR_TOP_K_NAMES, [model_type], ctypes.c_int32, what)
    set_nextn = _bind(_SET_NEXTN_NAMES, [ctx_type, ctypes.c_bool, ctypes.c_bool], None, what)
    get_nextn = _bind(_GET_NEXTN_NAMES, [ctx_type], ctypes.POINTER(ctypes.c_float), what)
    return top_k, set_nextn, get_nextn


def mtp_functions() -> tuple[Callable, Callable]:
    """(set_nextn(ctx, on, masked), get_nextn_ith(ctx, row) -> float pointer) for an MTP context: the hidden state
    its block hands to the next draft step, per output row."""
    what = "MTP outputs"
    ctx_type = llama_cpp.llama_context_p_ctypes
    set_nextn = _bind(_SET_NEXTN_NAMES, [ctx_type, ctypes.c_bool, ctypes.c_bool], None, what)
    get_nextn_ith = _bind(_GET_NEXTN_ITH_NAMES, [ctx_type, ctypes.c_int32], ctypes.POINTER(ctypes.c_float), what)
    return set_nextn, get_nextn_ith


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
