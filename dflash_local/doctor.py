"""`dflash doctor`: what this machine offers (torch, CUDA, Triton, bitsandbytes, llama.cpp) and what fits."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .hub import HubSource, human_size
from .paths import cache_dir, state_dir


@dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, what was found, and whether that is fine."""

    name: str
    found: str
    ok: bool | None = True  # None: informational


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


HOST_RAM = "CPU RAM"


def memory_budget() -> tuple[str, float]:
    """Where models run and how many GB they can use there: the first GPU's VRAM, else RAM."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"GPU {props.name}", props.total_memory / 1e9
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return HOST_RAM, pages / 1e9


def run_checks() -> list[Check]:
    """What this machine offers: torch, CUDA, Triton, bitsandbytes, llama.cpp, huggingface_hub, the cache's disk."""
    import torch

    from .runtime import bf16_is_fast

    checks = [Check("torch", torch.__version__)]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        checks.append(Check("CUDA", f"{torch.version.cuda}: {props.name}, {props.total_memory / 2**30:.1f} GiB VRAM"))
    else:
        cuda = "not built into this torch" if torch.version.cuda is None else "no GPU visible"
        checks.append(Check("CUDA", cuda, None))
        checks.append(
            Check("CPU bf16", "fast (AMX / AVX-512 bf16)" if bf16_is_fast("cpu") else "slow: float32 is used", None)
        )
    triton = _version("triton")
    checks.append(
        Check("Triton", triton or "not installed (drafter kernels use plain torch)", None if not triton else True)
    )
    bnb = _version("bitsandbytes")
    checks.append(Check("bitsandbytes", bnb or "not installed (no NF4 targets)", None if not bnb else True))
    checks.append(_llama_cpp_check())
    checks += device_checks()
    checks.append(_hub_check())
    free = shutil.disk_usage(cache_dir() if cache_dir().exists() else cache_dir().anchor).free
    checks.append(Check("model cache", f"{cache_dir()} ({human_size(free)} free)", None))
    return checks + cost_table_checks()


AFRESH = "its pair's next load measures it afresh (or: dflash bench --calibrate)"


def cost_table_checks() -> list[Check]:
    """The cached block-cost tables (--block-size auto): one line for all that look consistent, one per table that
    does not (see block_policy.inconsistencies; the next load of its pair measures it afresh)."""
    from .block_policy import CostTable, inconsistencies

    folder = state_dir() / "block-costs"
    paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
    bad = []
    for path in paths:
        try:
            costs = CostTable.from_dict(json.loads(path.read_text())["costs"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            bad.append(Check("block-cost table", f"{path.name} is unreadable: {AFRESH}", False))
            continue
        problems = inconsistencies(costs)
        if problems:
            when = (
                time.strftime("%Y-%m-%d %H:%M", time.localtime(costs.measured_at)) if costs.measured_at else "no date"
            )
            found = f"{path.name} (measured: {when}) looks inconsistent: {problems[0]}; {AFRESH}"
            bad.append(Check("block-cost table", found, False))
    return bad or [Check("block-cost tables", f"{len(paths)} in {folder}, consistent")][: len(paths)]


class _NotPulled(Exception):
    """Raised instead of downloading: doctor only looks."""

    def __init__(self, source: HubSource) -> None:
        super().__init__(source.repo)
        self.source = source


def _refuse(source: HubSource) -> Path:
    raise _NotPulled(source)


def model_checks(name: str) -> list[Check]:
    """Whether a model (name, Hub repo, folder or .gguf file, resolved as every verb does) is here and fits."""
    from .catalog import ModelEntry, local_target, lookup, resolve

    entry = None
    if local_target(name) is None:
        found = lookup(name)
        entry = found if isinstance(found, ModelEntry) else None
    try:
        resolved = resolve(name, None, _refuse)
    except _NotPulled as missing:
        where = Check(name, f"{missing.source.repo} is not downloaded (dflash pull {name})", None)
        if entry is None:
            return [where, Check(f"{name} fits?", "unknown until it is downloaded", None)]
        images = images_check(name, f"fetched by `dflash pull {name}`" if entry.mmproj is not None else None)
        return [where, images, fit_check(name, entry.memory_gb, "the catalog's estimate")]
    on_disk = "bundled" if entry is not None and entry.bundled else f"on disk: {resolved.target}"
    checks = [Check(name, on_disk + ("" if resolved.drafter else "; no drafter (pass --drafter)"))]
    projector = resolved.mmproj
    checks.append(images_check(name, None if projector is None else f"{projector}, {human_size(_size(projector))}"))
    need, basis = estimate_gb(resolved.target, resolved.drafter, projector)
    return [*checks, fit_check(name, need, basis)]


def images_check(name: str, projector: str | None) -> Check:
    """Whether a model takes images: the projector loaded with it (where it is), or none."""
    if projector is None:
        return Check(f"{name} images?", "no: text only (a GGUF vision target takes --mmproj FILE)", None)
    return Check(f"{name} images?", f"yes: its vision projector loads with it ({projector})")


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def fit_check(name: str, need_gb: float, basis: str) -> Check:
    """Does a model needing need_gb fit where models run here (the first GPU, else RAM)? Where that is host RAM, serve's
    and chat's default prompt cache (--cache-ram, a budget filled as prompts are saved) is weighed too: a model that
    fits but leaves less than the budget is a warning naming the --cache-ram that fits."""
    from .defaults import CACHE_RAM_MIB

    where, budget = memory_budget()
    found = f"needs ~{need_gb:.1f} GB ({basis}), {where} has {budget:.1f} GB"
    if need_gb > budget:
        return Check(f"{name} fits?", f"{found}: does NOT fit", False)
    left_mib = int((budget - need_gb) * 1e9 / 2**20)
    if where == HOST_RAM and left_mib < CACHE_RAM_MIB:
        advice = f"fits, but not beside the default prompt cache ({CACHE_RAM_MIB} MiB): pass --cache-ram {left_mib}"
        return Check(f"{name} fits?", f"{found}: {advice}", None)
    return Check(f"{name} fits?", f"{found}: fits", True)


def estimate_gb(target: Path, drafter: Path | None, projector: Path | None = None) -> tuple[float, str]:
    """GB a local model needs with a default-length context, from its files' shapes (and the vision projector's
    file, which libmtmd loads whole), and what that counts."""
    from .defaults import DEFAULT_CONTEXT
    from .memory_estimate import Estimate, estimate_files

    estimate = estimate_files(target, drafter, DEFAULT_CONTEXT)
    if projector is not None:
        estimate = Estimate(estimate.parts | {"vision projector": _size(projector)})
    return estimate.total_gb, f"{DEFAULT_CONTEXT}-token context: {estimate.summary()}"


def _hub_check() -> Check:
    """huggingface_hub and its HTTP stack import and build a session (pull needs both)."""
    version = _version("huggingface_hub")
    if version is None:
        return Check("huggingface_hub", "not installed: dflash pull cannot download", False)
    try:
        import huggingface_hub

        session = huggingface_hub.get_session()
    except Exception as exc:  # a broken install raises anything from ImportError to AttributeError
        return Check("huggingface_hub", f"{version}, fails to load: {exc}", False)
    client = type(session).__module__.split(".")[0]
    return Check("huggingface_hub", f"{version}, HTTP client {client} {_version(client) or ''}".rstrip())


def _llama_cpp_check() -> Check:
    version = _version("llama-cpp-python")
    if version is None:
        return Check("llama-cpp-python", "not installed (no GGUF targets): pip install 'dflash-local[gguf]'", None)
    try:
        from .llama_lib import GPU_LIBS, INVARIANT_LIB, loaded_library, splits_prompt_rows
    except Exception as exc:  # a broken native build raises anything from OSError to RuntimeError
        return Check("llama-cpp-python", f"{version}, fails to load: {exc}", False)
    folder = loaded_library().parent
    if folder in (INVARIANT_LIB, *GPU_LIBS.values()):
        prompts = "full-speed prompts" if splits_prompt_rows(folder) else "slow prompts: ./install.sh rebuilds it"
        return Check("llama-cpp-python", f"{version}; dflash's batch-invariant libllama, {prompts} ({folder})")
    stock = "stock libllama: F16/BF16/F32 verification may differ in the last bits on the CPU (./install.sh)"
    return Check("llama-cpp-python", f"{version}, {stock}", None)


def device_checks() -> list[Check]:
    """llama.cpp's backends and each of its devices with free memory: what --device names, and which auto takes."""
    try:
        from .devices import library_backends, library_devices, resolve_device
        from .llama_lib import UNLOADABLE
    except Exception:  # the llama-cpp-python line says why the library does not load
        return []
    checks = [Check("llama.cpp backends", ", ".join(library_backends()))]
    auto = resolve_device("auto")
    for device in library_devices():
        role = " [auto]" if device == auto or auto is None and device.kind == "cpu" else ""
        role += " (software: only an explicit --device uses it)" if device.software else ""
        memory = f"{human_size(device.free)} free of {human_size(device.total)}"
        checks.append(Check(f"device {device.name}", f"{device.backend}: {device.description}{role}, {memory}", None))
    checks += [Check("GPU libllama", f"{line}: not loadable, the CPU build runs", False) for line in UNLOADABLE]
    return checks
