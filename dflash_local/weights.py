"""Reading config.json, JSONL and safetensors weights from disk, with clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import DFlashError


def read_config(folder: Path) -> dict[str, Any]:
    """Return the parsed config.json of a model folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DFlashError(f"{folder} is neither a model folder (config.json + safetensors) nor a .gguf file.")
    path = folder / "config.json"
    if not path.is_file():
        raise DFlashError(f"{folder} has no config.json, so it is not a model folder.")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{path} does not hold a JSON object.")
    return config


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file."""
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DFlashError(f"{path} line {number} is not valid JSON.") from None
        if not isinstance(record, dict):
            raise DFlashError(f"{path} line {number} is not a JSON object.")
        yield number, record


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DFlashError(f"{index} is not a valid safetensors index.") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise DFlashError(f"{folder} has no model.safetensors (or sharded index) to load weights from.")


def load_weights(
    folder: Path, dtype: torch.dtype | None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Load every tensor of a folder's safetensors file(s), cast to dtype (None: as stored) on device."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        if not path.is_file():
            raise DFlashError(f"Weight shard {path} is missing.")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise DFlashError(f"{path} is truncated or corrupted and cannot be read ({exc}).") from None
    return tensors


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: Path) -> torch.Tensor:
    """Pop one tensor by name and check its shape."""
    tensor = tensors.pop(name, None)
    if tensor is None:
        raise DFlashError(f"{source} lacks the tensor {name}.")
    if tuple(tensor.shape) != shape:
        raise DFlashError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}.")
    return tensor
