"""A GGUF file's Llama/Qwen3 tensors for the torch target, its quantized blocks straight into GroupQuantLinear's int4 /
int8 groups (kernels.wq_matmul's format), decoded on the target's device one tensor at a time.

The mapping (v: the stored code, w = v * scale + min):
- Q4_0: int4 groups of 32 without a min (v = nibble - 8), scale d;
- Q4_K: int4 groups of 32 (its sub-blocks) with a min, scale d * sc, min -dmin * m (6-bit sc, m);
- Q5_0: int8 groups of 32, v = q - 16, scale d;
- Q5_K: int8 groups of 32 with a min, v = q (0..31), scale d * sc, min -dmin * m;
- Q6_K: int8 groups of 16 (its sub-blocks), v = q - 32, scale d * sc (8-bit sc);
- Q8_0: int8 groups of 32, scale d.
Every value is exact with fp32 scales (fp32 compute); with 16-bit compute the scales are kept in fp16, which holds d
exactly (Q4_0, Q5_0, Q8_0) but rounds the products d * sc and dmin * m of the K-quants to 11 significant bits.
F32, F16 and BF16 matrices load as plain linears in the compute dtype; other types are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from torch import nn

from ..errors import DFlashError
from ..quant import GroupQuantLinear, group_scale_dtype
from .file import GGUFHeader, GGUFTensor, gguf_dimensions
from .shape import LAYER_TENSORS

ARCHITECTURES = ("llama", "qwen3")
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
HF_NAMES = {gguf_name: hf_name for hf_name, gguf_name in LAYER_TENSORS.items()}  # GGUF layer tensor -> HF


def _half(blocks: torch.Tensor, begin: int) -> torch.Tensor:
    """The fp16 stored at byte `begin` of each block, as fp32 [blocks, 1]."""
    return blocks[:, begin : begin + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high ones."""
    return torch.stack((packed & 15, packed >> 4), dim=-2)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's eight 6-bit sub-block scales and mins (bytes 4..15), as fp32 [blocks, 8] each."""
    packed = blocks[:, 4:16].view(-1, 3, 4)
    low, high, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat((low & 63, (mixed & 15) | ((low >> 2) & 48)), dim=-1)
    mins = torch.cat((high & 63, (mixed >> 4) | ((high >> 2) & 48)), dim=-1)
    return scales.float(), mins.float()


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[blocks, n] bytes -> [blocks, count, n]: bit i of every byte at [:, i]."""
    shifts = torch.arange(count, dtype=torch.uint8, device=packed.device)
    return (packed[:, None, :] >> shifts[None, :, None]) & 1


def decode_blocks(kind: Q, blocks: torch.Tensor):
    """(values [blocks, 256 or 32], scales, mins or None [blocks, groups], bits, group) of raw GGUF blocks (uint8
    [blocks, type size]); values are int4 nibbles (uint8) or int8 codes."""
    n = blocks.shape[0]
    if kind == Q.Q4_0:
        return _nibbles(blocks[:, 2:18]).reshape(n, 32), _half(blocks, 0), None, 4, 32
    if kind == Q.Q8_0:
        return blocks[:, 2:34].contiguous().view(torch.int8), _half(blocks, 0), None, 8, 32
    if kind == Q.Q5_0:
        high = _bits(blocks[:, 2:6], 8).transpose(1, 2).reshape(n, 32)  # bit j of the little-endian uint32
        values = _nibbles(blocks[:, 6:22]).reshape(n, 32) | (high << 4)
        return (values.to(torch.int16) - 16).to(torch.int8), _half(blocks, 0), None, 8, 32
    if kind in (Q.Q4_K, Q.Q5_K):
        sc, m = _k_scales(blocks)
        scales, mins = _half(blocks, 0) * sc, -(_half(blocks, 2) * m)
        if kind == Q.Q4_K:
            return _nibbles(blocks[:, 16:144].view(n, 4, 32)).reshape(n, 256), scales, mins, 4, 32
        values = _nibbles(blocks[:, 48:176].view(n, 4, 32)).reshape(n, 8, 32) | (_bits(blocks[:, 16:48], 8) << 4)
        return values.reshape(n, 256).to(torch.int8), scales, mins, 8, 32
    if kind == Q.Q6_K:
        low = _nibbles(blocks[:, :128].view(n, 2, 64)).reshape(n, 8, 32)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)
        high = ((blocks[:, 128:192].view(n, 2, 1, 32) >> shifts[None, None, :, None]) & 3).reshape(n, 8, 32)
        values = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, 256)
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float() * _half(blocks, 208)
        return values, scales, None, 8, 16
    raise ValueError(kind)


QUANT_TYPES = (Q.Q4_0, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q6_K, Q.Q8_0)


DECODE_ROWS = 8192  # matrix rows decoded at a time: a 128K-row head's fp32 intermediates stay a few hundred MB


def quantized_matrix(raw: torch.Tensor, kind: Q, scale_dtype: torch.dtype) -> GroupQuantLinear:
    """A GroupQuantLinear from a matrix's raw GGUF rows (uint8 [out, bytes per row], on the device to decode on),
    decoded DECODE_ROWS rows at a time."""
    codes, scales, mins = [], [], []
    for begin in range(0, raw.shape[0], DECODE_ROWS):
        rows = raw[begin : begin + DECODE_ROWS]
        values, part_scales, part_mins, bits, group = decode_blocks(kind, rows.reshape(-1, GGML_QUANT_SIZES[kind][1]))
        values = values.reshape(rows.shape[0], -1)
        codes.append(values[:, 0::2] | (values[:, 1::2] << 4) if bits == 4 else values)
        scales.append(part_scales.reshape(rows.shape[0], -1).to(scale_dtype))
        if part_mins is not None:
            mins.append(part_mins.reshape(rows.shape[0], -1).to(scale_dtype))
    return GroupQuantLinear(torch.cat(codes), torch.cat(scales), torch.cat(mins) if mins else None, bits, group)


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's interleaved RoPE layout of a llama q/k matrix (HF's rotate-half)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class GGUFReader:
    """One GGUF file's tensors read and decoded for the torch target on a device."""

    def __init__(self, path: Path, header: GGUFHeader, dtype: torch.dtype, device: str) -> None:
        self.path, self.tensors, self.dtype, self.device = path, header.tensors, dtype, device

    def tensor(self, name: str) -> GGUFTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise DFlashError(f"{self.path} lacks the tensor {name}.")
        return tensor

    def raw(self, tensor: GGUFTensor, order: torch.Tensor | None) -> torch.Tensor:
        """Its rows' bytes (uint8 [rows, bytes per row]) on the device, in `order` if given."""
        rows = torch.from_numpy(tensor.read_rows(slice(None)).copy())
        return (rows if order is None else rows[order]).to(self.device)

    def floats(self, name: str, order: torch.Tensor | None = None) -> torch.Tensor:
        """A float tensor (a norm, or an F32/F16/BF16 matrix) in the compute dtype, GGUF shape reversed."""
        tensor = self.tensor(name)
        raw = self.raw(tensor, order)
        return raw.view(FLOAT_TYPES[tensor.tensor_type]).reshape(tuple(reversed(tensor.shape))).to(self.dtype)

    def matrix(self, name: str, shape: tuple[int, int], heads: int | None = None) -> nn.Module:
        """The linear [out, in] stored under name: a GroupQuantLinear, or a plain one for float types."""
        tensor = self.tensor(name)
        if tuple(reversed(tensor.shape)) != shape:
            raise DFlashError(
                f"{self.path}: tensor {name} has shape {tuple(reversed(tensor.shape))}, the metadata implies {shape}."
            )
        order = None if heads is None else rope_rows(shape[0], heads)
        if tensor.tensor_type in FLOAT_TYPES:
            linear = nn.Linear(shape[1], shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(self.floats(name, order), requires_grad=False)
            return linear
        if tensor.tensor_type not in QUANT_TYPES:
            supported = ", ".join(kind.name for kind in (*FLOAT_TYPES, *QUANT_TYPES))
            raise DFlashError(
                f"{self.path}: tensor {name} is {tensor.tensor_type.name}, which the torch backend does not load "
                f"(it loads {supported}); use --backend llamacpp."
            )
        raw = self.raw(tensor, order)
        return quantized_matrix(raw, tensor.tensor_type, group_scale_dtype(self.dtype))


def gguf_config(path: Path, fields: dict, tensors: dict[str, GGUFTensor]) -> dict:
    """The HF-style config.json of a GGUF file's Llama/Qwen3 model, from its metadata."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DFlashError(
            f"{path} holds a '{arch}' model; the torch backend loads {', '.join(ARCHITECTURES)} models "
            "(use --backend llamacpp)."
        )

    def key(name: str, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise DFlashError(f"{path} lacks the GGUF metadata key {arch}.{name}.")
        return value

    if "token_embd.weight" not in tensors:
        raise DFlashError(f"{path} lacks the tensor token_embd.weight.")
    dims = gguf_dimensions(path, GGUFHeader(fields, tensors))
    config = {
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise DFlashError(f"{path}: RoPE scaling '{scaling}' is not supported by the torch backend.")
    return config
