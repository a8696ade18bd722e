"""After `./install.sh --dev`: .venv holds the locked versions and our CLI, and the oracle lives apart in its venv."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from reference import oracle_python

REPO = Path(__file__).resolve().parent.parent
TORCH_BUILD = re.compile(r"^(nvidia|cuda)-")  # a CUDA torch wheel's own exact pins, absent from a CPU lock


def locked(path: Path) -> dict[str, Version]:
    """name -> version of each `name==version` line of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def installed_closure(root: str, extras: set[str]) -> dict[str, Version]:
    """Every distribution that root[extras] needs here, transitively, with its installed version."""
    found: dict[str, Version] = {}
    todo = [(root, extras)]
    while todo:
        current, wanted = todo.pop()
        for requirement in map(Requirement, importlib.metadata.requires(current) or []):
            key = canonicalize_name(requirement.name)
            marker = requirement.marker
            if key == canonicalize_name(root) or key in found:
                continue
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in wanted | {""}):
                found[key] = Version(importlib.metadata.version(requirement.name))
                todo.append((requirement.name, set(requirement.extras)))
    return found


def test_venv_has_exactly_the_locked_versions():
    pins = locked(REPO / "constraints.txt")
    needed = installed_closure("dflash-local", {"dev", "gguf", "gpu"})
    assert {"torch", "huggingface-hub", "llama-cpp-python", "pytest"} <= needed.keys()
    wrong = {
        name: (str(version), str(pins.get(name)))
        for name, version in needed.items()
        if not TORCH_BUILD.match(name) and Version(version.public) != pins.get(name)
    }
    assert wrong == {}, "installed vs constraints.txt"


def test_dflash_console_script_is_ours():
    result = subprocess.run([Path(sys.prefix) / "bin" / "dflash", "--version"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dflash-local ")


def test_venv_has_no_oracle_packages():
    assert importlib.util.find_spec("transformers") is None
    assert importlib.util.find_spec("dflash") is None


def test_oracle_venv_runs_the_reference():
    code = "import sys, dflash.model, transformers; print(sys.prefix)"
    result = subprocess.run([oracle_python(), "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) != Path(sys.prefix)  # its own venv, not ours


def fake_nvidia_smi(folder: Path, cuda: str) -> dict[str, str]:
    """An environment whose nvidia-smi reports a driver for CUDA `cuda` (and a compute capability of 9.0), with no
    nvcc on PATH or under CUDA_HOME."""
    smi = folder / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$*" in *compute_cap*) echo 9.0 ;;\n'
        f"*) echo '| NVIDIA-SMI 570.00  Driver Version: 570.00  CUDA Version: {cuda}  |' ;; esac\n"
    )
    smi.chmod(0o755)
    return {"PATH": f"{folder}:/usr/bin:/bin", "CUDA_HOME": str(folder / "no-cuda"), "HOME": str(folder)}


def test_a_cuda_build_without_nvcc_names_what_is_missing(tmp_path):
    """tools/gpu_build_deps.sh cuda (install.sh --gpu cuda) with no nvcc: the CUDA 13 toolkit wheels need a driver for
    CUDA 13, so an older driver gets one phrase naming both ways out, and no GPU gets its own."""
    deps = [str(REPO / "tools" / "gpu_build_deps.sh"), "cuda"]
    old = subprocess.run(deps, capture_output=True, text=True, env=fake_nvidia_smi(tmp_path, "12.4"), timeout=60)
    assert old.returncode == 1 and old.stdout.count("\n") == 1, old
    assert "CUDA toolkit wheels (CUDA 13) need a newer NVIDIA driver than this one (CUDA 12)" in old.stdout, old
    assert not (REPO / ".venv" / "lib" / "dflash-cuda-toolkit").exists()
    none = subprocess.run(deps, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert none.returncode == 1 and none.stdout.startswith("it needs an NVIDIA GPU that nvidia-smi sees"), none
