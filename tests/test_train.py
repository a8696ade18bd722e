"""`dflash train`: a few steps learn, checkpoints resume, the drafter loads here and in the reference."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from in_process import invoke
from one_error import assert_one_error
from tiny_models import add_char_tokenizer, make_target

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.train.pipeline import DistillProgress, TrainRequest, run_training
from dflash_local.train.selfdistill import DistillSettings
from dflash_local.train.trainer import TrainSettings

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def step(self):
        self.count += 1
        return self.count
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train")
    target = make_target(root / "target", vocab_size=96, seed=3, std=0.1)
    add_char_tokenizer(target, 96)
    (root / "corpus").mkdir()
    (root / "corpus" / "code.py").write_text(CODE * 12)
    return target, root / "corpus"


def _request(
    target: Path, corpus: Path, out: Path, steps: int, resume: bool = False, prompts: int = 24
) -> TrainRequest:
    return TrainRequest(
        target=target,
        corpus=[corpus],
        out=out,
        prompt_tokens=16,
        max_prompts=prompts,
        mask_token_id=95,
        resume=resume,
        distill=DistillSettings(new_tokens=24, batch_size=8, shard_size=16, sampled_fraction=0.25),
        train=TrainSettings(
            layers=1,
            block_size=4,
            steps=steps,
            batch_size=4,
            anchors=4,
            lr=3e-3,
            warmup=5,
            eval_every=10,
            checkpoint_every=10,
            heldout_fraction=0.1,
        ),
    )


def test_training_learns_and_exports(setup, tmp_path):
    target_dir, corpus = setup
    events = list(run_training(_request(target_dir, corpus, tmp_path / "drafter", steps=60)))
    distilled = [e for e in events if isinstance(e, DistillProgress)]
    assert distilled[-1].done == distilled[-1].total == 24
    assert len(list((tmp_path / "drafter.work" / "data").glob("shard_*.safetensors"))) == 2
    losses = [e.loss for e in events if not isinstance(e, DistillProgress)]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10

    target = TorchLlamaTarget.load(target_dir, LoadSpec())
    drafter = DFlashDrafter.load(tmp_path / "drafter", LoadSpec())
    assert drafter.block_size == 4 and drafter.cfg.mask_token_id == 95
    prompt = [10, 20, 30, 40]
    expected, _ = run(target, None, prompt, Settings(max_new_tokens=30, draft=False))
    ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=30))
    assert ids == expected

    from reference import reference_generate

    ref_ids, ref_lengths = reference_generate(target_dir, tmp_path / "drafter", prompt, 30, 4)
    assert ref_ids == ids  # the reference loads our published-layout drafter


def test_resume_continues_from_checkpoint(setup, tmp_path):
    target_dir, corpus = setup
    list(run_training(_request(target_dir, corpus, tmp_path / "d", steps=10)))
    state = torch.load(tmp_path / "d.work" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 10
    resumed = [
        e
        for e in run_training(_request(target_dir, corpus, tmp_path / "d", 20, True))
        if not isinstance(e, DistillProgress)
    ]
    assert [e.step for e in resumed] == list(range(11, 21))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--corpus", "missing.txt"], "Corpus path missing.txt does not exist."),
        (["--corpus", "EMPTY"], "The corpus has no usable text"),
        (["--target", "NOTMODEL"], "has no config.json, so it is not a model folder."),
        (["--block-size", "1"], "The block size must be at least 2, not 1."),
    ],
)
def test_train_bad_input(setup, tmp_path, args, message):
    target_dir, corpus = setup
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notmodel").mkdir()
    values = {"--target": str(target_dir), "--corpus": str(corpus), "--out": str(tmp_path / "out")}
    swap = {"EMPTY": str(tmp_path / "empty.txt"), "NOTMODEL": str(tmp_path / "notmodel")}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        values[flag] = swap.get(value, value)
    assert_one_error(invoke("train", *[x for pair in values.items() for x in pair]), message)
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "notmodel")


def test_partial_last_shard_is_regenerated_for_more_prompts(setup, tmp_path):
    from dflash_local.train.selfdistill import _rows_in

    target_dir, corpus = setup
    list(run_training(_request(target_dir, corpus, tmp_path / "d", steps=1)))
    last = tmp_path / "d.work" / "data" / "shard_00001.safetensors"
    assert _rows_in(last) == 8
    list(run_training(_request(target_dir, corpus, tmp_path / "d", steps=1, prompts=32)))
    assert _rows_in(last) == 16


def test_a_gguf_target_trains_a_reduced_vocabulary_drafter_both_drafters_run(tiny_gguf, tmp_path):
    """--target FILE.gguf: llama.cpp continues the prompts (its taps give the features, equal to the one-sequence
    target's; its top-4 logits, the soft labels), the drafter drafts over the data's most frequent ids (d2t) and runs
    as torch and native drafter alike, losslessly; resuming continues from the checkpoint."""
    from dflash_local.drafters.native import NativeDrafter
    from dflash_local.targets.llamacpp import LlamaCppTarget
    from dflash_local.train.selfdistill import load_shards

    corpus = Path(__file__).resolve().parent.parent / "models" / "tiny" / "heldout_prompts.jsonl"
    request = TrainRequest(
        target=tiny_gguf["q8_0"],
        corpus=[corpus],
        out=tmp_path / "drafter",
        prompt_tokens=16,
        max_prompts=12,
        draft_vocab=300,
        threads=1,
        distill=DistillSettings(new_tokens=24, batch_size=6, shard_size=6, sampled_fraction=0.0, soft_top_k=4),
        train=TrainSettings(
            layers=1, block_size=4, steps=12, batch_size=4, anchors=4, warmup=2, eval_every=6, checkpoint_every=6
        ),
    )
    events = [e for e in run_training(request) if not isinstance(e, DistillProgress)]
    assert [e.step for e in events] == list(range(1, 13))
    target = LlamaCppTarget.load(tiny_gguf["q8_0"], LoadSpec(RuntimeConfig(threads=1), max_context=512))
    drafter = DFlashDrafter.load(tmp_path / "drafter", LoadSpec(max_context=512))
    assert drafter.model.d2t.shape == (300,) and len(set(drafter.model.d2t.tolist())) == 300
    shard = load_shards(tmp_path / "drafter.work" / "data")[0]
    ids, length = shard["tokens"][0].tolist(), int(shard["lengths"][0])
    target.set_feature_layers(drafter.target_layer_ids)
    expected = target.forward(torch.tensor(ids[: length - 1]), features=True)
    stored = shard["features"][0, : length - 1].float()  # bf16, from a batched prefill (the tiled kernels, F32
    # attention) where the forward above runs in verify order (one-row attention rounds Q to F16): 0.6% measured
    assert ((stored - expected.features).norm(dim=-1) / expected.features.norm(dim=-1)).max() < 2e-2
    assert (
        expected.logits[int(shard["prompt_lengths"][0]) - 1 :].argmax(dim=1).tolist()
        == ids[int(shard["prompt_lengths"][0]) : length]
    )  # the shard's continuation is the target's greedy one
    first = int(shard["prompt_lengths"][0])
    logits = expected.logits[first - 1 : length - 1]  # soft labels: the target's top 4 (near-ties may swap)
    values, top = logits.topk(4)
    stored = shard["soft_ids"][0, first:length].long()
    assert stored[:, 0].tolist() == top[:, 0].tolist()
    assert torch.allclose(shard["soft_logits"][0, first:length].float(), logits.gather(1, stored), atol=5e-2)
    assert torch.allclose(shard["soft_logits"][0, first:length].float(), values, atol=5e-2)
    prompt = ids[:10]
    plain, _ = run(target, None, prompt, Settings(max_new_tokens=24, draft=False))
    for each in (drafter, NativeDrafter.load(tmp_path / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))):
        assert run(target, each, prompt, Settings(max_new_tokens=24, block_size=4))[0] == plain
    resumed = replace(request, resume=True, train=replace(request.train, steps=18))
    assert [e.step for e in run_training(resumed) if not isinstance(e, DistillProgress)] == list(range(13, 19))


def test_the_exported_fc_takes_raw_features(tmp_path):
    """Training divides the features by their per-channel scale; the export folds that into fc, so the drafter
    projects the target's raw features as training projected the scaled ones."""
    from dflash_local.train.trainer import new_drafter, save_drafter

    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 96,
        "block_size": 4,
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 2]},
    }
    model = new_drafter(config, 0)
    scale = torch.logspace(-2, 4, 128)  # channels 10^6 apart, as Gemma's layers and outliers are
    raw = torch.randn(5, 128) * scale
    save_drafter(model, config, tmp_path / "d", scale)
    loaded = DFlashDrafter.load(tmp_path / "d", LoadSpec())
    expected = model.project_context(raw / scale)
    assert torch.allclose(loaded.model.project_context(raw), expected, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(model.project_context(raw), expected, rtol=2e-2, atol=2e-2)
