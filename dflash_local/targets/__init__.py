"""Target backends: each loads a model and implements `targets.base.Target`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import DFlashError
from .base import Target

BACKENDS = ("torch", "llamacpp")


def load_target(
    path: str | Path,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_context: int = 4096,
    quantize: str | None = None,
    cuda_graphs: bool = True,
    kernels: str = "auto",
) -> Target:
    """Load a target model from a local path with the named (or inferred) backend, its kernels in mode `kernels`."""
    path = Path(path)
    if not path.exists():
        raise DFlashError(f"{path} does not exist.")
    if backend == "auto":  # GGUF files run on llama.cpp on the CPU, on the torch target's int4/int8 kernels on CUDA
        backend = "llamacpp" if path.suffix == ".gguf" and torch.device(device).type == "cpu" else "torch"
    if backend == "torch":
        from .torch_llama import TorchLlamaTarget

        return TorchLlamaTarget.load(
            path,
            dtype=dtype,
            device=device,
            max_context=max_context,
            quantize=quantize,
            cuda_graphs=cuda_graphs,
            kernels=kernels,
        )
    if quantize is not None:
        raise DFlashError("--quantize applies to the torch backend; a GGUF file is already quantized.")
    if backend == "llamacpp":
        try:
            from .llamacpp import LlamaCppTarget
        except ImportError:
            raise DFlashError("GGUF targets need llama-cpp-python and gguf: pip install dflash-local[gguf].") from None

        return LlamaCppTarget.load(path, dtype=dtype, device=device, max_context=max_context, kernels=kernels)
    raise DFlashError(f"Unknown backend '{backend}' (available: {', '.join(BACKENDS)}).")
