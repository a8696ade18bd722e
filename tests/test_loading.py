"""Loading HF-layout folders: sharded weights, transformers 4.x and 5.x configs, tied heads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from reference import reference_layer_ids, reference_save_sharded

from dflash_local.drafters.config import default_target_layer_ids
from dflash_local.targets.torch_llama import TorchLlamaTarget

IDS = torch.tensor([4, 8, 15, 16, 23, 42, 7, 1])


def _logits(folder) -> torch.Tensor:
    return TorchLlamaTarget.load(folder).forward(IDS, features=False).logits


def test_sharded_checkpoint(tmp_path, llama_target):
    reference_save_sharded(llama_target, tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    torch.testing.assert_close(_logits(tmp_path / "sharded"), _logits(llama_target), atol=0, rtol=0)


def test_transformers4_rope_config(tmp_path, llama_target):
    folder = tmp_path / "v4"
    shutil.copytree(llama_target, folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(_logits(folder), _logits(llama_target), atol=0, rtol=0)
    config["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(config))
    assert not torch.allclose(_logits(folder), _logits(llama_target))


def test_tied_head_shares_embeddings(qwen3_target):
    target = TorchLlamaTarget.load(qwen3_target)
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()


def test_default_layer_ids_match_reference():
    for layers in (8, 28, 36):
        for depth in (1, 2, 5):
            assert default_target_layer_ids(layers, depth) == reference_layer_ids(layers, depth)


def test_rollback_recomputes_identically(llama_target):
    target = TorchLlamaTarget.load(llama_target)
    whole = target.forward(IDS).logits
    target.rollback(3)
    again = target.forward(IDS[3:]).logits
    torch.testing.assert_close(again, whole[3:], atol=1e-6, rtol=1e-5)


def test_loading_the_bundled_pair_never_imports_torch_dynamo() -> None:
    """Models are built on the meta device without random init or meta factories: either would import torch._dynamo
    (2-3 s of every start on this CPU)."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from dflash_local.drafters.torch_drafter import DFlashDrafter;"
        "from dflash_local.targets.torch_llama import TorchLlamaTarget;"
        "TorchLlamaTarget.load(Path(sys.argv[1]) / 'target'); DFlashDrafter.load(Path(sys.argv[1]) / 'drafter');"
        "print('torch._dynamo' in sys.modules)"
    )
    bundled = Path(__file__).resolve().parent.parent / "models" / "tiny"
    result = subprocess.run([sys.executable, "-c", code, str(bundled)], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
