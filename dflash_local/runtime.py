"""How models run on this machine: the runtime config (device, dtype, kernels, CUDA graphs, drafter kind, threads)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .errors import DFlashError
from .kernels import check_mode, check_triton

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> str:
    """'auto' means CUDA when available, else CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("CUDA was requested but this torch build sees no CUDA GPU.")
    if name != "cpu" and not name.startswith("cuda"):
        raise DFlashError(f"Unknown device '{name}' (use auto, cpu or cuda).")
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
    passes it down; nothing below reads the environment."""

    device: str = "auto"
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
