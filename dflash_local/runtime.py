"""How models load and run on this machine: the runtime config (device, dtype, kernels, CUDA graphs, drafter kind,
threads) and the load spec around it (context, quantization, backend, progress), planned once from the files."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .defaults import DEFAULT_CONTEXT
from .errors import DFlashError
from .kernels import check_mode, check_triton
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .offload import Placement

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> str:
    """torch's device: 'auto' means CUDA when available, else CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("CUDA was requested but this torch build sees no CUDA GPU.")
    if name != "cpu" and not name.startswith("cuda"):
        raise DFlashError(
            f"--device {name} runs GGUF files through llama.cpp; torch runs this model, on cpu or cuda only."
        )
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    """'auto' means bfloat16 on CUDA and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise DFlashError(f"Unknown dtype '{name}' (use auto, {', '.join(DTYPES)}).")
    return DTYPES[name]


def bf16_is_fast(device: str) -> bool:
    """bf16 matmuls pay off on CUDA and on CPUs with AMX or AVX-512 BF16; elsewhere fp32 is faster."""
    if device.startswith("cuda"):
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def check_kernels(kernels: str, device: str | torch.device) -> None:
    """Fail early, in one sentence, when the kernels asked for (a model's mode) are unknown, or Triton where Triton
    cannot run."""
    try:
        check_mode(kernels)
        if kernels == "triton":
            check_triton(torch.device(device).type == "cuda")
    except ValueError as exc:
        raise DFlashError(str(exc)) from None


class StepClock:
    """Marks on the device's timeline: CUDA events on CUDA (recording one waits for nothing), the host clock elsewhere.

    Work that llama.cpp runs on the GPU returns to the host before its outputs are read, so the events that follow
    it are recorded after it, and the spans between marks hold it too."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, begin: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Seconds from one mark to a later one. On CUDA this waits for `end`; a step marks its end after its own
        host sync (reading the accepted tokens), so that wait is over at once."""
        if self.cuda:
            end.synchronize()
            return begin.elapsed_time(end) / 1000
        return end - begin


DRAFTER_KINDS = ("auto", "torch", "native")


@dataclass(frozen=True)
class RuntimeConfig:
    """How models run here: device, dtype, kernels, CUDA graphs, drafter kind and threads. The CLI builds one (its
    flags, with DFLASH_KERNELS / DFLASH_CUDA_GRAPHS / DFLASH_DRAFTER / DFLASH_THREADS as their defaults) and
    passes it down; nothing below reads the environment. The defaults are a plain CPU run (tests, scripts)."""

    device: str = "cpu"  # auto, cpu, cuda, vulkan, metal or a llama.cpp device name (planned: runtime.plan_load)
    dtype: str = "auto"
    kernels: str = "auto"  # auto: Triton for CUDA tensors, the torch reference elsewhere; the models loaded hold it
    cuda_graphs: bool = True  # replay fixed-shape steps on CUDA
    drafter: str = "auto"  # for GGUF targets: llama.cpp's native drafter or the torch one
    threads: int | None = None  # CPU threads for torch and llama.cpp (None: torch's default)

    def __post_init__(self) -> None:
        try:
            check_mode(self.kernels)
        except ValueError as exc:
            raise DFlashError(str(exc)) from None
        if self.drafter not in DRAFTER_KINDS:
            raise DFlashError(f"Unknown drafter kind '{self.drafter}' (use {', '.join(DRAFTER_KINDS)}).")
        if self.threads is not None and self.threads < 1:
            raise DFlashError(f"--threads must be at least 1, got {self.threads}.")

    def apply(self) -> None:
        """Make the one process-wide choice: torch's CPU threads (the kernel mode goes to the models at load)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)


def _silent(text: str) -> None:
    """Loading's progress where no one shows it (tests, scripts, a library user)."""


@dataclass(frozen=True)
class LoadSpec:
    """Everything loading a target/drafter pair needs, passed whole to every loader: how the models run, the KV
    cache length, the target's and the drafter's quantization, the backend, and where loading reports its phases."""

    runtime: RuntimeConfig = RuntimeConfig()
    max_context: int = DEFAULT_CONTEXT
    quantize: str | None = None  # torch targets: None, "int4" or "nf4"
    drafter_quantize: str | None = None  # torch drafters: None, "int8" or "nf4"
    backend: str = "auto"  # auto, torch or llamacpp
    int8_head: bool = False  # planned: a llama.cpp target keeps its head as int8 rows for a torch drafter on the CPU
    gpu_layers: str = "auto"  # GGUFs on a GPU: auto (as many as its free memory holds), all, or a number
    cpu_moe: bool = False  # a MoE GGUF's expert tensors stay in host memory
    kv_cache: KVCache = KVCache()  # a llama.cpp target's K and V types (drafters keep theirs in f16: drafters.native)
    mtp: bool = False  # the target drafts with its own MTP layers (--drafter mtp): llama.cpp loads them with it
    placement: Placement | None = None  # planned: where llama.cpp runs the target and its native drafter
    sequences: int = 1  # llama.cpp sequences decoded together (serve --parallel), each with a max_context cache
    progress: Callable[[str], None] = field(default=_silent, compare=False)  # e.g. "loading the target"

    def reporting_to(self, progress: Callable[[str], None]) -> LoadSpec:
        """This spec, with loading's phases reported to `progress`."""
        return replace(self, progress=progress)


def plan_load(target: Path, spec: LoadSpec, native_drafter_runs: bool = True, drafter_bytes: int = 0) -> LoadSpec:
    """The one place device, placement, backend, drafter kind and the target's int8 head are decided, from the target's
    file, whether llama.cpp's native drafter runs the drafter (drafters.native_runs), its size and the spec; what the
    loaders take."""
    runtime = spec.runtime
    backend, placement = spec.backend, None
    if target.suffix != ".gguf":
        backend = "torch" if backend == "auto" else backend
    elif backend != "torch":
        placement = _gguf_placement(target, spec, drafter_bytes)
        backend = "torch" if placement is None else "llamacpp"
    if backend != "llamacpp" and spec.kv_cache.quantized:
        raise DFlashError(
            f"A quantized KV cache ({spec.kv_cache.describe()}) is llama.cpp's, and {target} runs on torch: use a "
            ".gguf target (without --backend torch) or --cache-type f16."
        )
    if backend != "llamacpp":
        device = pick_device(runtime.device)
    else:  # torch holds a llama.cpp target's features and a torch drafter: on CUDA beside a CUDA placement
        on = None if placement is None else placement.device
        cuda = on is not None and on.backend == "CUDA" and torch.cuda.is_available()
        device = "cuda" if cuda else "cpu"
    drafter = runtime.drafter
    if backend != "llamacpp":
        drafter = "torch"
    elif drafter == "auto":
        # llama.cpp's native drafter, on the target's device: faster on small models (`dflash bench --drafter-kind`),
        # and at real sizes it loads in a quarter of the torch drafter's time (README)
        drafter = "native" if spec.drafter_quantize is None and native_drafter_runs else "torch"
    int8_head = backend == "llamacpp" and drafter == "torch" and device == "cpu"  # the head a torch drafter borrows
    runtime = replace(runtime, device=device, drafter=drafter)
    return replace(spec, runtime=runtime, backend=backend, int8_head=int8_head, placement=placement)


def _gguf_placement(target: Path, spec: LoadSpec, drafter_bytes: int) -> Placement | None:
    """Where llama.cpp runs a GGUF (offload.plan_placement); None where --backend auto leaves a llama/qwen3 GGUF to the
    torch target instead: on CUDA when this libllama has no GPU backend (the torch target's int4/int8 kernels), unless
    a quantized KV cache (llama.cpp's) was asked for."""
    from .devices import library_backends
    from .gguf.file import read_gguf
    from .offload import plan_placement

    request = spec.runtime.device
    torch_cuda = request.lower() in ("auto", "cuda") and torch.cuda.is_available() and not spec.kv_cache.quantized
    if spec.backend == "auto" and torch_cuda and "CUDA" not in library_backends():
        if read_gguf(target).architecture in ("llama", "qwen3"):
            return None
    context, cache = spec.max_context, spec.kv_cache
    return plan_placement(target, request, spec.gpu_layers, spec.cpu_moe, context, drafter_bytes, cache)
