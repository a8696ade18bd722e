"""Reading and validating a GGUF file with the `gguf` package, before llama.cpp (which may abort) sees it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf

from .errors import DFlashError

# Architectures whose llama.cpp graphs expose the layer-input taps and that the converter writes.
TAPPED_ARCHITECTURES = ("llama", "qwen3")


@dataclass
class GGUFModel:
    """A validated GGUF target: its hyperparameters and the reader for its tensors."""

    path: Path
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    eos_ids: frozenset[int]
    reader: object


def _field(reader, key: str, path: Path, required: bool = True):
    field = reader.get_field(key)
    if field is None:
        if required:
            raise DFlashError(f"{path} lacks the GGUF metadata key {key}.")
        return None
    return field.contents()


def read_gguf(path: Path) -> GGUFModel:
    """Open and check a GGUF file: readable, complete, a tapped architecture; raise DFlashError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path} is not a file.")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
        raise DFlashError(f"{path} is not a complete, readable GGUF file ({exc}).") from None
    size = path.stat().st_size
    for info in reader.tensors:
        if info.data_offset + info.n_bytes > size or info.data.nbytes != info.n_bytes:
            raise DFlashError(f"{path} is truncated: tensor {info.name} runs past the end of the file.")
    arch = _field(reader, "general.architecture", path)
    if arch not in TAPPED_ARCHITECTURES:
        raise DFlashError(
            f"{path} holds a '{arch}' model; the llama.cpp backend reads layer features only from "
            f"{', '.join(TAPPED_ARCHITECTURES)} models."
        )
    tokens = _field(reader, "tokenizer.ggml.tokens", path, required=False)
    vocab = _field(reader, f"{arch}.vocab_size", path, required=False) or (len(tokens) if tokens else None)
    if vocab is None:
        raise DFlashError(f"{path} states no vocabulary size.")
    eos = _field(reader, "tokenizer.ggml.eos_token_id", path, required=False)
    return GGUFModel(
        path=path,
        architecture=arch,
        num_layers=int(_field(reader, f"{arch}.block_count", path)),
        hidden_size=int(_field(reader, f"{arch}.embedding_length", path)),
        vocab_size=int(vocab),
        context_length=int(_field(reader, f"{arch}.context_length", path)),
        eos_ids=frozenset() if eos is None else frozenset([int(eos)]),
        reader=reader,
    )
