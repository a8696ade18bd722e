"""Target backends: each loads a model and implements `targets.base.Target`."""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from ..runtime import LoadSpec, pick_dtype
from .base import Target

BACKENDS = ("torch", "llamacpp")


def load_target(path: str | Path, spec: LoadSpec) -> Target:
    """Load a target model from a local path as `spec` says; its backend and device planned (runtime.plan_load)."""
    path = Path(path)
    if not path.exists():
        raise DFlashError(f"{path} does not exist.")
    runtime = spec.runtime
    dtype = pick_dtype(runtime.dtype, runtime.device)
    if spec.backend == "torch":
        from .torch_llama import TorchLlamaTarget

        return TorchLlamaTarget.load(
            path,
            dtype=dtype,
            device=runtime.device,
            max_context=spec.max_context,
            quantize=spec.quantize,
            cuda_graphs=runtime.cuda_graphs,
            kernels=runtime.kernels,
        )
    if spec.quantize is not None:
        raise DFlashError("--quantize applies to the torch backend; a GGUF file is already quantized.")
    if spec.backend == "llamacpp":
        try:
            from .llamacpp import LlamaCppTarget
        except ImportError:
            raise DFlashError("GGUF targets need llama-cpp-python and gguf: pip install dflash-local[gguf].") from None

        int8_head = runtime.drafter == "torch" and runtime.device == "cpu"  # the head a torch drafter borrows
        return LlamaCppTarget.load(
            path,
            dtype=dtype,
            device=runtime.device,
            max_context=spec.max_context,
            kernels=runtime.kernels,
            int8_head=int8_head,
        )
    raise DFlashError(f"Unknown backend '{spec.backend}' (available: {', '.join(BACKENDS)}, or auto before planning).")
