"""Quantized linear layers: weight-only int4/int8 group targets (`--quantize int4`, GGUF tensors) through
kernels.wq_matmul, NF4 targets through bitsandbytes (quantized on load, or pre-quantized bnb-4bit checkpoints), NF4 or
int8 drafters (int8 on the CPU through fbgemm's dynamic int8 linear), and the CPU's fp32 drafter layers through
fbgemm's fp16 GEMM.

Pre-quantized checkpoints use the Hugging Face layout: per quantized linear, `weight` (packed uint8) plus
`weight.absmax`, `weight.quant_map`, optional `weight.nested_*`, and `weight.quant_state.bitsandbytes__nf4`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .errors import DFlashError
from .kernels import dequantize, wq_matmul

QUANT_TYPES = ("int4", "nf4")
DRAFTER_QUANT_TYPES = ("int8", "nf4")
STATE_PREFIX = "quant_state.bitsandbytes__"


def bitsandbytes():
    """The bitsandbytes module, or a DFlashError saying how to install it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise DFlashError("Quantized models need bitsandbytes: pip install 'dflash-local[gpu]'.") from None
    return bnb


def check_quantize(quantize: str | None, supported: tuple[str, ...] = QUANT_TYPES) -> None:
    """Raise a DFlashError unless quantize is None or one of the supported types."""
    if quantize is not None and quantize not in supported:
        raise DFlashError(f"Unknown quantization '{quantize}' (supported: {', '.join(supported)}).")


def prequantized(config: dict[str, Any]) -> bool:
    """True for a bitsandbytes 4-bit checkpoint's config.json; other quantized checkpoints are refused."""
    quant = config.get("quantization_config")
    if not quant:
        return False
    if quant.get("quant_method") != "bitsandbytes" or not quant.get("load_in_4bit"):
        raise DFlashError(
            f"Quantized checkpoints of kind '{quant.get('quant_method')}' are not supported by the torch backend "
            "(supported: bitsandbytes 4-bit)."
        )
    return True


def _stats(tensors: dict[str, torch.Tensor], weight_name: str) -> dict[str, torch.Tensor]:
    prefix = weight_name + "."
    return {name[len(prefix) :]: tensors.pop(name) for name in list(tensors) if name.startswith(prefix)}


@functools.cache
def _linear_4bit_class(bnb) -> type:
    """bitsandbytes' Linear4bit, except that on the CPU every call dequantizes and multiplies (as bitsandbytes does
    for 2+ rows): its fused one-row CPU kernel, taken on AVX-512-BF16 CPUs, dies of a floating-point exception
    (bitsandbytes 0.50, a drafter's one-position context projections)."""

    class Linear4bit(bnb.nn.Linear4bit):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.device.type != "cpu":
                return super().forward(x)
            weight = bnb.functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    return Linear4bit


def linear_4bit(
    layer: nn.Linear,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: dict[str, torch.Tensor],
    compute_dtype: torch.dtype,
    device: str,
) -> nn.Module:
    """A bitsandbytes Linear4bit for layer's shape: from pre-quantized stats, else NF4-quantized from weight."""
    bnb = bitsandbytes()
    out_features, in_features = layer.weight.shape
    with torch.device("meta"):
        new = _linear_4bit_class(bnb)(
            in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype, quant_type="nf4"
        )
    if stats:
        try:
            new.weight = bnb.nn.Params4bit.from_prequantized(weight, stats, device=device, module=new)
        except (ValueError, KeyError, AssertionError, AttributeError, RuntimeError) as exc:
            raise DFlashError(f"its bitsandbytes quant state is malformed ({exc})") from None
    else:
        param = bnb.nn.Params4bit(weight.to(compute_dtype), requires_grad=False, quant_type="nf4", module=new)
        new.weight = param.to(device)
    if bias is not None:
        new.bias = nn.Parameter(bias.to(device=device, dtype=compute_dtype), requires_grad=False)
    return new


def _stored_linears(
    model: nn.Module, tensors: dict[str, torch.Tensor], scope: str, source: str
) -> Iterator[tuple[str, nn.Linear, torch.Tensor]]:
    """Each nn.Linear under model.<scope>, by full name, with its weight taken out of `tensors` (missing: an error)."""
    for name, layer in list(model.get_submodule(scope).named_modules()):
        if not isinstance(layer, nn.Linear):
            continue
        full = f"{scope}.{name}"
        weight = tensors.pop(f"{full}.weight", None)
        if weight is None:
            raise DFlashError(f"{source} lacks the tensor {full}.weight.")
        yield full, layer, weight


def _check_shape(source: str, full: str, weight: torch.Tensor, layer: nn.Linear) -> None:
    """Raise a DFlashError unless a stored weight has the shape the config gives its linear."""
    if tuple(weight.shape) != tuple(layer.weight.shape):
        raise DFlashError(
            f"{source}: tensor {full}.weight has shape {tuple(weight.shape)}, "
            f"the config implies {tuple(layer.weight.shape)}."
        )


def install_4bit(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    scope: str,
    compute_dtype: torch.dtype,
    device: str,
    source: str,
) -> list[str]:
    """Swap each nn.Linear under model.<scope> for a 4-bit one, taking its tensors out of `tensors`.

    A linear stored with bitsandbytes quant state loads as stored, a plain one is quantized to NF4; returns their names.
    """
    parent_of = dict(model.named_modules())
    swapped = []
    for full, layer, weight in _stored_linears(model, tensors, scope, source):
        stats = _stats(tensors, f"{full}.weight")
        if not stats:
            _check_shape(source, full, weight, layer)
        try:
            new = linear_4bit(layer, weight, tensors.pop(f"{full}.bias", None), stats, compute_dtype, device)
        except DFlashError as exc:
            raise DFlashError(f"{source}: the 4-bit tensor {full}.weight cannot be loaded: {exc}.") from None
        shape = tuple(new.weight.quant_state.shape)
        if shape != tuple(layer.weight.shape):
            raise DFlashError(
                f"{source}: the 4-bit tensor {full}.weight holds shape {shape}, "
                f"the config implies {tuple(layer.weight.shape)}."
            )
        owner_name, _, attr = full.rpartition(".")
        setattr(parent_of[owner_name], attr, new)
        swapped.append(full)
    return swapped


class _Fp16CastNotice(logging.Filter):
    """Drops bitsandbytes' per-call log line saying int8 matmuls round bf16/fp32 inputs to fp16."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def linear_int8(layer: nn.Linear) -> nn.Module:
    """A bitsandbytes int8 linear (row-wise absmax, no outlier columns) quantized from layer's CPU weight."""
    bnb = bitsandbytes()
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Fp16CastNotice) for f in logger.filters):
        logger.addFilter(_Fp16CastNotice())
    out_features, in_features = layer.weight.shape
    with torch.device("meta"):
        new = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=layer.bias is not None, has_fp16_weights=False, threshold=0.0
        )
    new.weight = bnb.nn.Int8Params(layer.weight.data, requires_grad=False, has_fp16_weights=False).to("cpu")
    if layer.bias is not None:
        new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    return new


INT8_PART_ROWS = 4096  # rows packed per fbgemm matrix: a 128K-row head packs in parts (a 1B head times 1-16 rows:
# 8192 within 4% of it with twice the transient memory while packing; 2048 4-15% slower)


def int8_pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    """weight quantized per row (absmax / 127 scales) to int8 and prepacked for fbgemm's dynamic int8 linear."""
    low, high = torch.aminmax(weight, dim=1)
    scales = (torch.maximum(-low, high).float() / 127).clamp_min(torch.finfo(torch.float32).tiny)
    rows = torch.div(weight, scales[:, None]).round_().to(torch.int8)  # |row / scale| <= 127 by construction
    with warnings.catch_warnings():  # torch deprecates quantized tensors; this one lives only until it is packed
        warnings.simplefilter("ignore", UserWarning)
        zeros = torch.zeros(len(scales), dtype=torch.long)
        rows = torch._make_per_channel_quantized_tensor(rows, scales.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(rows, None if bias is None else bias.float())


def on_rows(x: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """op applied to x [..., in] as fp32 rows [n, in] (what fbgemm's linears take), back in x's shape and dtype."""
    out = op(x.reshape(-1, x.shape[-1]).float())
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def int8_matmul(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) for a packed int8 W: fbgemm quantizes x per call (7-bit, per tensor), sums in int32.
    An 8192 x 2048 W on this AVX2 CPU, 4-16 rows: 4x faster than torch's weight-only int8 kernel, 9-30x than fp32."""
    return on_rows(x, lambda rows: torch.ops.quantized.linear_dynamic(rows, packed, True))


class Int8Matrix:
    """A matrix as int8_pack'ed parts of INT8_PART_ROWS rows."""

    def __init__(self, chunks: Iterable[torch.Tensor]) -> None:
        """Pack float row chunks, in order, through one part-sized buffer (the only unpacked rows held)."""
        self.parts: list[Any] = []
        buffer, filled = None, 0
        for chunk in chunks:
            while len(chunk):
                if buffer is None:
                    buffer, filled = chunk.new_empty((INT8_PART_ROWS, chunk.shape[1])), 0
                take = min(len(chunk), INT8_PART_ROWS - filled)
                buffer[filled : filled + take], chunk, filled = chunk[:take], chunk[take:], filled + take
                if filled == INT8_PART_ROWS:
                    self.parts.append(int8_pack(buffer))
                    buffer = None
        if buffer is not None:
            self.parts.append(int8_pack(buffer[:filled]))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ matrix.T: [..., rows]."""
        return torch.cat([int8_matmul(x, part) for part in self.parts], dim=-1)


class Int8Linear(nn.Module):
    """Dynamic int8 linear for the CPU: per-row int8 weights, activations quantized per call (int8_matmul)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.packed = int8_pack(layer.weight.data, None if layer.bias is None else layer.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.packed)


def fp16_holds(weight: torch.Tensor) -> bool:
    """True for bf16 or fp16 weights within fp16's range: fp16 holds them exactly down to 6e-5, below to 3e-8."""
    sixteen_bit = weight.dtype in (torch.bfloat16, torch.float16)
    return sixteen_bit and bool(weight.abs().max() <= torch.finfo(torch.float16).max)


class Fp16Linear(nn.Module):
    """A CPU linear with fp16 weights packed for fbgemm's GEMM (fp32 activations and sums): for 4-16 rows of an
    8192 x 2048 weight on this AVX2 CPU 4-10x faster than MKL's fp32 (which is slow for 2-16 rows), half the memory."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        bias = None if layer.bias is None else layer.bias.data.float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(layer.weight.data.float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(x, lambda rows: torch.ops.quantized.linear_dynamic_fp16(rows, self.packed))


INT4_GROUP = 128  # `--quantize int4`: groups of 128 input columns, each with a scale and a min (gpt-fast's default)


def group_scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype group scales and mins are kept in: fp32 for fp32 compute (exact), else fp16."""
    return torch.float32 if dtype == torch.float32 else torch.float16


class GroupQuantLinear(nn.Module):
    """A weight-only quantized linear (kernels.wq_matmul's format): int4 or int8 codes in groups along the input,
    each group with a scale and an optional min; Triton on CUDA, the torch reference elsewhere."""

    kernels: str = "auto"  # the kernel mode (layers.set_kernels)

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group: int
    ) -> None:
        super().__init__()
        if bits not in (4, 8) or group < 16 or group & (group - 1):
            raise ValueError(f"unsupported group quantization: {bits} bits, groups of {group}")
        self.bits, self.group = bits, group
        self.in_features = codes.shape[1] * (2 if bits == 4 else 1)
        self.out_features = codes.shape[0]
        if scales.shape != (self.out_features, self.in_features // group) or (
            mins is not None and mins.shape != scales.shape
        ):
            raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape {tuple(codes.shape)}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = wq_matmul(rows, self.codes, self.scales, self.mins, self.bits, self.group, kernels=self.kernels)
        return out.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight rows at ids (an embedding lookup), in dtype."""
        flat = ids.reshape(-1)
        mins = None if self.mins is None else self.mins[flat]
        weight = dequantize(self.codes[flat], self.scales[flat], mins, self.bits, self.group)
        return weight.to(dtype).view(*ids.shape, self.in_features)


class GroupQuantEmbedding(nn.Module):
    """An embedding table kept in GroupQuantLinear's format: only the looked-up rows are dequantized."""

    def __init__(self, table: GroupQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP, scale_dtype: torch.dtype = torch.float16):
    """(codes, scales, mins) of weight [out, in] as int4 groups: each group's min and (max - min) / 15 as its scale,
    nibbles rounded to nearest (asymmetric min-max quantization, in fp32 on weight's device)."""
    rows, width = weight.shape
    grouped = weight.float().view(rows, width // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).to(scale_dtype)
    mins = low.to(scale_dtype)
    step = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    nibbles = ((grouped - mins.float()[..., None]) / step).round_().clamp_(0, 15).to(torch.uint8).view(rows, width)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scales, mins


def int4_linear(layer: nn.Linear, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """layer as a GroupQuantLinear of int4 groups with mins (quantized on device), or layer itself in dtype when its
    input width is not a multiple of INT4_GROUP."""
    if layer.bias is not None or layer.in_features % INT4_GROUP:
        return layer.to(device=device, dtype=dtype)
    codes, scales, mins = quantize_int4(layer.weight.data.to(device), INT4_GROUP, group_scale_dtype(dtype))
    return GroupQuantLinear(codes, scales, mins, 4, INT4_GROUP)


def install_int4(
    model: nn.Module, tensors: dict[str, torch.Tensor], scope: str, dtype: torch.dtype, device: str, source: str
) -> list[str]:
    """Swap each nn.Linear under model.<scope> for int4_linear of its tensor, taken out of `tensors` one at a time
    (on the CPU, so the model is never whole in 16 bits on device); returns the swapped names."""
    swapped = []
    for full, layer, weight in _stored_linears(model, tensors, scope, source):
        _check_shape(source, full, weight, layer)
        bias = tensors.pop(f"{full}.bias", None)
        plain = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, device="meta")
        plain.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            plain.bias = nn.Parameter(bias, requires_grad=False)
        model.set_submodule(full, int4_linear(plain, dtype, device))
        swapped.append(full)
    return swapped


def quantize_linears(
    model: nn.Module, scope: str, kind: str, compute_dtype: torch.dtype, device: str | torch.device = "cpu"
) -> None:
    """Swap each nn.Linear under model.<scope> (weights on the CPU) for its quantized_linear, one at a time (each
    replaced layer's weights are freed at once). Move the model to its device afterwards."""
    check_quantize(kind, DRAFTER_QUANT_TYPES)
    names = [name for name, layer in model.get_submodule(scope).named_modules() if isinstance(layer, nn.Linear)]
    for name in names:
        full = f"{scope}.{name}"
        model.set_submodule(full, quantized_linear(model.get_submodule(full), kind, compute_dtype, device))


def quantized_linear(layer: nn.Linear, kind: str, compute_dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """An int8, NF4 or fp16 copy of a linear whose weights are on the CPU, for `device`: int8 runs fbgemm on the CPU
    and bitsandbytes on CUDA, NF4 bitsandbytes (which carries its statistics along when moved); fp16 (the CPU's fp32
    drafter) packs 16-bit stored weights that fp16 holds, and leaves any other linear a plain one in compute_dtype."""
    if kind == "int8":
        return Int8Linear(layer) if torch.device(device).type == "cpu" else linear_int8(layer)
    if kind == "fp16":
        return Fp16Linear(layer) if fp16_holds(layer.weight.data) else layer.to(compute_dtype)
    bias = None if layer.bias is None else layer.bias.data
    return linear_4bit(layer, layer.weight.data, bias, {}, compute_dtype, "cpu")
