"""Reading config.json, JSONL and safetensors weights from disk, with clear errors."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


def _shown(value: Any) -> str:
    """A config value as JSON, for error messages."""
    return json.dumps(value)


def need(config: dict[str, Any], key: str, path: Path) -> Any:
    """config[key], or one sentence saying the file lacks it."""
    if key not in config:
        raise DFlashError(f"{path} lacks the field {key}.")
    return config[key]


def check_int(value: Any, name: str, path: Path, minimum: int = 1) -> None:
    """Raise one sentence naming the file and field unless value is an integer of at least minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise DFlashError(f"{path}: {name} must be {what}, got {_shown(value)}.")


def check_number(value: Any, name: str, path: Path, positive: bool = True) -> None:
    """Raise one sentence naming the file and field unless value is a finite (positive) number."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise DFlashError(f"{path}: {name} must be a {'positive ' if positive else ''}number, got {_shown(value)}.")


def check_optional(config: dict[str, Any], key: str, path: Path, kind: type) -> None:
    """A field that may be absent or null, else must be true/false (bool) or a positive integer (int)."""
    value = config.get(key)
    if value is None:
        return
    if kind is bool and not isinstance(value, bool):
        raise DFlashError(f"{path}: {key} must be true or false, got {_shown(value)}.")
    if kind is int:
        check_int(value, key, path)


def check_attention_shape(config: dict[str, Any], path: Path) -> None:
    """Hidden size, head counts and head_dim of a Llama/Qwen3-style config.json: types and divisibility."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        check_int(need(config, key, path), key, path)
    for key in ("num_key_value_heads", "head_dim"):
        check_optional(config, key, path, int)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise DFlashError(f"{path}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads}).")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise DFlashError(
                f"{path}: num_attention_heads ({heads}) must divide hidden_size ({hidden}) when head_dim is absent."
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise DFlashError(f"{path}: the head dimension must be even for RoPE, got {head_dim}.")
    check_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", path)
    check_optional(config, "attention_bias", path, bool)


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


def read_weights(
    folder: Path, dtype: torch.dtype | None, device: torch.device | str = "cpu", as_stored: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a folder's safetensors file(s), one at a time, cast to dtype (None: as
    stored; names in as_stored stay as stored) on device; plain file reads, so no mapped file counts in the RSS."""
    for name, stored in stored_tensors(Path(folder)).items():
        array = read_stored(stored)
        tensor = torch.from_numpy(array).view(torch.bfloat16) if stored.dtype == "BF16" else torch.from_numpy(array)
        keep = name in as_stored or not tensor.is_floating_point()  # integers (a draft vocabulary) stay as stored
        yield name, tensor.to(device=device, dtype=None if keep else dtype)


def load_weights(
    folder: Path, dtype: torch.dtype | None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors file(s) by name (see read_weights)."""
    return dict(read_weights(folder, dtype, device))


# safetensors dtype -> numpy dtype of its raw elements (bf16 as its uint16 bit patterns)
STORED_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file, so it can be read alone (no memory map)."""

    path: Path
    dtype: str  # safetensors name: F32, F16, BF16, ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder's safetensors file(s) by name, shard by shard and sorted by name within a shard,
    read from the headers only."""
    found: dict[str, StoredTensor] = {}
    for path in _weight_files(Path(folder)):
        if not path.is_file():
            raise DFlashError(f"Weight shard {path} is missing.")
        try:
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            size = path.stat().st_size
            for name in sorted(key for key in header if key != "__metadata__"):
                entry = header[name]
                begin, end = entry["data_offsets"]
                if not 0 <= begin <= end <= size - 8 - length:
                    raise ValueError(f"tensor {name} lies past the end of the file")
                found[name] = StoredTensor(path, entry["dtype"], tuple(entry["shape"]), 8 + length + begin, end - begin)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise DFlashError(f"{path} is truncated or corrupted and cannot be read ({exc}).") from None
    return found


def read_stored(tensor: StoredTensor) -> np.ndarray:
    """One tensor's elements as stored (bf16 as uint16 bit patterns), read with plain file reads."""
    if tensor.dtype not in STORED_DTYPES:
        raise DFlashError(f"{tensor.path}: tensors of type {tensor.dtype} are not supported.")
    dtype = np.dtype(STORED_DTYPES[tensor.dtype])
    count = math.prod(tensor.shape)
    if count * dtype.itemsize != tensor.nbytes:
        raise DFlashError(f"{tensor.path} is truncated or corrupted and cannot be read (bad size of a tensor).")
    array = np.fromfile(tensor.path, dtype=dtype, count=count, offset=tensor.offset)
    if array.size != count:
        raise DFlashError(f"{tensor.path} is truncated or corrupted and cannot be read (a tensor is cut short).")
    return array.reshape(tensor.shape)


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: Path) -> torch.Tensor:
    """Pop one tensor by name and check its shape."""
    tensor = tensors.pop(name, None)
    if tensor is None:
        raise DFlashError(f"{source} lacks the tensor {name}.")
    if tuple(tensor.shape) != shape:
        raise DFlashError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}.")
    return tensor
