"""`dflash doctor`: what this machine offers (torch, CUDA, Triton, bitsandbytes, llama.cpp) and what fits."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from dataclasses import dataclass

from .hub import cache_dir, human_size


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


def memory_budget() -> tuple[str, float]:
    """Where models run and how many GB they can use there: the first GPU's VRAM, else RAM."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"GPU {props.name}", props.total_memory / 1e9
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return "CPU RAM", pages / 1e9


def run_checks(memory_gb: float | None = None, model: str | None = None) -> list[Check]:
    """Everything doctor reports; memory_gb/model add a does-it-fit line."""
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
    free = shutil.disk_usage(cache_dir() if cache_dir().exists() else cache_dir().anchor).free
    checks.append(Check("model cache", f"{cache_dir()} ({human_size(free)} free)", None))
    if memory_gb is not None:
        where, budget = memory_budget()
        fits = memory_gb <= budget
        verdict = "fits" if fits else "does NOT fit"
        checks.append(Check(f"{model}", f"needs ~{memory_gb:.1f} GB, {where} has {budget:.1f} GB: {verdict}", fits))
    return checks


def _llama_cpp_check() -> Check:
    version = _version("llama-cpp-python")
    if version is None:
        return Check("llama-cpp-python", "not installed (no GGUF targets): pip install 'dflash-local[gguf]'", None)
    try:
        import llama_cpp

        gpu = bool(llama_cpp.llama_supports_gpu_offload())
    except Exception as exc:  # a broken native build raises anything from OSError to RuntimeError
        return Check("llama-cpp-python", f"{version}, fails to load: {exc}", False)
    return Check("llama-cpp-python", f"{version}, {'GPU offload' if gpu else 'CPU-only build'}")
