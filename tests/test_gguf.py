"""GGUF targets through llama.cpp: conversion, lossless DFlash, tapped features, exact rollback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.drafters import load_drafter  # noqa: E402
from dflash_local.drafters.native import NativeDrafter  # noqa: E402
from dflash_local.drafters.torch_drafter import DFlashDrafter  # noqa: E402
from dflash_local.errors import DFlashError  # noqa: E402
from dflash_local.gguf.convert import convert  # noqa: E402
from dflash_local.quant import Int8Matrix  # noqa: E402
from dflash_local.runtime import LoadSpec, RuntimeConfig, plan_load
from dflash_local.targets.llamacpp import LlamaCppTarget  # noqa: E402
from dflash_local.targets.torch_llama import TorchLlamaTarget  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
NEW_TOKENS = 40


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_both_drafters_accept_alike_and_propose_the_same_drafts(kind, tiny_gguf, heldout, drafter):
    """At block 16 on 10 held-out prompts the torch and llama.cpp-native drafters give the same ids, the trained pair
    accepts (mean tau > 2.0) and their taus agree within 5%; they propose the same drafts (99%) step by step.
    (Their ids against llama.cpp's own greedy run, at blocks 4, 16 and auto: test_gguf_lossless.)"""
    target = LlamaCppTarget.load(tiny_gguf[kind], LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    native = NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))
    taus, native_taus = [], []
    for index, prompt in enumerate(heldout):
        settings = Settings(max_new_tokens=NEW_TOKENS, block_size=16)
        ids, stats = run(target, drafter, prompt, settings)
        native_ids, native_stats = run(target, native, prompt, settings)
        assert ids == native_ids, (kind, index)
        taus.append(stats.tau)
        native_taus.append(native_stats.tau)
    assert sum(taus) / len(taus) > 2.0, taus
    assert abs(sum(native_taus) - sum(taus)) / sum(taus) < 0.05, (native_taus, taus)
    torch_drafts = [d for p in heldout[:4] for d in proposals(target, drafter, p, run_ar(target, p), 16)]
    native_drafts = [d for p in heldout[:4] for d in proposals(target, native, p, run_ar(target, p), 16)]
    pairs = [(a, b) for x, y in zip(torch_drafts, native_drafts, strict=True) for a, b in zip(x, y, strict=True)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    assert agree > 0.99, agree  # the trained pair: the drafters propose the same tokens (near-ties aside)


def run_ar(target, prompt: list[int]) -> list[int]:
    return run(target, None, prompt, Settings(max_new_tokens=NEW_TOKENS, draft=False))[0]


def test_tapped_features_and_logits_match_torch(tiny_gguf, heldout):
    """F16 weights and F16 KV cache against the fp32 torch backend: features within 0.2% (relative L2 per row) for a
    prompt's forward, 0.6% where every row is an output (a verify's order, in chunks of 63 rows: ggml-cpu's one-row
    flash attention rounds Q to F16, its tiled path for 64+ query rows keeps Q in F32; 0.47% measured at 700 tokens).
    Logits within 0.2% of the largest (0.4% in a verify's order; 0.22% measured).

    Layer 7 is the last: its feature is the final-normed hidden state (llama.cpp's output embeddings)."""
    gguf_target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    torch_target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=2048))
    long_prompt = torch.randint(5, 4096, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    for layer_ids in ([1, 3, 5], [2, 7]):
        for target in (gguf_target, torch_target):
            target.set_feature_layers(layer_ids)
        for prompt in heldout[:3] + [long_prompt]:  # 700 tokens: llama.cpp decodes the prefill in 512-token chunks
            ids = torch.tensor(prompt)
            for all_logits in (True, False):
                outs = []
                for target in (gguf_target, torch_target):
                    target.trim(0)
                    outs.append(target.forward(ids, all_logits=all_logits, features=True))
                got, want = outs
                assert got.logits.shape == want.logits.shape
                assert got.features.shape == want.features.shape == (len(prompt), 256 * len(layer_ids))
                for part in range(len(layer_ids)):
                    a, b = (out.features[:, part * 256 : (part + 1) * 256] for out in (got, want))
                    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < (6e-3 if all_logits else 2e-3)
                logits_bound = 4e-3 if all_logits else 2e-3
                assert ((got.logits - want.logits).abs().max() / want.logits.abs().max()) < logits_bound


def test_rollback_leaves_the_state_of_a_fresh_run(tiny_gguf, heldout):
    target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    target.set_feature_layers([1, 3, 5])
    prompt, block, tail = torch.tensor(heldout[0]), torch.tensor(heldout[1][:16]), torch.tensor(heldout[2][:6])
    keep = len(prompt) + 5

    def continued(block_tokens: torch.Tensor):
        target.trim(0)
        target.forward(prompt)
        target.forward(block_tokens)
        target.trim(keep)
        assert target.length == keep
        return target.forward(tail)

    after_rollback = continued(block)
    other = block.clone()
    other[5:] = (other[5:] + 7) % 4096
    with_other_rejects = continued(other)
    assert torch.equal(after_rollback.logits, with_other_rejects.logits)
    assert torch.equal(after_rollback.features, with_other_rejects.features)
    target.trim(0)
    target.forward(prompt)
    target.forward(block[:5])
    fresh = target.forward(tail)
    assert torch.equal(after_rollback.logits, fresh.logits)
    assert torch.equal(after_rollback.features, fresh.features)


def _add_byte_bpe_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json: vocab_size - 1 byte symbols and one merge (enough for llama.cpp to load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: vocab_size - 1]
    vocab = {char: i for i, char in enumerate(symbols + [symbols[0] + symbols[1]])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(symbols[0], symbols[1])]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_converted_families_match_torch_and_stay_lossless(kind, request, tmp_path, drafters):
    """llama: llama3 RoPE scaling (rope_freqs), GQA, untied head, last-layer features; qwen3: q/k norms, wide heads,
    tied head."""
    import shutil

    folder = tmp_path / kind
    shutil.copytree(request.getfixturevalue(f"{kind}_target"), folder)
    torch_target = TorchLlamaTarget.load(folder, LoadSpec())
    _add_byte_bpe_tokenizer(folder, torch_target.vocab_size)
    gguf_target = LlamaCppTarget.load(
        convert(folder, tmp_path / f"{kind}.gguf", "f16", threads=1), LoadSpec(RuntimeConfig(threads=1))
    )
    drafter_folder = drafters[kind, {"llama": 3, "qwen3": 2}[kind]]  # llama's reads layers [0, 1, 3]: 3 is the last
    drafter = DFlashDrafter.load(drafter_folder, LoadSpec(max_context=gguf_target.max_context))
    prompt = torch.randint(0, torch_target.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    for target in (gguf_target, torch_target):
        target.set_feature_layers(drafter.target_layer_ids)
    got, want = gguf_target.forward(prompt), torch_target.forward(prompt)
    assert ((got.logits - want.logits).abs().max() / want.logits.abs().max()) < 5e-3
    assert ((got.features - want.features).norm(dim=-1) / want.features.norm(dim=-1)).max() < 5e-3
    expected, _ = run(gguf_target, None, prompt.tolist(), Settings(max_new_tokens=24, draft=False))
    ids, stats = run(gguf_target, drafter, prompt.tolist(), Settings(max_new_tokens=24, block_size=8))
    native = NativeDrafter.load(drafter_folder, gguf_target, LoadSpec(RuntimeConfig(threads=1)))
    native_ids, native_stats = run(gguf_target, native, prompt.tolist(), Settings(max_new_tokens=24, block_size=8))
    assert ids == native_ids == expected
    # Random weights accept nothing, so compare what the two drafters propose for the same context, step by step.
    torch_drafts, native_drafts = (proposals(gguf_target, d, prompt.tolist(), expected, 8) for d in (drafter, native))
    assert torch_drafts == native_drafts
    assert len({tuple(d) for d in torch_drafts}) > 1  # the proposals depend on the context


def proposals(target, drafter, prompt: list[int], continuation: list[int], size: int) -> list[list[int]]:
    """The drafter's greedy block proposal after each accepted token of a fixed continuation, fed one token a step."""
    target.set_feature_layers(drafter.target_layer_ids)
    target.trim(0)
    drafter.trim(0)
    features = target.forward(torch.tensor(prompt), all_logits=False).features
    tokens, drafts = prompt + continuation[:1], []
    for index in range(1, len(continuation)):
        start = len(prompt) + index - 1
        drafts.append(drafter.propose(target, features, tokens, start, size).argmax(dim=-1).tolist())
        features = target.forward(torch.tensor([tokens[start]])).features
        tokens.append(continuation[index])
    return drafts


def test_a_forward_without_features_skips_the_taps_for_its_positions_only(tiny_gguf, heldout):
    """features=False: no features for those positions; the next forward taps again (layer inputs and the last
    layer's output embeddings), its features and logits those of a run that tapped throughout."""
    target = LlamaCppTarget.load(tiny_gguf["q8_0"], LoadSpec(RuntimeConfig(threads=1), max_context=512))
    target.set_feature_layers([1, 3, 7])
    prompt = torch.tensor(heldout[0])
    full = target.forward(prompt)
    target.trim(0)
    first = target.forward(prompt[:30], features=False)
    rest = target.forward(prompt[30:])
    assert first.features is None and torch.equal(first.logits, full.logits[:30])
    assert torch.equal(rest.features, full.features[30:]) and torch.equal(rest.logits, full.logits[30:])


def test_taps_switch_only_in_forwards_that_change_them(tiny_gguf, heldout):
    """Choosing feature layers switches no llama.cpp tap (each switch re-plans its next decode): forwards switch
    them as they want features, and choosing the same layers again leaves them as they are."""
    target = LlamaCppTarget.load(tiny_gguf["q8_0"], LoadSpec(RuntimeConfig(threads=1), max_context=512))
    switches, set_tap = [], target._set_tap
    target._set_tap = lambda ctx, layer, on: (switches.append((layer, on)), set_tap(ctx, layer, on))[1]
    prompt = torch.tensor(heldout[0])
    target.set_feature_layers([1, 3, 5])
    assert target.forward(prompt[:10], features=False).features is None and switches == []
    assert target.forward(prompt[10:20]).features.shape == (10, 3 * 256)
    assert switches == [(2, True), (4, True), (6, True)]
    target.set_feature_layers([1, 3, 5])
    target.forward(prompt[20:30])
    assert len(switches) == 3
    target.set_feature_layers([2, 4])
    assert switches[3:] == [(2, False), (4, False), (6, False)]
    assert target.forward(prompt[30:40]).features.shape == (10, 2 * 256)
    assert switches[6:] == [(3, True), (5, True)]


def test_drafter_choice(tiny_gguf):
    """auto: the native drafter beside a GGUF target on CPU (measured faster), torch otherwise; clear errors."""
    gguf_target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    torch_target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=2048))

    def planned(path: Path, kind: str = "auto") -> LoadSpec:
        return plan_load(path, LoadSpec(RuntimeConfig(device="cpu", drafter=kind)))

    assert isinstance(load_drafter(TINY / "drafter", gguf_target, planned(tiny_gguf["f16"])), NativeDrafter)
    assert isinstance(load_drafter(TINY / "drafter", gguf_target, planned(tiny_gguf["f16"], "torch")), DFlashDrafter)
    assert isinstance(load_drafter(TINY / "drafter", torch_target, planned(TINY / "target")), DFlashDrafter)
    with pytest.raises(DFlashError, match="needs a GGUF target"):
        load_drafter(TINY / "drafter", torch_target, LoadSpec(RuntimeConfig(device="cpu", drafter="native")))
    native = load_drafter(TINY / "drafter", gguf_target, planned(tiny_gguf["f16"]))
    other = LlamaCppTarget.load(tiny_gguf["q8_0"], LoadSpec(RuntimeConfig(threads=1), max_context=2048))
    with pytest.raises(DFlashError, match="only the GGUF target it was loaded with"):
        native.check_target(other)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_torch_drafter_borrows_an_int8_head(quantize, tiny_gguf, heldout):
    """A torch drafter on the CPU (fp32 or int8) makes the GGUF target keep its head as packed int8 rows: logits within
    int8 rounding of the file's head and the hidden state, output still llama.cpp's greedy ids."""
    from dflash_local.targets import load_target

    spec = LoadSpec(RuntimeConfig(device="cpu", drafter="torch"), max_context=512, drafter_quantize=quantize)
    spec = plan_load(tiny_gguf["q8_0"], spec)
    target = load_target(tiny_gguf["q8_0"], spec)
    hidden = torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(0))
    exact = hidden @ torch.from_numpy(target.rows.dequantize(target.rows.head_tensor, slice(None))).T
    drafter = load_drafter(TINY / "drafter", target, spec)
    logits = target.lm_head(hidden)
    assert isinstance(target.rows.head, Int8Matrix)
    assert (logits - exact).norm() / exact.norm() < 0.05  # int8 rows, hidden rounded to 7 bits per call
    expected = run_ar(target, heldout[0])
    ids, stats = run(target, drafter, heldout[0], Settings(max_new_tokens=NEW_TOKENS, block_size=8))
    assert ids == expected and stats.tau > 1.5


def test_the_native_drafter_takes_features_past_the_range_of_f16(tiny_gguf, heldout, drafter):
    """Gemma's tapped features reach 1e5, past F16's 65504: the native drafter's fc takes them whole (it drafted NaN
    when its fc weight was F16, whose activations llama.cpp rounds to F16). fc is followed by an RMS norm, so
    features scaled by 1e5 draft as the unscaled ones do, in both drafters."""
    target = LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1), max_context=512))
    native = NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))
    prompt = heldout[0]
    for model in (drafter, native):
        model.check_target(target)
    target.trim(0)
    out = target.forward(torch.tensor(prompt), all_logits=False)
    tokens = [*prompt, int(out.logits[-1].argmax())]
    for model in (drafter, native):
        drafted = []
        for scale in (1.0, 1e5):
            model.trim(0)
            drafted.append(model.propose(target, out.features * scale, tokens, len(prompt), 16))
        assert torch.isfinite(drafted[1]).all(), type(model).__name__
        assert torch.equal(drafted[0].argmax(dim=1), drafted[1].argmax(dim=1)), type(model).__name__
