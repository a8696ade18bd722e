"""Drafters: each proposes blocks beside a target and implements `drafters.base.Drafter`; load_drafter picks the
torch one (torch_drafter) or llama.cpp's native one (native) for a target."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import DFlashError
from ..targets.base import Target
from .torch_drafter import DFlashDrafter

if TYPE_CHECKING:
    from .native import NativeDrafter


def load_drafter(
    folder: str | Path,
    target: Target,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    kind: str = "auto",
    quantize: str | None = None,
    cuda_graphs: bool = True,
    kernels: str = "auto",
) -> DFlashDrafter | NativeDrafter:
    """The torch drafter (its kernels in mode `kernels`) or llama.cpp's native one; auto takes the one measured faster
    for the device.

    On the CPU native for GGUF targets: faster on small models (`dflash bench --drafter-kind`; docs/gguf.md), and at
    real sizes it loads in a quarter of the time of the torch drafter (which packs its linears), whose steps are faster
    there (README).
    CUDA is unmeasured, so auto keeps torch there.
    """
    from ..targets.llamacpp import LlamaCppTarget  # llama-cpp-python, the gguf extra

    if kind == "auto":
        native_fits = isinstance(target, LlamaCppTarget) and target.device.type == "cpu" and quantize is None
        kind = "native" if native_fits else "torch"
    if kind == "native" and quantize is not None:
        raise DFlashError("The native llama.cpp drafter cannot be quantized; use --drafter-kind torch.")
    if kind == "native":
        from .native import NativeDrafter

        return NativeDrafter.load(folder, target)
    if kind == "torch":
        drafter = DFlashDrafter.load(folder, dtype, device, target.max_context, quantize, cuda_graphs, kernels)
        if isinstance(target, LlamaCppTarget) and drafter.device.type == "cpu":
            target.int8_head = True  # it borrows the head as packed int8 rows: faster than fp32, 1/4 the size
        return drafter
    raise DFlashError(f"Unknown drafter kind '{kind}' (use auto, torch or native).")
