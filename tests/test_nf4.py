"""NF4 targets through bitsandbytes on CPU: quantize on load, pre-quantized bnb-4bit checkpoints, lossless decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import save_file

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.quant import Int8Linear
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget

BUNDLED = Path(__file__).parent.parent / "models" / "tiny"
PROMPTS = [[10, 57, 300, 41, 12, 9, 77, 8], [5, 6, 7]]


def save_prequantized(target: TorchLlamaTarget, source: Path, folder: Path) -> Path:
    """Write a 4-bit target as a Hugging Face bnb-4bit checkpoint: packed weights + quant state, quantization_config."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    tensors = {name: tensor.contiguous() for name, tensor in target.model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "float32",
        "bnb_4bit_quant_storage": "uint8",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _linears(target: TorchLlamaTarget) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in target.model.model.layers.named_modules() if name.endswith("_proj")}


@pytest.fixture(scope="module")
def bundled_nf4() -> TorchLlamaTarget:
    return TorchLlamaTarget.load(BUNDLED / "target", LoadSpec(max_context=256, quantize="nf4"))


@pytest.mark.parametrize("source", ["fp32", "bf16"])
def test_quantize_on_load(source: str, llama_target: Path) -> None:
    folder = llama_target if source == "fp32" else BUNDLED / "target"
    plain, nf4 = TorchLlamaTarget.load(folder, LoadSpec()), TorchLlamaTarget.load(folder, LoadSpec(quantize="nf4"))
    plain_linears = _linears(plain)
    for name, layer in _linears(nf4).items():
        assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.quant_state.quant_type == "nf4"
        original = plain_linears[name].weight
        restored = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        # NF4 levels lie at most ~0.28 * absmax apart: rounding moves a weight by at most half of that
        assert (restored - original).abs().max() <= 0.15 * original.abs().max()
    assert not isinstance(nf4.model.lm_head, bnb.nn.Linear4bit)  # head and embeddings stay in the model dtype
    assert torch.equal(nf4.model.lm_head.weight, plain.model.lm_head.weight)


def test_prequantized_round_trip(tmp_path: Path, llama_target: Path) -> None:
    nf4 = TorchLlamaTarget.load(llama_target, LoadSpec(quantize="nf4"))
    loaded = TorchLlamaTarget.load(save_prequantized(nf4, llama_target, tmp_path / "bnb4"), LoadSpec())
    assert all(isinstance(layer, bnb.nn.Linear4bit) for layer in _linears(loaded).values())
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    assert torch.equal(loaded.forward(ids).logits, nf4.forward(ids).logits)


def test_nf4_dflash_is_lossless(bundled_nf4: TorchLlamaTarget) -> None:
    drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=256))
    lengths = []
    for prompt in PROMPTS:
        autoregressive, _ = run(bundled_nf4, None, prompt, Settings(max_new_tokens=40, draft=False))
        drafted, stats = run(bundled_nf4, drafter, prompt, Settings(max_new_tokens=40))
        assert drafted == autoregressive
        lengths += stats.acceptance_lengths
    assert max(lengths) > 1  # drafts were accepted, so rollback and multi-token verify ran on the 4-bit target
    assert sum(lengths) / len(lengths) > 2.5, lengths  # measured: tau 3.9 and 7.8


def test_prequantized_dflash_is_lossless(tmp_path: Path, bundled_nf4: TorchLlamaTarget) -> None:
    target = TorchLlamaTarget.load(
        save_prequantized(bundled_nf4, BUNDLED / "target", tmp_path / "bnb4"), LoadSpec(max_context=256)
    )
    drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=256))
    autoregressive, _ = run(bundled_nf4, None, PROMPTS[0], Settings(max_new_tokens=40, draft=False))
    drafted, stats = run(target, drafter, PROMPTS[0], Settings(max_new_tokens=40))
    assert drafted == autoregressive
    assert stats.tau > 2.5, stats.acceptance_lengths  # drafts accepted on the pre-quantized target (measured 3.9)


def test_unknown_quantization_is_refused(llama_target: Path) -> None:
    with pytest.raises(DFlashError, match="Unknown quantization 'int3'"):
        TorchLlamaTarget.load(llama_target, LoadSpec(quantize="int3"))


def test_other_quantized_checkpoints_are_refused(tmp_path: Path, llama_target: Path) -> None:
    folder = tmp_path / "gptq"
    shutil.copytree(llama_target, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="'gptq' are not supported"):
        TorchLlamaTarget.load(folder, LoadSpec())


def test_malformed_quant_state_is_one_clear_error(tmp_path: Path, llama_target: Path) -> None:
    folder = save_prequantized(
        TorchLlamaTarget.load(llama_target, LoadSpec(quantize="nf4")), llama_target, tmp_path / "bnb4"
    )
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DFlashError, match=r"model\.layers\.1\.mlp\.up_proj\.weight cannot be loaded"):
        TorchLlamaTarget.load(folder, LoadSpec())


@pytest.mark.parametrize("kind,layer_type", [("int8", Int8Linear), ("nf4", bnb.nn.Linear4bit)])
def test_quantized_drafter_keeps_output_lossless(kind: str, layer_type: type) -> None:
    """On the CPU int8 is torch's weight-only kernel, NF4 bitsandbytes'; either way the output stays the target's."""
    target = TorchLlamaTarget.load(BUNDLED / "target", LoadSpec(max_context=256))
    drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=256, drafter_quantize=kind))
    linears = [m for name, m in drafter.model.layers.named_modules() if name.endswith("_proj")]
    assert len(linears) == 7 * drafter.cfg.dims.layers and all(isinstance(m, layer_type) for m in linears)
    lengths = []
    for prompt in PROMPTS:
        autoregressive, _ = run(target, None, prompt, Settings(max_new_tokens=40, draft=False))
        drafted, stats = run(target, drafter, prompt, Settings(max_new_tokens=40))
        assert drafted == autoregressive
        lengths += stats.acceptance_lengths
    assert max(lengths) > 1  # the quantized drafter still gets drafts accepted
    assert sum(lengths) / len(lengths) > 1.8, lengths  # measured: 2.3 for both kinds (tau 1.34 and 7.8)


def test_unknown_drafter_quantization_is_refused() -> None:
    with pytest.raises(DFlashError, match="Unknown quantization 'fp8' \\(supported: int8, nf4\\)"):
        DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(drafter_quantize="fp8"))


def unpacked(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 rows and fp32 row scales inside an fbgemm-packed weight."""
    rows = torch.ops.quantized.linear_unpack(packed)[0]
    return rows.int_repr(), rows.q_per_channel_scales().float()


def test_int8_linear_matches_its_dequantized_weights() -> None:
    """The CPU int8 linear computes x @ (int8 weight x row scale).T (+ bias) up to the rounding of x to 7 bits, in
    the input's dtype and shape; the weight is only rounded, per row."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    quantized = Int8Linear(layer)
    weight, scales = unpacked(quantized.packed)
    x = torch.randn(2, 5, 64)
    dequantized = weight.float() * scales[:, None]
    expected = x @ dequantized.T + layer.bias
    out = quantized(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 48)
    assert Int8Linear(torch.nn.Linear(64, 48, bias=False))(x.bfloat16()).dtype == torch.bfloat16
    assert (out - expected).norm() / expected.norm() < 0.02
    assert ((dequantized - layer.weight).abs() <= scales[:, None] * 0.51).all()  # rounding only


def test_int8_matrix_packs_chunks_in_parts_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row chunks of any size become packed parts of INT8_PART_ROWS rows (the last one shorter), in order."""
    from dflash_local import quant

    monkeypatch.setattr(quant, "INT8_PART_ROWS", 40)
    torch.manual_seed(0)
    weight = torch.randn(100, 32)
    matrix = quant.Int8Matrix(weight.split([30, 25, 35, 10]))
    assert [len(unpacked(part)[0]) for part in matrix.parts] == [40, 40, 20]
    x = torch.randn(3, 32)
    expected = x @ weight.T
    assert (matrix.linear(x) - expected).norm() / expected.norm() < 0.02


def test_int8_drafter_quantizes_each_linear_from_its_stored_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linears are read as stored (bf16) and quantized one by one, never all held in fp32; the rest is fp32."""
    from safetensors.torch import load_file

    from dflash_local import quant

    seen: list[torch.dtype] = []

    class Recording(quant.Int8Linear):
        def __init__(self, layer: torch.nn.Linear) -> None:
            seen.append(layer.weight.dtype)
            super().__init__(layer)

    monkeypatch.setattr(quant, "Int8Linear", Recording)
    drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=256, drafter_quantize="int8"))
    stored = load_file(BUNDLED / "drafter" / "model.safetensors")
    assert seen == [torch.bfloat16] * 7 * drafter.cfg.dims.layers
    down = drafter.model.layers[0].mlp.down_proj
    weight = stored["layers.0.mlp.down_proj.weight"].float()
    scales = weight.abs().amax(dim=1) / 127
    packed_weight, packed_scales = unpacked(down.packed)
    torch.testing.assert_close(packed_scales, scales)
    differs = packed_weight.int() - (weight / scales[:, None]).round().int()  # ties may round either way
    assert differs.abs().max() <= 1 and (differs != 0).float().mean() < 1e-3
    others = [p for name, p in drafter.model.named_parameters() if "_proj" not in name]
    assert others and all(p.dtype == torch.float32 for p in others)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_missing_or_misshapen_drafter_tensor_is_one_clear_error(tmp_path: Path, quantize: str | None) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "drafter"
    shutil.copytree(BUNDLED / "drafter", folder)
    tensors = load_file(folder / "model.safetensors")
    name = "layers.1.mlp.up_proj.weight"
    shape = tuple(tensors.pop(name).shape)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(DFlashError, match=rf"^{folder} lacks the drafter tensor {name}\.$"):
        DFlashDrafter.load(folder, LoadSpec(drafter_quantize=quantize))
    save_file(tensors | {name: torch.zeros(3, 4, dtype=torch.bfloat16)}, folder / "model.safetensors")
    message = rf"^{folder}: drafter tensor {name} has shape \(3, 4\), the config implies \({shape[0]}, {shape[1]}\)\.$"
    with pytest.raises(DFlashError, match=message):
        DFlashDrafter.load(folder, LoadSpec(drafter_quantize=quantize))


def test_cpu_fp32_drafter_runs_its_16bit_linears_through_fp16_gemm(tmp_path: Path) -> None:
    """Unquantized on the CPU in fp32, bf16-stored linears become Fp16Linear computing with the same weights (fp32
    sums); fp32-stored ones, or any fp16 cannot hold, stay plain fp32 linears."""
    from safetensors.torch import load_file

    from dflash_local.quant import Fp16Linear

    drafter = DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(max_context=256))
    linears = [m for name, m in drafter.model.layers.named_modules() if name.endswith("_proj")]
    assert len(linears) == 7 * drafter.cfg.dims.layers and all(isinstance(m, Fp16Linear) for m in linears)
    stored = load_file(BUNDLED / "drafter" / "model.safetensors")
    x = torch.randn(2, 5, drafter.cfg.dims.hidden, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.linear(x.double(), stored["layers.0.mlp.up_proj.weight"].double())
    torch.testing.assert_close(drafter.model.layers[0].mlp.up_proj(x).double(), expected, atol=1e-5, rtol=1e-5)

    folder = tmp_path / "drafter"
    shutil.copytree(BUNDLED / "drafter", folder)
    wide = {name: tensor.float() for name, tensor in stored.items()}
    wide["layers.0.mlp.up_proj.weight"] = stored["layers.0.mlp.up_proj.weight"]
    wide["layers.0.mlp.up_proj.weight"][0, 0] = 1e5  # bf16 holds it, fp16 does not
    save_file(wide, folder / "model.safetensors")
    plain = DFlashDrafter.load(folder, LoadSpec(max_context=256))
    assert not any(isinstance(m, Fp16Linear) for m in plain.model.layers.modules())
    assert plain.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
