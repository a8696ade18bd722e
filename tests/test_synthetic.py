"""Random-weight pairs of real shapes, written small: configs and tensor names load in both engines' loaders."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_synthetic as bench
from benchmarks import synthetic
from benchmarks.synthetic import Shape, write_pair
from dflash_local.block_policy import expected_tokens
from dflash_local.decode import Settings, run
from dflash_local.dimensions import Dimensions
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget


def test_small_shapes_load_and_decode(monkeypatch, tmp_path):
    shapes = {
        "llama-small": Shape("llama", Dimensions(64, 128, 4, 4, 2, 16, 300, False), 500000.0, 2, 8, (0, 2), 299),
        "qwen3-small": Shape("qwen3", Dimensions(64, 128, 4, 4, 2, 32, 300, True), 1e6, 2, 8, (1, 3), 299),
    }
    monkeypatch.setattr(synthetic, "SHAPES", shapes)
    for name, shape in shapes.items():
        target_dir, drafter_dir = write_pair(name, tmp_path / name)
        assert json.loads((target_dir / "config.json").read_text())["model_type"] == shape.family
        target = TorchLlamaTarget.load(target_dir, LoadSpec(max_context=64))
        drafter = DFlashDrafter.load(drafter_dir, LoadSpec(max_context=64))
        assert (target.vocab_size, target.num_layers, drafter.block_size) == (300, 4, 8)
        assert drafter.target_layer_ids == list(shape.target_layer_ids)
        prompt = [5, 7, 11, 13]
        expected, _ = run(target, None, prompt, Settings(max_new_tokens=12, draft=False))
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=12))
        assert ids == expected and max(stats.block_sizes) == 8


def test_large_models_are_written_in_shards(monkeypatch, tmp_path):
    """Peak memory stays near one shard: tensors go to numbered files with an index past the shard limit."""
    shape = Shape("qwen3", Dimensions(64, 128, 6, 4, 2, 16, 300, False), 1e6, 1, 4, (2,), 299)
    monkeypatch.setattr(synthetic, "SHAPES", {"tiny-sharded": shape})
    real = synthetic.ShardWriter.__init__
    monkeypatch.setattr(synthetic.ShardWriter, "__init__", lambda self, folder: real(self, folder, limit=40_000))
    target_dir, _ = write_pair("tiny-sharded", tmp_path)
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((target_dir / f).is_file() for f in files)
    assert not (target_dir / "model.safetensors").exists()
    target = TorchLlamaTarget.load(target_dir, LoadSpec(max_context=32))
    assert target.num_layers == 6


def test_bench_script_measures_a_small_pair(monkeypatch, tmp_path):
    """benchmarks.bench_synthetic writes the pair with a tokenizer, converts it through `dflash convert`, runs each
    drafter kind in its own process and reports costs per k, memory beside its estimate, and speedups per profile."""
    pytest.importorskip("llama_cpp")
    shape = Shape("llama", Dimensions(64, 128, 4, 4, 2, 16, 300, False), 500000.0, 2, 4, (0, 2), 299)
    monkeypatch.setattr(synthetic, "SHAPES", {"llama-small": shape})
    out = tmp_path / "bench.json"
    argv = ["llama-small", "--dir", str(tmp_path / "pair"), "--drafters", "none,native", "--context", "16"]
    report = bench.main(
        argv
        + [
            "--max-context",
            "256",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "bench.md"),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "pair" / "target-q4_k_m.gguf").is_file()
    none, native = report["rows"]
    assert (none["drafter"], native["drafter"], native["block_size"]) == ("none", "native", 4)
    assert set(native["verify_k_ms"]) == {"1", "2", "3", "4"} and set(native["drafter_rows_ms"]) == {"1", "2", "3"}
    assert set(native["speedup"]) == {"math", "code", "chat"}
    for row in report["rows"]:
        assert row["peak_rss_gb"] > 0.1 and row["estimate_gb"] > 0.1 and "rss_ok" in row["targets"]
    assert "load_ok" in native["targets"] and "load_ok" not in none["targets"]
    rates = bench.geometric_rates(6.5)
    assert len(rates) == 15 and abs(expected_tokens(rates, 16)[16] - 6.5) < 1e-9  # tau 6.5 at block 16
