"""`dflash train`'s recipe options: soft labels in the shards, warm starts (--init target / DRAFTER), the evaluation,
and training that resumes after the process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from in_process import invoke
from tiny_models import add_char_tokenizer, make_drafter, make_target

from dflash_local.errors import DFlashError
from dflash_local.layers import rope_cos_sin
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.train.evaluate import summarise, walk
from dflash_local.train.pipeline import DistillProgress, TrainRequest, run_training
from dflash_local.train.selfdistill import Continuation, DistillSettings, load_shards, pack_shard
from dflash_local.train.trainer import TrainSettings, drafter_config, new_drafter
from dflash_local.train.warm_start import WarmStart, from_target, torch_layer_reader
from dflash_local.weights import read_weights

CODE = "def add(a, b):\n    return a + b\n\n\nclass Counter:\n    def step(self):\n        self.count += 1\n" * 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("recipe")
    target = make_target(root / "target", kind="qwen3", vocab_size=96, num_layers=6, seed=5, std=0.1)
    add_char_tokenizer(target, 96)
    (root / "corpus").mkdir()
    (root / "corpus" / "code.py").write_text(CODE)
    return target, root / "corpus"


def _request(target: Path, corpus: Path, out: Path, steps: int = 4, **changes) -> TrainRequest:
    request = TrainRequest(
        target=target,
        corpus=[corpus],
        out=out,
        prompt_tokens=16,
        max_prompts=8,
        mask_token_id=95,
        distill=DistillSettings(new_tokens=20, batch_size=4, shard_size=4, sampled_fraction=0.25, soft_top_k=5),
        train=TrainSettings(
            layers=2, block_size=4, steps=steps, batch_size=4, anchors=4, warmup=1, eval_every=2, checkpoint_every=2
        ),
    )
    return replace(request, **changes)


def test_soft_labels_round_trip_through_a_shard(tmp_path):
    rows = [
        (Continuation([1, 2, 3, 4, 5], torch.randn(4, 6), torch.tensor([[7, 1], [2, 9]]), torch.randn(2, 2)), 3, False),
        (Continuation([1, 2, 3], torch.randn(2, 6), torch.tensor([[3, 4]]), torch.randn(1, 2)), 2, True),
    ]
    pack_shard(rows, tmp_path / "shard_00000.safetensors")
    shard = load_shards(tmp_path)[0]
    for index, (found, prompt_length, _) in enumerate(rows):
        end = len(found.ids)
        assert shard["soft_ids"][index, prompt_length:end].tolist() == found.top_ids.tolist()
        assert torch.equal(shard["soft_logits"][index, prompt_length:end], found.top_logits.to(torch.bfloat16))
        assert not shard["soft_ids"][index, :prompt_length].any()


def test_distilled_soft_labels_are_the_targets_top_logits(setup, tmp_path):
    """Each stored top-k is the target's own, one sequence at a time, at the position of the token it predicts."""
    target_dir, corpus = setup
    list(run_training(_request(target_dir, corpus, tmp_path / "d", steps=0)))
    shard = load_shards(tmp_path / "d.work" / "data")[0]
    model = TorchLlamaTarget.load(target_dir, LoadSpec()).model
    for row in range(len(shard["lengths"])):
        length, first = int(shard["lengths"][row]), int(shard["prompt_lengths"][row])
        ids = shard["tokens"][row, :length].long()[None]
        cache = model.new_cache(1, length)
        slots = torch.arange(length)
        mask = (slots[:, None] >= slots[None, :])[None, None]
        hidden, _ = model.run_layers(ids, slots[None], cache, slots, mask, [])
        values, top = model.lm_head(hidden[0, first - 1 : length - 1]).topk(5)
        assert shard["soft_ids"][row, first:length].tolist() == top.tolist()
        assert torch.allclose(shard["soft_logits"][row, first:length].float(), values, rtol=1e-2, atol=1e-2)
        if not bool(shard["sampled"][row]):
            assert shard["soft_ids"][row, first:length, 0].tolist() == ids[0, first:].tolist()
    assert not bool(shard["sampled"].all())  # greedy rows were among them: the check above ran


def test_soft_weight_changes_the_loss_and_needs_soft_shards(setup, tmp_path):
    target_dir, corpus = setup
    losses = {}
    for weight in (0.0, 0.5):
        request = _request(target_dir, corpus, tmp_path / "d", steps=1)
        request = replace(request, train=replace(request.train, soft_weight=weight))
        losses[weight] = [e.loss for e in run_training(request) if not isinstance(e, DistillProgress)][0]
    assert losses[0.0] != pytest.approx(losses[0.5], rel=1e-3)
    plain = replace(_request(target_dir, corpus, tmp_path / "p", steps=1), distill=DistillSettings(new_tokens=20))
    plain = replace(plain, train=replace(plain.train, soft_weight=0.5))
    with pytest.raises(DFlashError, match="the shards hold none"):
        list(run_training(plain))


def test_init_target_first_forward_equals_the_target_layers(setup):
    """Drafter layers 0, 1 are target layers 4, 5; with fc the identity on layer 3's output and hidden_norm layer 4's
    input norm, the first drafter layer over layer 3's output (the context) gives layer 4's output."""
    target_dir, _ = setup
    target = TorchLlamaTarget.load(target_dir, LoadSpec())
    model = target.model
    config = drafter_config(target.cfg, 2, 4, [1, 2, 3], 95)
    initial, started = from_target(torch_layer_reader(model), config)
    assert started.target_layers == [4, 5]
    drafter = new_drafter(config, 0, None, initial, None)
    length = 12
    ids = torch.randint(0, 95, (1, length))
    slots = torch.arange(length)
    mask = (slots[:, None] >= slots[None, :])[None, None]
    _, features = model.run_layers(ids, slots[None], model.new_cache(1, length), slots, mask, [1, 2, 3, 4, 5])
    h3, h4, normed_h5 = features[..., 128:192], features[..., 192:256], features[..., 256:320]  # the last one normed
    cos, sin = (t[None, None] for t in rope_cos_sin(drafter.inv_freq, slots, torch.float32))
    context = drafter.project_context(features[:, : length - 1, :192])
    layer = drafter.layers[0]
    past_k, past_v = layer.self_attn.key_value(context, cos[:, :, :-1], sin[:, :, :-1])
    out = layer(h3[:, -1:], cos[:, :, -1:], sin[:, :, -1:], past_k, past_v, torch.ones(1, 1, 1, length, dtype=bool))
    assert torch.allclose(out, h4[:, -1:], atol=1e-5)
    # every copied layer computes its target layer (causal, no context)
    none = torch.zeros(1, drafter.cfg.dims.kv_heads, 0, drafter.cfg.dims.head_dim)
    assert torch.allclose(drafter.layers[0](h3, cos, sin, none, none, mask), h4, atol=1e-5)
    last = drafter.norm(drafter.layers[1](h4, cos, sin, none, none, mask))
    assert torch.allclose(last, normed_h5, atol=1e-5)


def test_init_target_trains_and_says_what_it_copied(setup, tmp_path):
    target_dir, corpus = setup
    events = list(run_training(_request(target_dir, corpus, tmp_path / "d", init="target")))
    started = [e for e in events if isinstance(e, WarmStart)]
    assert len(started) == 1 and started[0].target_layers == [4, 5]
    assert started[0].tensors == 2 * 11 + 3  # 11 per layer, the final norm, hidden_norm, fc
    assert [e.step for e in events if hasattr(e, "step")] == [1, 2, 3, 4]


def test_init_drafter_fine_tunes_it(setup, tmp_path):
    """Fine-tuning starts from the given drafter: with a vanishing learning rate the export equals it."""
    target_dir, corpus = setup
    list(run_training(_request(target_dir, corpus, tmp_path / "first", steps=4)))
    request = _request(target_dir, corpus, tmp_path / "tuned", steps=1, init=str(tmp_path / "first"))
    request = replace(request, train=replace(request.train, lr=1e-12, layers=1, block_size=8))
    events = list(run_training(request))
    assert [e.source for e in events if isinstance(e, WarmStart)] == [str(tmp_path / "first")]
    before = dict(read_weights(tmp_path / "first", torch.float32))
    after = dict(read_weights(tmp_path / "tuned", torch.float32))
    assert before.keys() == after.keys() and "layers.1.mlp.up_proj.weight" in after  # its depth, not --layers
    for name, tensor in before.items():
        assert torch.allclose(after[name], tensor, rtol=1e-2, atol=1e-3), name


def test_init_drafter_refuses_a_drafter_of_another_shape(setup, tmp_path):
    target_dir, corpus = setup
    other = make_target(tmp_path / "other", kind="qwen3", vocab_size=96, hidden_size=32, num_layers=6, seed=1)
    drafter = make_drafter(tmp_path / "small", other, num_layers=1, block_size=4)
    result = invoke("train", "--target", target_dir, "--corpus", corpus, "--out", tmp_path / "out", "--init", drafter)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: The drafter in {drafter} does not fit this target: its hidden size is 32, the target's 64."
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


KILLED_RUN = """
import sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_train_recipe import _request
from dflash_local.train.pipeline import run_training
request = _request(Path({target!r}), Path({corpus!r}), Path({out!r}), steps=100000)
request = replace(request, train=replace(request.train, checkpoint_every=3, eval_every=1000, lr=3e-3))
for event in run_training(request):
    pass
"""


def test_training_resumes_after_a_kill(setup, tmp_path):
    """SIGKILL mid-training leaves a whole checkpoint; --resume continues from its step with its weights."""
    target_dir, corpus = setup
    out = tmp_path / "d"
    script = KILLED_RUN.format(
        tests=str(Path(__file__).parent), target=str(target_dir), corpus=str(corpus), out=str(out)
    )
    checkpoint = out.with_name("d.work") / "checkpoint.pt"
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if checkpoint.exists() and torch.load(checkpoint, weights_only=True)["step"] >= 6:
                break
            time.sleep(0.2)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    state = torch.load(checkpoint, weights_only=True)
    step = int(state["step"])
    assert step >= 6 and step % 3 == 0
    request = _request(target_dir, corpus, out, steps=step + 2, resume=True)
    request = replace(request, train=replace(request.train, lr=1e-12, checkpoint_every=1000))
    events = [e for e in run_training(request) if hasattr(e, "step")]
    assert [e.step for e in events] == [step + 1, step + 2]
    resumed = dict(read_weights(out, torch.float32))
    for name in ("layers.0.mlp.up_proj.weight", "layers.1.self_attn.q_proj.weight"):  # the checkpoint's, not new ones
        assert torch.allclose(resumed[name], state["model"][name].float(), rtol=1e-2, atol=1e-5), name


def test_walk_and_summary_count_as_decoding_does():
    assert walk([3, 0, 0, 1, 0], 16) == (5, 2)  # 4 tokens, then the last position's 1
    assert walk([3, 0, 0, 1, 0], 2) == (5, 3)  # block 2 drafts one token: 2, then 1, then 2
    result = summarise([[3, 0, 0, 1, 0], [0, 0]], 16, (2, 16))
    assert result.rows == 2
    assert result.tau[16] == pytest.approx(7 / 4)
    assert result.acceptance[:4] == pytest.approx([2 / 7, 1 / 7, 1 / 7, 0.0])
    low, high = result.interval[16]
    assert low <= result.tau[16] <= high
