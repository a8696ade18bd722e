"""At T > 0, DFlash's continuations follow the target's distribution on every target kind: torch safetensors, int4, NF4,
a Q8_0 GGUF through the torch target and through llama.cpp, there also verified as on a GPU backend (8-row forwards,
each block in pieces, here of one row, the next only while every draft stands). The expected distribution is exact,
enumerated over a 5-token vocabulary from logits dflash did not compute (the reference implementation's on the
original weights, on the int4 codes dequantized here, the NF4 weights as bitsandbytes dequantizes them, the GGUF
blocks as gguf-py dequantizes them; llama.cpp's own), truncated by tests/sampled_reference.py's own temperature /
top-k / top-p.

Four new tokens, half the samples at a fixed block of 2 (a step that accepts its draft keeps its bonus: the 3rd
token), half under --block-size auto's policy (the drafter drafts its trained 16, the policy verifies short blocks):
both halves end steps in a bonus drawn after a fully accepted block, and the tests assert that they did.

The power calculation: a wrong sampler moves the continuations' distribution from p to q; the chi-square test over
the cells of p (sampled_reference.cells) then follows a noncentral chi-square with df = cells - 1 and noncentrality
N * w^2, w^2 = sum (q - p)^2 / p (Cohen's effect size). The three wrong samplers of tests/wrong_samplers.py (a residual
drawn from the target's row, acceptance with probability p instead of min(1, p/q), the bonus drawn from the row
before the last) moved the continuations by w^2 of 0.081-0.225, 0.148-0.599 and 0.40-1.04 over the five kinds (NF4:
0.225, 0.222, 0.94) (MEASURED_EFFECTS: the smallest; bias-corrected estimates, sampled_reference.effect_size, over
each test's own samples: `python tests/wrong_samplers.py NAME tests/test_sampled_lossless.py` prints them in the
failures). Each test draws the fewest samples at which an effect of 0.75 times the smallest (EFFECT_FLOOR) is found
with 99% power at alpha = 1e-3 (sampled_reference.samples_for_power): 1100-1300 samples.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference import reference_next_logits
from safetensors.torch import load_file, save_file
from sampled_reference import continuations, effect_size, p_value, samples_for_power
from test_gguf import _add_byte_bpe_tokenizer
from tiny_models import make_drafter, make_target

from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable
from dflash_local.decode import Settings, generate, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams
from dflash_local.targets.llamacpp import FIXED_ROWS, LlamaCppTarget, model_params
from dflash_local.targets.torch_llama import TorchLlamaTarget

PROMPT, NEW_TOKENS, FIXED_BLOCK = [1, 3, 0, 2], 4, 2
MEASURED_EFFECTS = {"residual": 0.081, "accept-p": 0.148, "bonus-row": 0.40}  # w^2 per wrong sampler, weakest kind
EFFECT_FLOOR = 0.75 * min(MEASURED_EFFECTS.values())


@dataclass
class Kind:
    """One target kind: the target dflash samples from, and the independent logits of the token after each prefix."""

    target: object
    next_logits: Callable[[list[list[int]]], Sequence[Sequence[float]]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A 5-token-vocabulary Llama (128 wide, so int4 groups of 128 apply), its drafter, and its Q8_0 GGUF."""
    from dflash_local.gguf.convert import convert

    root = tmp_path_factory.mktemp("sampled")
    target = make_target(root / "target", vocab_size=5, hidden_size=128, num_layers=2, seed=5, std=0.3)
    drafter = make_drafter(root / "drafter", target, num_layers=1, target_layer_ids=[1], seed=6, std=0.3)
    _add_byte_bpe_tokenizer(target, 5)
    return {"target": target, "drafter": drafter, "gguf": convert(target, root / "target-q8_0.gguf", "q8_0", threads=1)}


def dequantized_folder(target: TorchLlamaTarget, source: Path, folder: Path) -> Path:
    """A copy of source whose int4 matrices hold their dequantized weights, decoded here from the codes (low nibble
    first, each group of 128 columns: min + code * scale), for the reference implementation to run."""
    shutil.copytree(source, folder)
    tensors = load_file(source / "model.safetensors")
    for name, module in target.model.named_modules():
        if type(module).__name__ != "GroupQuantLinear":
            continue
        codes = module.codes.to(torch.int64)
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).double()
        groups = nibbles.view(codes.shape[0], -1, module.group)
        weight = module.mins.double()[..., None] + groups * module.scales.double()[..., None]
        tensors[f"{name}.weight"] = weight.reshape(codes.shape[0], -1).float().contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def nf4_dequantized_folder(target: TorchLlamaTarget, source: Path, folder: Path) -> Path:
    """A copy of source whose NF4 matrices hold bitsandbytes' dequantization of the target's 4-bit weights, for the
    reference implementation to run."""
    import bitsandbytes as bnb

    shutil.copytree(source, folder)
    tensors = load_file(source / "model.safetensors")
    for name, module in target.model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            tensors[f"{name}.weight"] = weight.float().contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def gguf_dequantized_folder(path: Path, source: Path, folder: Path) -> Path:
    """A copy of source holding the GGUF's weights as gguf-py dequantizes them (q and k rows put back from
    llama.cpp's interleaved RoPE order into HF's halves), for the reference implementation to run."""
    import gguf

    config = json.loads((source / "config.json").read_text())
    shutil.copytree(source, folder)
    tensors = load_file(source / "model.safetensors")
    for tensor in gguf.GGUFReader(str(path)).tensors:
        parts = tensor.name.removesuffix(".weight").split(".")
        if parts[0] == "rope_freqs":
            continue
        name = GGUF_NAMES[parts[0]] if parts[0] != "blk" else f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}"
        weight = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()
        weight = weight.reshape(tensors[f"{name}.weight"].shape)
        if parts[-1] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if parts[-1] == "attn_q" else "num_key_value_heads"]
            weight = weight.view(heads, -1, 2, weight.shape[1]).transpose(1, 2).reshape(weight.shape)
        assert (weight - tensors[f"{name}.weight"]).abs().max() < 0.02 * tensors[f"{name}.weight"].abs().max(), name
        tensors[f"{name}.weight"] = weight.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def llamacpp_model(path: Path):
    """llama-cpp-python's own Llama on path (logits_all), under the target's model options (no AMX repacking)."""
    from llama_cpp import Llama, llama_cpp

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp, "llama_model_default_params", lambda: model_params().params)
        return Llama(
            str(path), n_ctx=64, n_threads=1, n_threads_batch=1, flash_attn=True, logits_all=True, verbose=False
        )


def llamacpp_next_logits(path: Path) -> Callable[[list[list[int]]], list[Sequence[float]]]:
    """llama.cpp's own logits (llamacpp_model) of the token after each prefix, each row a float32 array."""
    own = llamacpp_model(path)

    def next_logits(prefixes: list[list[int]]) -> list[Sequence[float]]:
        rows = []
        for ids in prefixes:
            own.reset()
            own.eval(ids)
            rows.append(own.scores[own.n_tokens - 1].copy())
        return rows

    return next_logits


@pytest.fixture(scope="module")
def kinds(folders, tmp_path_factory) -> Callable[[str], Kind]:
    """Each kind built on first use."""

    @functools.cache
    def build(name: str) -> Kind:
        reference = functools.partial(reference_next_logits, folders["target"])
        if name == "torch":
            return Kind(TorchLlamaTarget.load(folders["target"], LoadSpec(max_context=64)), reference)
        if name == "int4":
            target = TorchLlamaTarget.load(folders["target"], LoadSpec(max_context=64, quantize="int4"))
            plain = dequantized_folder(target, folders["target"], tmp_path_factory.mktemp("int4") / "dequantized")
            return Kind(target, functools.partial(reference_next_logits, plain))
        if name == "nf4":
            target = TorchLlamaTarget.load(folders["target"], LoadSpec(max_context=64, quantize="nf4"))
            plain = nf4_dequantized_folder(target, folders["target"], tmp_path_factory.mktemp("nf4") / "dequantized")
            return Kind(target, functools.partial(reference_next_logits, plain))
        if name == "gguf-torch":
            plain = gguf_dequantized_folder(
                folders["gguf"], folders["target"], tmp_path_factory.mktemp("gguf") / "plain"
            )
            return Kind(
                TorchLlamaTarget.load(folders["gguf"], LoadSpec(max_context=64)),
                functools.partial(reference_next_logits, plain),
            )
        own = llamacpp_next_logits(folders["gguf"])
        target = LlamaCppTarget.load(folders["gguf"], LoadSpec(RuntimeConfig(threads=1), max_context=64))
        if name == "llamacpp-pieces":  # as on a GPU backend: 8-row forwards, a block verified one row at a time
            target.fixed_rows, target.verify_rows = FIXED_ROWS, 1
        return Kind(target, own)

    return build


def short_block_policy(block: int) -> BlockPolicy:
    """--block-size auto's policy with scripted costs that stay: a plain step costs 1, a verify of 2 costs 1.1 and
    each further row 1 more, a draft 0.1, so it drafts one token (k = 2) while acceptance beats 20% and probes plain
    steps and other sizes as it goes."""
    steps = {k: 1.0 if k == 1 else 1.1 + (k - 2) for k in range(1, block + 1)}
    costs = CostTable(steps, dict.fromkeys(range(2, block + 1), 0.1))
    costs.observe = lambda *args, **kwargs: None
    return BlockPolicy(block, costs, AcceptanceEstimate.empty(block - 1, 0.999))


@pytest.mark.parametrize(
    "name, params",
    [
        ("torch", SamplingParams(temperature=2.0, top_k=3)),
        ("int4", SamplingParams(temperature=2.0, top_k=4, top_p=0.95)),
        ("nf4", SamplingParams(temperature=2.5, top_k=3)),
        ("gguf-torch", SamplingParams(temperature=2.5, top_k=3)),
        ("llamacpp", SamplingParams(temperature=2.0, top_k=4, top_p=0.9)),
        ("llamacpp-pieces", SamplingParams(temperature=2.0, top_k=4, top_p=0.9)),
    ],
)
def test_sampled_continuations_follow_the_independent_distribution(name, params, kinds, folders):
    """Four tokens, half at block 2 and half under auto: the chi-square against the enumerated distribution passes;
    both halves accept the drafter's drafts (tau > 1.3) and keep bonus tokens drawn after fully accepted blocks, and
    auto keeps lookup's drafts too."""
    kind = kinds(name)
    exact = continuations(kind.next_logits, PROMPT, NEW_TOKENS, params.temperature, params.top_k, params.top_p)
    samples = samples_for_power(EFFECT_FLOOR, exact)
    drafter = DFlashDrafter.load(folders["drafter"], LoadSpec(max_context=64))
    policy, used = short_block_policy(drafter.block_size), []
    choose = policy.choose
    policy.choose = lambda limit: used.append(choose(limit)) or used[-1]
    counts: dict[tuple[int, ...], int] = {}
    lengths: dict[str, list[int]] = {"fixed": [], "auto": []}
    full: dict[str, int] = {"fixed": 0, "auto": 0}
    lookup_kept = 0  # auto's tokens that were lookup's drafts
    for seed in range(samples):
        mode = "auto" if seed % 2 else "fixed"
        settings = Settings(NEW_TOKENS, params, None if mode == "auto" else FIXED_BLOCK, seed=seed)
        steps = list(generate(kind.target, drafter, PROMPT, settings, policy if mode == "auto" else None))
        ids = tuple(token for step in steps for token in step.token_ids)
        counts[ids] = counts.get(ids, 0) + 1
        lookup_kept += sum(step.drafted for step in steps if step.source == "lookup")
        drafted = [(step.acceptance_length, step.block_size) for step in steps if step.source == "dflash"]
        lengths[mode] += [n for n, _ in drafted]
        full[mode] += sum(n == k for n, k in drafted)  # all drafts accepted and the bonus kept
    found = p_value(exact, counts)
    effect = effect_size(exact, counts)
    assert found > 1e-3, f"{name}: p = {found:.3g}, effect size w^2 = {effect:.4f} over {samples} samples"
    for mode in ("fixed", "auto"):
        assert sum(lengths[mode]) / len(lengths[mode]) > 1.3, (mode, lengths[mode])
        assert full[mode] > samples / 20, (mode, full[mode])
    assert 2 in used, set(used)  # auto verified short blocks of its trained block's drafts
    assert lookup_kept > samples / 20, lookup_kept  # and lookup's drafts (point masses) were kept among them


@pytest.mark.parametrize("name", ["int4", "gguf-torch"])
def test_quantized_torch_targets_have_their_dequantized_weights_logits(name, kinds):
    """The int4 and GGUF paths of the torch target against the reference implementation on their weights dequantized
    apart from dflash (above): logits within 1e-4 of the logit range on 31 prefixes, the same 12 greedy ids."""
    kind = kinds(name)
    prefixes = [PROMPT + [a, b][:length] for a in range(5) for b in range(5) for length in (0, 1, 2)]
    prefixes = [list(p) for p in dict.fromkeys(map(tuple, prefixes))]
    want = torch.stack([torch.as_tensor(row) for row in kind.next_logits(prefixes)])
    got = []
    for ids in prefixes:
        kind.target.trim(0)
        got.append(kind.target.forward(torch.tensor(ids), features=False).logits[-1])
    got = torch.stack(got)
    assert (got - want).abs().max() < 1e-4 * (want.max() - want.min()), (got - want).abs().max()
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(torch.as_tensor(kind.next_logits([ids])[0]).argmax()))
    greedy, _ = run(kind.target, None, PROMPT, Settings(12, draft=False))
    assert greedy == ids[len(PROMPT) :]
