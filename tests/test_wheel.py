"""The wheel holds every file of the source tree where the package expects it: a new subpackage or a file under
models/ can not be left out of pip and pipx installs (.ci/run installs the wheel and runs it); the recipes that
rebuild the bundled models (models/*/recipe/) stay out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")


def source_files(tree: Path, folders: dict[str, str]) -> set[str]:
    """Each file under each source folder but the models' recipes, named as it lands in the wheel (package path /
    path in the folder)."""
    return {
        f"{package.replace('.', '/')}/{path.relative_to(tree / folder).as_posix()}"
        for package, folder in folders.items()
        for path in (tree / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and "recipe" not in path.parts
    }


def test_wheel_holds_the_source_tree(tmp_path: Path):
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {"dflash_local": "dflash_local", **config["tool"]["setuptools"]["package-dir"]}
    tree = tmp_path / "tree"  # a copy, so the build leaves no build/ or egg-info in the checkout
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tree / name)
    for folder in set(folders.values()):
        shutil.copytree(REPO / folder, tree / folder, ignore=SKIPPED)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", "dist", "."]
    # the build's child processes write rustup's settings.toml under RUSTUP_HOME (~/.rustup; seen with HOME empty)
    env = os.environ | {"RUSTUP_HOME": str(tmp_path / "rustup")}
    result = subprocess.run(build, cwd=tree, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tree / "dist").glob("dflash_local-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if ".dist-info/" not in name}
    assert {"dflash_local/train/trainer.py", "dflash_local/models/catalog.toml"} <= packed
    assert (tree / "models" / "tiny" / "recipe" / "train_target.py").is_file()
    assert not any("/recipe/" in name for name in packed)
    assert packed == source_files(tree, folders)
