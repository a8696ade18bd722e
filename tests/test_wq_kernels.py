"""The weight-only int4/int8 Triton matmul (run by the Triton interpreter) equals its torch reference, and the
quantized linear built on it does what the format says.

Tolerance: fp32 activations (interpreter dots in full fp32), 2e-6 of the output's largest magnitude (the sums run
in another order); bf16 activations (the interpreter's dots cast to fp32), one bf16 rounding of the output.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from dflash_local.kernels.wq_matmul import dequantize, wq_matmul_reference
from dflash_local.kernels.wq_matmul_triton import wq_matmul_triton
from torch import nn

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.quant import GroupQuantEmbedding, GroupQuantLinear, quantize_int4
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

BUNDLED = Path(__file__).parent.parent / "models" / "tiny"


def random_weight(bits: int, group: int, has_min: bool, out: int, width: int, seed: int):
    """Random codes, positive scales and (optionally) mins of the format."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 256, (out, width // 2), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (out, width), generator=gen, dtype=torch.int8)
    scales = torch.rand(out, width // group, generator=gen) * 0.01 + 1e-4
    mins = torch.randn(out, width // group, generator=gen) * 0.01 if has_min else None
    return codes, scales, mins


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= rtol * scale


@pytest.mark.parametrize("has_min", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_equals_reference(bits: int, group: int, has_min: bool) -> None:
    """1 to 32 rows, one and two programs per output tile (split-K), a width that is not a whole number of tiles."""
    codes, scales, mins = random_weight(bits, group, has_min, 80, 384, bits * 1000 + group + has_min)
    gen = torch.Generator().manual_seed(group)
    for rows in (1, 2, 7, 16, 32):
        x = torch.randn(rows, 384, generator=gen)
        want = wq_matmul_reference(x, codes, scales, mins, bits, group)
        for split in (1, 2):
            close(wq_matmul_triton(x, codes, scales, mins, bits, group, split_k=split), want, 2e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_bf16_activations_and_fp16_scales(bits: int) -> None:
    """bf16 activations and fp16 scales (the CUDA layout): the reference's rounding of the weight to bf16 is the
    kernel's too, so they differ by the output's own bf16 rounding; group 16 (Q6_K's) also works."""
    codes, scales, mins = random_weight(bits, 16, True, 64, 256, bits)
    scales, mins = scales.half(), mins.half()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = wq_matmul_reference(x, codes, scales, mins, bits, 16)
    close(wq_matmul_triton(x, codes, scales, mins, bits, 16, split_k=3), want, 2**-7)


def test_reference_is_the_format() -> None:
    """Nibbles: even column low, odd column high; without a min they are offset by 8; int8 codes are signed."""
    codes = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8).repeat(1, 8)  # values 1, 2, 0, 15, ...
    scales = torch.tensor([[0.5]])
    assert dequantize(codes, scales, None, 4, 32)[0, :4].tolist() == [-3.5, -3.0, -4.0, 3.5]
    assert dequantize(codes, scales, torch.tensor([[1.0]]), 4, 32)[0, :4].tolist() == [1.5, 2.0, 1.0, 8.5]
    signed = torch.tensor([[-128, 127] + [0] * 30], dtype=torch.int8)
    assert dequantize(signed, scales, None, 8, 32)[0, :2].tolist() == [-64.0, 63.5]


def test_quantized_linear_and_embedding() -> None:
    """int4 min-max quantization is within half a step of the weight; the linear and embedding read that weight."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    codes, scales, mins = quantize_int4(weight, 128, torch.float32)
    restored = dequantize(codes, scales, mins, 4, 128)
    assert ((restored - weight).abs().view(48, 2, 128) <= scales[..., None] / 2 + 1e-7).all()
    linear = GroupQuantLinear(codes, scales, mins, 4, 128)
    x = torch.randn(2, 3, 256)
    torch.testing.assert_close(linear(x), nn.functional.linear(x, restored), rtol=1e-5, atol=1e-6)
    ids = torch.tensor([[0, 47], [5, 5]])
    torch.testing.assert_close(GroupQuantEmbedding(linear, torch.float32)(ids), restored[ids])
    with pytest.raises(ValueError):
        GroupQuantLinear(codes, scales[:, :1], mins, 4, 128)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """The bundled target as a Q4_K_M GGUF (Q4_K and Q6_K tensors)."""
    pytest.importorskip("llama_cpp")
    from dflash_local.gguf.convert import convert

    return convert(BUNDLED / "target", tmp_path_factory.mktemp("wq") / "tiny-q4_k_m.gguf", "q4_k_m", threads=1)


@pytest.mark.parametrize("source", ["q4_k_m", "int4"])
def test_quantized_target_through_the_kernel(source, q4_k_m) -> None:
    """A Q4_K_M GGUF and the bundled target quantized to int4 give the same logits through the Triton kernel as
    through the reference; DFlash on the int4 target equals its plain greedy output."""
    path, quantize = (q4_k_m, None) if source == "q4_k_m" else (BUNDLED / "target", "int4")
    target, triton = (
        TorchLlamaTarget.load(path, LoadSpec(RuntimeConfig(kernels=mode), max_context=64, quantize=quantize))
        for mode in ("torch", "triton")
    )
    assert sum(isinstance(m, GroupQuantLinear) for m in target.model.modules()) >= 56
    ids = torch.tensor([7, 300, 41, 12, 9, 77, 1000, 8, 5])
    close(triton.forward(ids).logits, target.forward(ids).logits, 1e-5)
    if source == "int4":
        prompt = ids.tolist()
        expected, _ = run(target, None, prompt, Settings(max_new_tokens=24, draft=False))
        drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=64))
        assert run(target, drafter, prompt, Settings(max_new_tokens=24, block_size=16))[0] == expected


def test_many_rows_take_dense_parts(monkeypatch) -> None:
    """A prefill's rows (over TRITON_MAX_ROWS) multiply the weight dequantized part by part: the reference's result."""
    wq = importlib.import_module("dflash_local.kernels.wq_matmul")  # the package's wq_matmul is the function
    codes, scales, mins = random_weight(4, 32, True, 80, 256, 5)
    x = torch.randn(wq.TRITON_MAX_ROWS + 6, 256, generator=torch.Generator().manual_seed(2))
    want = wq_matmul_reference(x, codes, scales, mins, 4, 32)
    monkeypatch.setattr(wq, "DEQUANT_ROWS", 32)
    close(wq.wq_matmul(x, codes, scales, mins, 4, 32, kernels="triton"), want, 2e-6)
