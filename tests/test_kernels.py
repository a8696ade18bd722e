"""Triton kernels (run by the Triton interpreter) match their torch references, and the engine's greedy ids too.

Tolerances, fp32 throughout (the interpreter's tl.dot is wrong on bf16 inputs): attention atol 1e-5 / rtol 1e-4
(online softmax sums in another order), RMSNorm atol 1e-5 / rtol 1e-5, greedy acceptance exact.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from dflash_local.kernels import accept_triton, attention_triton, rmsnorm_triton, use_triton
from dflash_local.kernels.accept import greedy_accept_reference
from dflash_local.kernels.accept_triton import greedy_accept_triton
from dflash_local.kernels.attention import block_attention_reference
from dflash_local.kernels.attention_triton import block_attention_triton
from dflash_local.kernels.rmsnorm import rms_norm_reference
from dflash_local.kernels.rmsnorm_triton import rms_norm_triton

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.layers import RMSNorm, set_kernels
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

BUNDLED = Path(__file__).parent.parent / "models" / "tiny"


def _attention_inputs(seed: int, batch: int, kv_heads: int, group: int, context: int, block: int, head_dim: int):
    """Random q, block K/V, and context K/V sliced out of a longer cache (strided, as the drafter passes them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, block, head_dim, generator=gen)
    cache_k = torch.randn(batch, kv_heads, context + 7, head_dim, generator=gen)
    cache_v = torch.randn(batch, kv_heads, context + 7, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, block, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, block, head_dim, generator=gen)
    return q, cache_k[:, :, :context], cache_v[:, :, :context], k, v


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block", [2, 8, 16])
@pytest.mark.parametrize("context", [0, 1, 17, 300])
def test_block_attention_matches_reference(context: int, block: int, group: int) -> None:
    head_dim = 24 if group == 1 else 64
    inputs = _attention_inputs(
        context * 100 + block * 10 + group, 2 if context == 17 else 1, 2, group, context, block, head_dim
    )
    got = block_attention_triton(*inputs)
    torch.testing.assert_close(got, block_attention_reference(*inputs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal,window", [(True, None), (False, 5), (True, 7), (False, 40)])
@pytest.mark.parametrize("context", [0, 17, 300])
def test_block_attention_masks_match_reference(context: int, causal: bool, window: int | None) -> None:
    inputs = _attention_inputs(context + (window or 0), 1, 2, 4, context, 8, 32)
    got = block_attention_triton(*inputs, causal=causal, window=window)
    torch.testing.assert_close(got, block_attention_reference(*inputs, causal, window), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 5)])
@pytest.mark.parametrize("context", [0, 1, 17, 70])
def test_block_attention_fixed_shape_matches_reference(context: int, causal: bool, window: int | None) -> None:
    q, cache_k, cache_v, k, v = _attention_inputs(context + 3, 1, 2, 4, 80, 8, 32)  # a cache of 80 slots
    length = torch.tensor([context])  # only the first `context` slots hold context
    got = block_attention_triton(q, cache_k, cache_v, k, v, causal, window, length)
    want = block_attention_reference(q, cache_k, cache_v, k, v, causal, window, length)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    sliced = block_attention_reference(q, cache_k[:, :, :context], cache_v[:, :, :context], k, v, causal, window)
    torch.testing.assert_close(got, sliced, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 96), (2, 16, 4, 24), (0, 32)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(shape: tuple[int, ...], with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    weight = 1 + 0.2 * torch.randn(shape[-1], generator=gen)
    residual = torch.randn(shape, generator=gen) if with_residual else None
    normed, summed = rms_norm_triton(x, weight, 1e-6, residual)
    want_normed, want_summed = rms_norm_reference(x, weight, 1e-6, residual)
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, want_summed, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,vocab", [(1, 50), (2, 1024), (8, 3000), (16, 1100)])
def test_greedy_accept_matches_reference(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, [3, vocab - 2]] = 100.0  # a tie across vocab tiles: the first index wins, as in torch.argmax
    choice = logits.argmax(dim=-1)
    for mismatch in range(rows):
        draft = choice[:-1].clone()
        if mismatch < rows - 1:
            draft[mismatch] = (draft[mismatch] + 1) % vocab
            draft[mismatch + 1 :] = (draft[mismatch + 1 :] + 1) % vocab if mismatch % 2 else draft[mismatch + 1 :]
        got = greedy_accept_triton(draft, logits)
        assert got.tolist() == greedy_accept_reference(draft, logits).tolist()
        assert got[0] == mismatch


def test_backend_choice() -> None:
    x = torch.zeros(2)
    assert not use_triton("auto", x)  # auto: CPU tensors take the reference
    assert use_triton("triton", x)
    assert not use_triton("triton", torch.zeros(2, requires_grad=True))  # autograd always takes the reference
    assert not use_triton("torch", x)
    with pytest.raises(ValueError, match="Unknown kernels 'cuda'"):
        use_triton("cuda", x)
    with pytest.raises(ValueError, match="Unknown kernels 'cuda'"):
        set_kernels(RMSNorm(4, 1e-6), "cuda")


def test_bad_kernel_settings_fail_in_one_sentence(monkeypatch) -> None:
    with pytest.raises(DFlashError, match="Unknown kernels 'cuda' \\(use auto, triton, torch\\)"):
        RuntimeConfig(kernels="cuda")
    with pytest.raises(DFlashError, match="Unknown kernels 'cuda' \\(use auto, triton, torch\\)"):
        TorchLlamaTarget.load(BUNDLED / "target", LoadSpec(RuntimeConfig(kernels="cuda")))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(DFlashError, match="off CUDA need TRITON_INTERPRET=1"):
        DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(RuntimeConfig(kernels="triton")))


TRITON_CALLS = (
    (rmsnorm_triton, "rms_norm_triton"),
    (attention_triton, "block_attention_triton"),
    (accept_triton, "greedy_accept_triton"),
)


def test_each_loaded_pair_keeps_its_own_kernel_mode(monkeypatch) -> None:
    """Two pairs loaded in one process with different modes each run in their own, whichever was loaded or run last:
    the torch pair calls no Triton kernel, the triton pair calls each (RMSNorm, block attention, greedy acceptance)."""
    calls: Counter[str] = Counter()
    for module, name in TRITON_CALLS:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name: calls.update([name]) or kernel(*a))
    pairs = {
        mode: (
            TorchLlamaTarget.load(BUNDLED / "target", LoadSpec(RuntimeConfig(kernels=mode), max_context=64)),
            DFlashDrafter.load(BUNDLED / "drafter", LoadSpec(RuntimeConfig(kernels=mode), max_context=64)),
        )
        for mode in ("triton", "torch")
    }
    for mode in ("torch", "triton", "torch"):
        calls.clear()
        run(*pairs[mode], [10, 57, 300, 41, 12], Settings(max_new_tokens=3))
        assert set(calls) == ({name for _, name in TRITON_CALLS} if mode == "triton" else set()), mode


def _greedy(target, drafter, prompt: list[int], tokens: int) -> tuple[list[int], list[int]]:
    ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=tokens))
    return ids, stats.acceptance_lengths


def _same_with_both_backends(
    target: Path, drafter: Path, context: int, prompts: list[list[int]], tokens: int
) -> list[int]:
    """The pair loaded once per kernel mode gives the same greedy ids and acceptance lengths; returns the lengths."""
    results = {}
    for mode in ("torch", "triton"):
        loaded = TorchLlamaTarget.load(target, LoadSpec(RuntimeConfig(kernels=mode), max_context=context))
        draft = DFlashDrafter.load(drafter, LoadSpec(RuntimeConfig(kernels=mode), max_context=context))
        results[mode] = [_greedy(loaded, draft, prompt, tokens) for prompt in prompts]
    assert results["triton"] == results["torch"]
    return [length for _, lengths in results["torch"] for length in lengths]


def test_engine_ids_identical_on_bundled_models() -> None:
    prompts = [[10, 57, 300, 41, 12, 9, 77, 8]]
    lengths = _same_with_both_backends(BUNDLED / "target", BUNDLED / "drafter", 256, prompts, 24)
    assert max(lengths) > 1  # the trained drafter gets drafts accepted, so the multi-token path ran


@pytest.mark.parametrize("name,depth", [("llama", 2), ("qwen3", 3)])
def test_engine_ids_identical_on_tiny_models(drafters, llama_target, qwen3_target, name, depth) -> None:
    target = llama_target if name == "llama" else qwen3_target
    _same_with_both_backends(target, drafters[name, depth], 128, [[1, 2, 3], [5, 9, 11, 2, 7, 30, 8, 1, 4]], 12)
