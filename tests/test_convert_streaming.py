"""`dflash convert` streams: one tensor in memory at a time, and the files are byte for byte those of the converter
that loaded every tensor as fp32 (hashes taken from that converter's output)."""

from __future__ import annotations

import hashlib
import json
import struct
import weakref
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from dflash_local.errors import DFlashError  # noqa: E402
from dflash_local.gguf import convert as gguf_convert  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
# sha256 of models/tiny/target converted by the fp32 converter (commit 52b62d3), per type
BEFORE = {
    "f16": "3790d16fb277733556964d16ef8e85c83c3f7ab67361dc73ccce7ad5c47f77df",
    "q8_0": "19ad7b605d8937b67172881857e667ee2f773d54cb348d6ef584df1089e22d21",
}


def test_output_is_byte_identical_to_the_fp32_converter(tiny_gguf):
    for kind, path in tiny_gguf.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == BEFORE[kind], kind


def test_one_tensor_is_read_at_a_time(monkeypatch, tmp_path):
    """Every source tensor is read once, and the one read before it is freed by then."""
    alive: list[weakref.ref] = []
    reads: list[str] = []
    real = gguf_convert.read_stored

    def tracked(tensor):
        assert sum(ref() is not None for ref in alive) == 0, "an earlier tensor is still held"
        array = real(tensor)
        alive.append(weakref.ref(array))
        reads.append(tensor.offset)
        return array

    monkeypatch.setattr(gguf_convert, "read_stored", tracked)
    gguf_convert.convert(TINY / "target", tmp_path / "tiny.gguf", "bf16", threads=1)
    header = json.loads((TINY / "target" / "model.safetensors").read_bytes()[8:][: _header_length()])
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(header) - 1


def _header_length() -> int:
    return struct.unpack("<Q", (TINY / "target" / "model.safetensors").read_bytes()[:8])[0]


def test_unsupported_tensor_types_are_one_sentence(tmp_path):
    source = tmp_path / "f64"
    source.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (source / name).write_bytes((TINY / "target" / name).read_bytes())
    header = {"model.embed_tokens.weight": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}}
    raw = json.dumps(header).encode()
    (source / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(DFlashError) as error:
        gguf_convert.convert(source, tmp_path / "out.gguf", "f16")
    assert str(error.value) == f"{source / 'model.safetensors'}: tensors of type F64 cannot be converted."
    assert not list(tmp_path.glob("out.gguf*"))
