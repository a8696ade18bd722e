"""Our engine reproduces the reference implementation (transformers + PyPI `dflash`) exactly at fp32."""

from __future__ import annotations

import pytest
import torch
from reference import reference_draft_logits, reference_forward, reference_generate

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget

PROMPTS = ([5], [3, 9, 27, 14, 2], [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3], list(range(10, 40)))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_logits_and_features_match_transformers(kind, llama_target, qwen3_target):
    folder = llama_target if kind == "llama" else qwen3_target
    ours = TorchLlamaTarget.load(folder, LoadSpec())
    ours.set_feature_layers([0, 2, 3])
    ids = torch.arange(1, 26) % 40
    expected_logits, hidden = reference_forward(folder, ids.tolist())
    first, second = ours.forward(ids[:11]), ours.forward(ids[11:])
    logits = torch.cat([first.logits, second.logits])
    features = torch.cat([first.features, second.features])
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(features, torch.cat([hidden[1], hidden[3], hidden[4]], -1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_generation_matches_reference(kind, depth, llama_target, qwen3_target, drafters):
    target_dir = llama_target if kind == "llama" else qwen3_target
    drafter_dir = drafters[kind, depth]
    target, drafter = TorchLlamaTarget.load(target_dir, LoadSpec()), DFlashDrafter.load(drafter_dir, LoadSpec())
    accepted_beyond_one = 0
    for prompt in PROMPTS[: 2 + depth % 2 * 2]:
        for block_size in (2, 5, 16):
            expected_ids, expected_lengths = reference_generate(target_dir, drafter_dir, prompt, 48, block_size)
            ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=48, block_size=block_size))
            assert ids == expected_ids
            assert stats.acceptance_lengths == expected_lengths
            accepted_beyond_one += sum(length > 1 for length in expected_lengths)
    assert accepted_beyond_one > 0, "no step accepted a draft, so parity of the accept path went untested"


def test_draft_step_logits_match_reference(qwen3_target, drafters):
    drafter_dir = drafters["qwen3", 2]
    target, drafter = TorchLlamaTarget.load(qwen3_target, LoadSpec()), DFlashDrafter.load(drafter_dir, LoadSpec())
    target.set_feature_layers(drafter.target_layer_ids)
    ids = torch.tensor([3, 9, 27, 14, 2, 8, 8, 30, 1, 5])
    # Two steps: 6 context positions then 4 more, so the second step reads the drafter's cache.
    steps = [(begin, end, int(ids[end - 1]) if end < 10 else 7) for begin, end in ((0, 6), (6, 10))]
    expected = reference_draft_logits(qwen3_target, drafter_dir, ids.tolist(), steps, 8)
    features = target.forward(ids).features
    for (begin, end, first), want in zip(steps, expected, strict=True):
        logits = drafter.propose(target, features[begin:end], [0] * end + [first], end, 8)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)
