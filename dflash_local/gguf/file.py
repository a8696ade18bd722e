"""Reading and validating a GGUF file's header (metadata and tensor table) before llama.cpp (which may abort) sees it.

The header is parsed here rather than with gguf-py's GGUFReader, which builds numpy views of every string of a
vocabulary (seconds per file at a 128K vocabulary); string arrays are skipped unless asked for.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ..dimensions import Dimensions
from ..errors import DFlashError

_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class UnreadStrings:
    """A string array the header reader skipped (a vocabulary's tokens or merges): only its length."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass
class GGUFTensor:
    """One entry of the tensor table: type, GGUF shape (row length first), absolute data offset and size."""

    path: Path
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int

    def read_rows(self, rows: slice | np.ndarray) -> np.ndarray:
        """Some rows' bytes (rows x bytes per row, the layout gguf.quants.dequantize takes), read with plain file
        reads: no mapped page stays resident, so reading a 128K-row head once adds nothing to the RSS after."""
        count = math.prod(self.shape[1:])
        width = self.n_bytes // count
        with open(self.path, "rb", buffering=0) as handle:
            if isinstance(rows, slice):
                begin, end, _ = rows.indices(count)
                handle.seek(self.data_offset + begin * width)
                data = handle.read(max(end - begin, 0) * width)
                return np.frombuffer(data, np.uint8).reshape(-1, width)
            out = np.empty((len(rows), width), np.uint8)
            for index, row in enumerate(np.asarray(rows).reshape(-1).tolist()):
                out[index] = np.frombuffer(os.pread(handle.fileno(), width, self.data_offset + row * width), np.uint8)
            return out


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (string arrays as UnreadStrings unless asked for) and tensor table by name."""

    fields: dict[str, object]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Little-endian reads from a buffer at a moving position; struct.error past its end."""

    def __init__(self, view: mmap.mmap) -> None:
        self.view, self.pos = view, 0

    def take(self, code: str) -> int | float | bool:
        (value,) = struct.unpack_from("<" + code, self.view, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.take("Q")
        if self.pos + size > len(self.view):
            raise ValueError("a string runs past the end of the file")
        text = self.view[self.pos : self.pos + size].decode("utf-8")
        self.pos += size
        return text

    def skip_strings(self, count: int) -> None:
        view, pos = self.view, self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", view, pos)[0]
        if pos > len(view):
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos

    def value(self, kind: int, read_strings: bool) -> object:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.take(_SCALARS[kind])
        item, count = GGUFValueType(self.take("I")), self.take("Q")
        if item == GGUFValueType.STRING:
            if read_strings:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return UnreadStrings(count)
        code = _SCALARS[item]  # KeyError for nested arrays, which no model key uses
        values = np.frombuffer(self.view, np.dtype("<" + code), count, self.pos).tolist()
        self.pos += struct.calcsize(code) * count
        return values


def read_header(path: Path, strings: Collection[str] = ()) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table, reading string arrays only for the keys in `strings`, and check
    that every tensor lies inside the file. Raises ValueError, KeyError or OSError on a broken or truncated file."""
    path = Path(path)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        cursor = _Cursor(view)
        try:
            if cursor.take("I") != GGUF_MAGIC:
                raise ValueError("it does not start with the GGUF magic number")
            version = cursor.take("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported")
            n_tensors, n_fields = cursor.take("Q"), cursor.take("Q")
            fields: dict[str, object] = {}
            for _ in range(n_fields):
                key = cursor.string()
                if key in fields:
                    raise ValueError(f"the metadata key {key} appears twice")
                fields[key] = cursor.value(cursor.take("I"), key in strings)
            table = []
            for _ in range(n_tensors):
                name = cursor.string()
                shape = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
                table.append((name, GGMLQuantizationType(cursor.take("I")), shape, cursor.take("Q")))
        except struct.error:
            raise ValueError("its header ends early") from None
        alignment = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        size = len(view)
    tensors: dict[str, GGUFTensor] = {}
    for name, kind, shape, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        tensor = GGUFTensor(path, name, kind, shape, start + offset, math.prod(shape) // block * block_bytes)
        if name in tensors:
            raise ValueError(f"the tensor {name} appears twice")
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors[name] = tensor
    return GGUFHeader(fields, tensors)


@dataclass
class GGUFModel:
    """A validated GGUF target: its architecture, dimensions, trained context, end-of-sequence ids and tensor table."""

    path: Path
    architecture: str
    dims: Dimensions
    context_length: int
    eos_ids: frozenset[int]
    tensors: dict[str, GGUFTensor]
    mtp_layers: int = 0  # multi-token-prediction (nextn) blocks after the trunk's layers (dims.layers)


def _field(fields: dict[str, object], key: str, path: Path, required: bool = True):
    if key not in fields and required:
        raise DFlashError(f"{path} lacks the GGUF metadata key {key}.")
    return fields.get(key)


def gguf_dimensions(path: Path, header: GGUFHeader) -> Dimensions:
    """The decoder's dimensions in a GGUF file's metadata (the keys llama.cpp's converter and `dflash convert` write).
    A width the file states per layer (hybrid models) reads as its attention layers' one value (0 marks a layer
    without attention), else 0, as does one not stated; no depth, width or vocabulary raises DFlashError. Its layers
    are the trunk's: block_count less the multi-token-prediction (nextn) blocks appended after them."""
    fields = header.fields
    arch = _field(fields, "general.architecture", path)

    def stated(key: str, default: int = 0) -> int:
        value = fields.get(f"{arch}.{key}", default)
        if isinstance(value, int):
            return value
        widths = {int(width) for width in value if width}  # a list: one value per layer
        return widths.pop() if len(widths) == 1 else 0

    for key in ("block_count", "embedding_length"):
        if stated(key) < 1:
            raise DFlashError(f"{path} lacks the GGUF metadata key {arch}.{key}.")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = stated("vocab_size") or (len(tokens) if tokens else 0)
    if not vocab:
        raise DFlashError(f"{path} states no vocabulary size.")
    hidden, heads = stated("embedding_length"), stated("attention.head_count")
    return Dimensions(
        hidden=hidden,
        intermediate=stated("feed_forward_length"),
        layers=stated("block_count") - stated("nextn_predict_layers"),
        heads=heads,
        kv_heads=stated("attention.head_count_kv", heads),
        head_dim=stated("attention.key_length", hidden // heads if heads else 0),
        vocab=vocab,
        tied="output.weight" not in header.tensors,
    )


def read_gguf(path: Path) -> GGUFModel:
    """Open and check a GGUF file's header: readable and complete, with the keys dflash reads; raise DFlashError
    otherwise. Any architecture llama.cpp runs passes: whether its layer features can be read is asked later."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path} is not a file.")
    try:
        header = read_header(path)
    except (ValueError, KeyError, OSError) as exc:
        raise DFlashError(f"{path} is not a complete, readable GGUF file ({exc}).") from None
    fields = header.fields
    dims = gguf_dimensions(path, header)
    arch = fields["general.architecture"]
    eos = _field(fields, "tokenizer.ggml.eos_token_id", path, required=False)
    return GGUFModel(
        path=path,
        architecture=arch,
        dims=dims,
        context_length=int(_field(fields, f"{arch}.context_length", path)),
        eos_ids=frozenset() if eos is None else frozenset([int(eos)]),
        tensors=header.tensors,
        mtp_layers=int(fields.get(f"{arch}.nextn_predict_layers", 0)),
    )
