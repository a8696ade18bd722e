"""Drafters: each proposes blocks beside a target and implements `drafters.base.Drafter`; load_drafter loads the
torch one (torch_drafter), llama.cpp's native one (native) or a GGUF target's own MTP layers (mtp), as the load
spec's plan says."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DFlashError
from ..runtime import LoadSpec
from ..targets.base import Target
from ..weights import read_config
from .config import DrafterConfig
from .gguf_drafter import is_drafter_gguf
from .torch_drafter import DFlashDrafter

if TYPE_CHECKING:
    from .mtp import MtpDrafter
    from .native import NativeDrafter


def native_runs(drafter: Path | None) -> bool:
    """Whether llama.cpp's native drafter runs this drafter: none, a drafter GGUF, or a folder whose layers it handles
    (published causal sliding drafters run on the torch drafter)."""
    if drafter is None or is_drafter_gguf(drafter) or not drafter.is_dir():
        return True
    return DrafterConfig.from_dict(read_config(drafter), drafter).native_refusal() is None


def load_drafter(folder: str | Path, target: Target, spec: LoadSpec) -> DFlashDrafter | NativeDrafter | MtpDrafter:
    """The drafter kind `spec` names (planned: runtime.plan_load) from `folder`, beside `target`, its cache as long
    as the target's (with spec.mtp, the target's own MTP layers); the target is left as it was loaded."""
    runtime = spec.runtime
    if spec.mtp:
        from .mtp import MtpDrafter

        return MtpDrafter.load(target, spec)
    if runtime.drafter == "native" and spec.drafter_quantize is not None:
        raise DFlashError("The native llama.cpp drafter cannot be quantized; use --drafter-kind torch.")
    if runtime.drafter == "native":
        from .native import NativeDrafter

        return NativeDrafter.load(folder, target, spec)
    if runtime.drafter == "torch":
        if is_drafter_gguf(Path(folder)):
            raise DFlashError(
                f"{folder} is a llama.cpp drafter GGUF, which runs only as llama.cpp's native drafter beside a GGUF "
                "target (--drafter-kind native); the torch drafter reads a drafter folder."
            )
        return DFlashDrafter.load(folder, replace(spec, max_context=target.max_context))
    raise DFlashError(f"Unknown drafter kind '{runtime.drafter}' (use torch or native, or auto before planning).")
