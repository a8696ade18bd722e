"""GGUF files in the torch target: quantized blocks decoded exactly into int4/int8 groups, tiny Q4_K_M, Q5_K_M, Q6_K,
Q8_0 (and Q4_0) models with the logits and greedy ids of their dequantized fp32 weights, DFlash on them lossless."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from dflash_local.kernels import dequantize  # noqa: E402

from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable  # noqa: E402
from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.gguf.file import read_gguf, read_header  # noqa: E402
from dflash_local.gguf.tensors import HF_NAMES, QUANT_TYPES, decode_blocks, rope_rows  # noqa: E402
from dflash_local.quant import GroupQuantEmbedding, GroupQuantLinear  # noqa: E402
from dflash_local.runtime import LoadSpec, RuntimeConfig  # noqa: E402
from dflash_local.targets.torch_llama import TorchLlamaTarget  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_types(tiny_gguf, tmp_path_factory) -> dict[str, Path]:
    """The bundled target as Q8_0 and F16 (conftest) and, converted here, Q4_K_M, Q5_K_M, Q6_K and Q4_0."""
    from dflash_local.gguf.convert import convert

    root = tmp_path_factory.mktemp("gguf-torch")
    made = {kind: convert(TINY / "target", root / f"tiny-{kind}.gguf", kind, threads=1) for kind in TYPES[:3]}
    made["q4_0"] = convert(TINY / "target", root / "tiny-q4_0.gguf", "q4_0", threads=1)
    return {**tiny_gguf, **made}


def random_blocks(kind, count: int, seed: int) -> np.ndarray:
    """Random bytes as blocks of a type, their fp16 super-scales set to sane positive values."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8)
    halves = (rng.random((count, 2)) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == Q.Q6_K:
        blocks[:, 208:210] = halves[:, :2]
    else:
        blocks[:, 0 : 4 if kind in (Q.Q4_K, Q.Q5_K) else 2] = halves[:, : 4 if kind in (Q.Q4_K, Q.Q5_K) else 2]
    return blocks


@pytest.mark.parametrize("kind", QUANT_TYPES, ids=lambda kind: kind.name)
def test_blocks_decode_exactly(kind) -> None:
    """Each type's codes, scales and mins stand for exactly the weights gguf-py dequantizes the blocks to."""
    blocks = random_blocks(kind, 24, int(kind))
    want = gguf.quants.dequantize(blocks.reshape(1, -1), kind).reshape(24, -1)
    values, scales, mins, bits, group = decode_blocks(kind, torch.from_numpy(blocks))
    if bits == 4:
        values = values[:, 0::2] | (values[:, 1::2] << 4)
    assert np.array_equal(dequantize(values.contiguous(), scales, mins, bits, group).numpy(), want)


def dequantized_reference(target: TorchLlamaTarget, path: Path) -> TorchLlamaTarget:
    """The same target with each quantized matrix replaced by an fp32 linear of gguf-py's dequantization of it."""
    tensors = read_header(path).tensors
    model, cfg = target.model, target.cfg
    gguf_names = {"model.embed_tokens.table": "token_embd.weight", "lm_head": "output.weight"}
    for index in range(cfg.dims.layers):
        for gguf_name, hf in HF_NAMES.items():
            gguf_names[f"model.layers.{index}.{hf.removesuffix('.weight')}"] = f"blk.{index}.{gguf_name}"
    heads = {"q_proj": cfg.dims.heads, "k_proj": cfg.dims.kv_heads}
    for name, module in list(model.named_modules()):
        if not isinstance(module, GroupQuantLinear) or name not in gguf_names:
            continue
        tensor = tensors[gguf_names[name]]
        weight = torch.from_numpy(gguf.quants.dequantize(tensor.read_rows(slice(None)), tensor.tensor_type).copy())
        short = name.rsplit(".", 1)[-1]
        if short in heads and cfg.model_type == "llama":
            weight = weight[rope_rows(weight.shape[0], heads[short])]
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if name == "model.embed_tokens.table":
            model.model.embed_tokens = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight)
            if cfg.dims.tied:
                model.lm_head = linear
        else:
            model.set_submodule(name, linear)
    return TorchLlamaTarget(model, target.max_context)


def test_f16_gguf_equals_the_safetensors_target(tiny_types) -> None:
    """Names, the llama q/k row order, RoPE and the tied head: an F16 GGUF of the bf16 checkpoint has its logits."""
    ids = torch.tensor([7, 300, 41, 12, 9, 77, 1000, 8, 5])
    from_gguf = TorchLlamaTarget.load(tiny_types["f16"], LoadSpec(max_context=64)).forward(ids).logits
    from_folder = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=64)).forward(ids).logits
    torch.testing.assert_close(from_gguf, from_folder, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0"])
def test_quantized_gguf_has_its_dequantized_logits(kind, tiny_types, heldout) -> None:
    """Every matrix loads quantized (the embedding and head too); logits within 1e-3 of the dequantized fp32 model's
    (relative to their largest magnitude) on 10 held-out prompts, and the same 16 greedy ids after the first 5."""
    target = TorchLlamaTarget.load(tiny_types[kind], LoadSpec(max_context=256))
    model = target.model
    assert isinstance(model.model.embed_tokens, GroupQuantEmbedding) and isinstance(model.lm_head, GroupQuantLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    reference = dequantized_reference(
        TorchLlamaTarget.load(tiny_types[kind], LoadSpec(max_context=256)), tiny_types[kind]
    )
    for index, prompt in enumerate(heldout):
        got, want = target.forward(torch.tensor(prompt)).logits, reference.forward(torch.tensor(prompt)).logits
        target.trim(0), reference.trim(0)
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), kind
        if index < 5:
            settings = Settings(max_new_tokens=16, draft=False)
            assert run(target, None, prompt, settings)[0] == run(reference, None, prompt, settings)[0], kind


def auto_policy(block: int) -> BlockPolicy:
    """--block-size auto's policy with fixed scripted costs: plain, short and full blocks all worth choosing."""
    costs = CostTable({k: 1.0 + 0.3 * (k - 1) for k in range(1, block + 1)}, dict.fromkeys(range(2, block + 1), 0.2))
    costs.observe = lambda *args, **kwargs: None
    return BlockPolicy(block, costs, AcceptanceEstimate.empty(block - 1, 0.999))


@pytest.mark.parametrize("kind", ["q4_k_m", "q5_k_m", "q6_k", "q8_0"])
def test_dflash_on_a_gguf_torch_target_equals_its_greedy_output(kind, tiny_types, heldout, drafter) -> None:
    """Blocks 4, 16 and auto on 2 held-out prompts, 40 tokens: the ids of plain greedy decoding on the same target;
    the trained drafter's mean tau at block 16 is above 1.8."""
    target = TorchLlamaTarget.load(tiny_types[kind], LoadSpec(max_context=512))
    taus = []
    for prompt in heldout[:2]:
        expected, _ = run(target, None, prompt, Settings(max_new_tokens=40, draft=False))
        for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
            ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=40, block_size=block), policy)
            assert ids == expected, (kind, block)
            taus += [stats.tau] if block == 16 else []
    assert sum(taus) / len(taus) > 1.8, (kind, taus)


def test_a_gguf_file_through_load_models_on_the_torch_backend(tiny_types) -> None:
    """--backend torch on a GGUF: the torch target, the file's own vocabulary (loaded alone) and end-of-sequence ids,
    the torch drafter; DFlash text equals plain decoding's, drafts accepted (tau above 1.3). On the CPU --backend auto
    stays llama.cpp."""
    pytest.importorskip("llama_cpp")
    from dataclasses import replace

    from dflash_local.generation import GenerationRequest, load_models, run_request
    from dflash_local.runtime import LoadSpec, plan_load
    from dflash_local.targets import load_target

    path = tiny_types["q8_0"]
    spec = LoadSpec(RuntimeConfig(device="cpu"), 256, backend="torch")
    models = load_models(path, TINY / "drafter", spec, auto_block=False)
    assert isinstance(models.target, TorchLlamaTarget) and models.stop_ids == read_gguf(path).eos_ids
    settings = Settings(max_new_tokens=16, block_size=16, stop_ids=models.stop_ids)
    drafted = run_request(models, GenerationRequest("def main():", settings))
    plain = run_request(models, GenerationRequest("def main():", replace(settings, draft=False)))
    assert drafted["text"] == plain["text"] and drafted["output_ids"] == plain["output_ids"]
    assert drafted["tau"] > 1.3, drafted["acceptance_lengths"]  # drafts were accepted
    auto = plan_load(path, LoadSpec(RuntimeConfig(device="cpu"), 64))
    assert type(load_target(path, auto)).__name__ == "LlamaCppTarget"


def test_quantize_int4_from_the_command_line_is_lossless() -> None:
    """`dflash generate --quantize int4` on the bundled target: DFlash ids equal --no-draft's, drafts accepted (tau
    above 1.3; measured 1.67)."""
    import json

    from in_process import invoke

    base = ["generate", "--target", "tiny", "--prompt", "def main():"]
    base += ["--max-new-tokens", "16", "--json", "--quantize", "int4", "--offline"]
    outputs = []
    for extra in (["--no-draft"], ["--block-size", "16"]):
        result = invoke(*base, *extra)
        assert result.exit_code == 0, result.stderr
        outputs.append(json.loads(result.stdout))
    assert outputs[0]["output_ids"] == outputs[1]["output_ids"] and len(outputs[0]["output_ids"]) == 16
    assert outputs[1]["tau"] > 1.3, outputs[1]["acceptance_lengths"]


def test_a_matrix_decodes_the_same_in_row_chunks(monkeypatch) -> None:
    """quantized_matrix decodes DECODE_ROWS rows at a time; the chunks join into the whole matrix's format."""
    import dflash_local.gguf.tensors as weights

    raw = torch.from_numpy(random_blocks(Q.Q4_K, 12 * 2, 7)).view(12, -1)
    whole = weights.quantized_matrix(raw, Q.Q4_K, torch.float32)
    monkeypatch.setattr(weights, "DECODE_ROWS", 5)
    chunked = weights.quantized_matrix(raw, Q.Q4_K, torch.float32)
    for name in ("codes", "scales", "mins"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name))
    assert whole.in_features == 512 and whole.out_features == 12
