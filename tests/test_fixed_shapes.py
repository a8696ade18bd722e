"""Each model's one step function (target forward, drafter step) gives over a padded cache span, as CUDA graphs capture
it, what it gives over the exact span of eager runs; the capture/replay routing runs end to end on CPU with a stand-in
for torch.cuda.CUDAGraph (real capture is CUDA-only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_drafter

from dflash_local import cuda_graphs
from dflash_local.cuda_graphs import StepGraphs, cache_span
from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.tokenizer import TextTokenizer

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def test_cache_span_is_a_power_of_two_within_capacity() -> None:
    assert [cache_span(end, 4096) for end in (1, 256, 257, 1000, 4096, 5000)] == [256, 256, 512, 1024, 4096, 4096]
    assert cache_span(300, 64) == 64


@pytest.mark.parametrize("span", [16, 64])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_step_over_a_padded_span_matches_eager(kind: str, span: int, llama_target, qwen3_target) -> None:
    """`step` over a longer span than the used cache (what a graph captures) gives the eager forward's logits (all,
    or the last row only) and features, and leaves the cache as the eager forward does."""
    target = TorchLlamaTarget.load(llama_target if kind == "llama" else qwen3_target, LoadSpec(max_context=64))
    target.set_feature_layers([0, 2])
    prompt, block, after = torch.arange(3, 13), torch.tensor([7, 1, 30, 2, 9]), torch.tensor([4])
    target.forward(prompt)
    eager = target.forward(block)
    eager_next = target.forward(after).logits
    target.trim(len(prompt))
    last, no_features = target.step(block, torch.arange(10, 15), (), span, 1)
    assert last.shape == (1, target.vocab_size) and no_features is None
    torch.testing.assert_close(last, eager.logits[-1:], atol=1e-5, rtol=1e-5)
    logits, features = target.step(block, torch.arange(10, 15), (0, 2), span, 5)
    torch.testing.assert_close(logits, eager.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features, eager.features, atol=1e-5, rtol=1e-5)
    target.length = 15  # the step wrote positions 10..14 of the cache, as the eager forward did
    torch.testing.assert_close(target.forward(after).logits, eager_next, atol=1e-5, rtol=1e-5)


def test_prefill_runs_the_head_on_the_last_row_only(monkeypatch, llama_target) -> None:
    """A forward without all_logits computes the LM head on one row, not on every prompt position."""
    target = TorchLlamaTarget.load(llama_target, LoadSpec(max_context=64))
    want = target.forward(torch.arange(3, 43)).logits[-1:]
    target.trim(0)
    head_rows = []
    head = target.lm_head
    monkeypatch.setattr(target, "lm_head", lambda hidden: head_rows.append(hidden.shape[0]) or head(hidden))
    torch.testing.assert_close(target.forward(torch.arange(3, 43), all_logits=False).logits, want)
    assert head_rows == [1]


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
def test_drafter_step_over_a_padded_span_matches_eager(
    kernels: str, span: int, which: str, drafters, sliding_drafter, llama_target
) -> None:
    """`step` with padded features, a padded span and a context length (what a graph captures) gives the eager
    propose's logits (all rows, or the first few) and cache."""
    target = TorchLlamaTarget.load(llama_target, LoadSpec(RuntimeConfig(kernels=kernels), max_context=64))
    folder = drafters["llama", 2] if which == "full" else sliding_drafter
    eager, fixed = (
        DFlashDrafter.load(folder, LoadSpec(RuntimeConfig(kernels=kernels), max_context=64)) for _ in range(2)
    )
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
    inputs = (padded, block_ids, 6 + offsets, 9 + offsets, torch.tensor([9]), span)
    got = fixed.step(target, *inputs, 7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the padded span's matmuls block differently from the eager ones: fp32 rounding (1.3e-6 seen on an AVX-512 EPYC)
    torch.testing.assert_close(fixed.cache_k[:, :, :, :9], eager.cache_k[:, :, :, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fixed.step(target, *inputs, 2), want[:2], atol=1e-5, rtol=1e-5)


class CpuReplay:
    """CPU stand-in for CapturedStep: static input buffers and output tensors that each replay overwrites in place,
    as a CUDA graph's do; counts captures and replays."""

    captures: list = []

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.inputs = fn, tuple(t.clone() for t in inputs)
        self.outputs = fn(*self.inputs)  # the warm-up run a real capture makes
        self.replays = 0
        CpuReplay.captures.append(self)

    def __call__(self, *inputs: torch.Tensor):
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new)
        for out, new in zip(self.outputs, self.fn(*self.inputs), strict=True):
            if out is not None:
                out.copy_(new)
        self.replays += 1
        return self.outputs


@pytest.mark.parametrize("block_size", [4, 16])
def test_graph_routing_replays_to_the_eager_ids(monkeypatch, block_size: int) -> None:
    """The bundled pair's target and drafter steps routed through StepGraphs (captured once per shape, replayed after)
    decode the same ids and acceptance lengths as eager runs; replayed outputs are copies of the reused buffers."""
    monkeypatch.setattr(cuda_graphs, "CapturedStep", CpuReplay)
    CpuReplay.captures = []
    first = json.loads((TINY / "heldout_prompts.jsonl").read_text().splitlines()[0])["prompt"]
    prompt = TextTokenizer.load(TINY / "target").encode(first)
    settings = Settings(max_new_tokens=48, block_size=block_size)
    results = []
    for graphed in (False, True):
        target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=512))
        drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512))
        if graphed:
            target.graphs, drafter.graphs = StepGraphs(), StepGraphs()
        results.append(run(target, drafter, prompt, settings))
    (eager_ids, eager_stats), (graph_ids, graph_stats) = results
    assert graph_ids == eager_ids
    assert graph_stats.acceptance_lengths == eager_stats.acceptance_lengths
    assert len(set(eager_stats.acceptance_lengths)) > 2  # verify blocks of several accepted lengths were replayed
    assert sum(step.replays for step in CpuReplay.captures) > len(CpuReplay.captures)  # graphs were reused
    assert 0 < len(target.graphs.steps) < len(graph_stats.acceptance_lengths)  # one capture per shape, not per step
    assert drafter.graphs.steps


def test_replayed_draft_at_the_end_of_the_cache(monkeypatch, drafters, llama_target) -> None:
    """A replayed drafter step whose padding rows would run past the end of the cache drafts as the eager one."""
    monkeypatch.setattr(cuda_graphs, "CapturedStep", CpuReplay)
    target = TorchLlamaTarget.load(llama_target, LoadSpec(max_context=24))
    eager, graphed = (DFlashDrafter.load(drafters["llama", 2], LoadSpec(max_context=24)) for _ in range(2))
    graphed.graphs = StepGraphs()
    target.set_feature_layers(eager.target_layer_ids)
    tokens = list(range(3, 25))
    features = target.forward(torch.tensor(tokens[:21])).features
    for drafter in (eager, graphed):
        drafter.propose(target, features[:20], tokens, 20, 8)
    want = eager.propose(target, features[20:], tokens, 21, 8)
    torch.testing.assert_close(graphed.propose(target, features[20:], tokens, 21, 8), want, atol=1e-5, rtol=1e-5)
    assert graphed.graphs.steps and graphed.length == 21


def test_failed_capture_falls_back_to_eager(monkeypatch) -> None:
    """A capture CUDA refuses turns graphs off with a warning; the step still runs eagerly."""

    def refuse(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "CapturedStep", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    graphs = StepGraphs()
    with pytest.warns(RuntimeWarning, match="running eagerly"):
        (out,) = graphs.run("k", lambda x: (x * 2,), torch.tensor([1.0, 2.0]))
    assert out.tolist() == [2.0, 4.0]
    assert not graphs.enabled and graphs.steps == {}
    assert graphs.run("k", lambda x: (x + 1,), torch.tensor([1.0]))[0].tolist() == [2.0]
