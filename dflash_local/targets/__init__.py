"""Target backends: each loads a model and implements `targets.base.Target`."""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from ..runtime import LoadSpec
from .base import Target

BACKENDS = ("torch", "llamacpp")


def load_target(path: str | Path, spec: LoadSpec) -> Target:
    """Load a target model from a local path as `spec` says; its backend and device planned (runtime.plan_load)."""
    path = Path(path)
    if not path.exists():
        raise DFlashError(f"{path} does not exist.")
    if spec.backend == "torch":
        from .torch_llama import TorchLlamaTarget

        return TorchLlamaTarget.load(path, spec)
    if spec.quantize is not None:
        raise DFlashError("--quantize applies to the torch backend; a GGUF file is already quantized.")
    if spec.backend == "llamacpp":
        try:
            from .llamacpp import LlamaCppTarget
        except ImportError:
            raise DFlashError("GGUF targets need llama-cpp-python and gguf: pip install dflash-local[gguf].") from None

        return LlamaCppTarget.load(path, spec)
    raise DFlashError(f"Unknown backend '{spec.backend}' (available: {', '.join(BACKENDS)}, or auto before planning).")
