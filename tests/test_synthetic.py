"""Random-weight pairs of real shapes, written small: configs and tensor names load in both engines' loaders."""

from __future__ import annotations

import json

from dflash_local import synthetic
from dflash_local.decode import Settings, run
from dflash_local.drafter import DFlashDrafter
from dflash_local.synthetic import Shape, write_pair
from dflash_local.targets.torch_llama import TorchLlamaTarget


def test_small_shapes_load_and_decode(monkeypatch, tmp_path):
    shapes = {
        "llama-small": Shape("llama", 64, 128, 4, 4, 2, 16, 300, False, 500000.0, 2, 8, (0, 2), 299),
        "qwen3-small": Shape("qwen3", 64, 128, 4, 4, 2, 32, 300, True, 1e6, 2, 8, (1, 3), 299),
    }
    monkeypatch.setattr(synthetic, "SHAPES", shapes)
    for name, shape in shapes.items():
        target_dir, drafter_dir = write_pair(name, tmp_path / name)
        assert json.loads((target_dir / "config.json").read_text())["model_type"] == shape.family
        target = TorchLlamaTarget.load(target_dir, max_context=64)
        drafter = DFlashDrafter.load(drafter_dir, max_context=64)
        assert (target.vocab_size, target.num_layers, drafter.block_size) == (300, 4, 8)
        assert drafter.target_layer_ids == list(shape.target_layer_ids)
        prompt = [5, 7, 11, 13]
        expected, _ = run(target, None, prompt, Settings(max_new_tokens=12, draft=False))
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=12))
        assert ids == expected and max(stats.block_sizes) == 8


def test_large_models_are_written_in_shards(monkeypatch, tmp_path):
    """Peak memory stays near one shard: tensors go to numbered files with an index past the shard limit."""
    shape = Shape("qwen3", 64, 128, 6, 4, 2, 16, 300, False, 1e6, 1, 4, (2,), 299)
    monkeypatch.setattr(synthetic, "SHAPES", {"tiny-sharded": shape})
    real = synthetic.ShardWriter.__init__
    monkeypatch.setattr(synthetic.ShardWriter, "__init__", lambda self, folder: real(self, folder, limit=40_000))
    target_dir, _ = write_pair("tiny-sharded", tmp_path)
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((target_dir / f).is_file() for f in files)
    assert not (target_dir / "model.safetensors").exists()
    target = TorchLlamaTarget.load(target_dir, max_context=32)
    assert target.num_layers == 6
