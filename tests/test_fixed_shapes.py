"""The fixed-shape steps that CUDA graphs capture (target forward, drafter step) match the eager ones on CPU."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before kernels import their Triton twins

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import make_drafter  # noqa: E402

from dflash_local.cuda_graphs import cache_span  # noqa: E402
from dflash_local.drafter import DFlashDrafter  # noqa: E402
from dflash_local.targets.torch_llama import TorchLlamaTarget  # noqa: E402
from kernels import KERNELS_ENV  # noqa: E402


def test_cache_span_is_a_power_of_two_within_capacity() -> None:
    assert [cache_span(end, 4096) for end in (1, 256, 257, 1000, 4096, 5000)] == [256, 256, 512, 1024, 4096, 4096]
    assert cache_span(300, 64) == 64


@pytest.mark.parametrize("span", [16, 64])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_forward_fixed_matches_eager(kind: str, span: int, llama_target, qwen3_target) -> None:
    target = TorchLlamaTarget.load(llama_target if kind == "llama" else qwen3_target, max_context=64)
    assert target.graphs is None  # CUDA graphs are never used on CPU
    target.set_feature_layers([0, 2])
    prompt, block, after = torch.arange(3, 13), torch.tensor([7, 1, 30, 2, 9]), torch.tensor([4])
    target.forward(prompt)
    eager = target.forward(block)
    eager_next = target.forward(after).logits
    target.rollback(len(prompt))
    logits, features = target.forward_fixed(block, torch.arange(10, 15), [0, 2], span)
    torch.testing.assert_close(logits, eager.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features, eager.features, atol=1e-5, rtol=1e-5)
    target.length = 15  # the fixed forward wrote positions 10..14 of the cache, as the eager one did
    torch.testing.assert_close(target.forward(after).logits, eager_next, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def sliding_drafter(tiny_dir, llama_target):
    """A drafter whose first layer is a sliding-window (causal) layer."""
    return make_drafter(
        tiny_dir / "llama-sliding",
        llama_target,
        num_layers=2,
        target_layer_ids=[0, 2],
        seed=5,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        use_sliding_window=True,
    )


@pytest.mark.parametrize("kernels,span", [("torch", 16), ("torch", 64), ("triton", 16), ("triton", 64)])
@pytest.mark.parametrize("which", ["full", "sliding"])
def test_drafter_propose_fixed_matches_eager(
    monkeypatch, kernels: str, span: int, which: str, drafters, sliding_drafter, llama_target
) -> None:
    monkeypatch.setenv(KERNELS_ENV, kernels)
    target = TorchLlamaTarget.load(llama_target, max_context=64)
    folder = drafters["llama", 2] if which == "full" else sliding_drafter
    eager, fixed = (DFlashDrafter.load(folder, max_context=64) for _ in range(2))
    assert eager.graphs is None
    assert eager.model.layers[0].self_attn.sliding_window == (4 if which == "sliding" else None)
    target.set_feature_layers(eager.target_layer_ids)
    tokens = [5, 9, 11, 2, 7, 30, 8, 1, 4, 6, 3]
    features = target.forward(torch.tensor(tokens[:10])).features
    for drafter in (eager, fixed):
        drafter.propose(target, features[:6], tokens, 6, 8)
    want = eager.propose(target, features[6:9], tokens, 9, 8)
    padded = torch.zeros(8, features.shape[1])
    padded[:3] = features[6:9]
    block_ids = torch.tensor([tokens[9]] + [fixed.cfg.mask_token_id] * 7)
    offsets = torch.arange(8)
    got = fixed.propose_fixed(target, padded, block_ids, 6 + offsets, 9 + offsets, torch.tensor([9]), span)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fixed.cache_k[:, :, :, :9], eager.cache_k[:, :, :, :9], atol=1e-6, rtol=1e-6)
