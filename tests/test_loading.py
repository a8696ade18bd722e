"""Loading HF-layout folders: sharded weights, transformers 4.x and 5.x configs, tied heads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from reference import reference_layer_ids, reference_save_sharded

from dflash_local.drafters.config import default_target_layer_ids
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

IDS = torch.tensor([4, 8, 15, 16, 23, 42, 7, 1])


def _logits(folder) -> torch.Tensor:
    return TorchLlamaTarget.load(folder, LoadSpec()).forward(IDS, features=False).logits


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
    target = TorchLlamaTarget.load(qwen3_target, LoadSpec())
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()


def test_default_layer_ids_match_reference():
    for layers in (8, 28, 36):
        for depth in (1, 2, 5):
            assert default_target_layer_ids(layers, depth) == reference_layer_ids(layers, depth)


def test_rollback_recomputes_identically(llama_target):
    target = TorchLlamaTarget.load(llama_target, LoadSpec())
    whole = target.forward(IDS).logits
    target.trim(3)
    again = target.forward(IDS[3:]).logits
    torch.testing.assert_close(again, whole[3:], atol=1e-6, rtol=1e-5)


def test_loading_the_bundled_pair_never_imports_torch_dynamo() -> None:
    """Models are built on the meta device without random init or meta factories: either would import torch._dynamo
    (2-3 s of every start on this CPU)."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from dflash_local.drafters.torch_drafter import DFlashDrafter;"
        "from dflash_local.targets.torch_llama import TorchLlamaTarget; from dflash_local.runtime import LoadSpec;"
        "TorchLlamaTarget.load(Path(sys.argv[1]) / 'target', LoadSpec());"
        "DFlashDrafter.load(Path(sys.argv[1]) / 'drafter', LoadSpec());"
        "print('torch._dynamo' in sys.modules)"
    )
    bundled = Path(__file__).resolve().parent.parent / "models" / "tiny"
    result = subprocess.run([sys.executable, "-c", code, str(bundled)], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def test_the_plan_decides_device_backend_and_drafter_kind_once(tiny_gguf) -> None:
    """runtime.plan_load: a folder runs on torch with the torch drafter (whatever --drafter-kind says); a GGUF file
    on the CPU runs on llama.cpp with the native drafter unless the drafter is quantized or torch is asked for; an
    explicit --backend torch on a GGUF keeps the torch drafter; a planned spec plans to itself."""
    from dflash_local.runtime import LoadSpec, plan_load

    def planned(path: str, backend: str = "auto", kind: str = "auto", quantize: str | None = None) -> tuple:
        spec = plan_load(
            Path(path), LoadSpec(RuntimeConfig("cpu", drafter=kind), drafter_quantize=quantize, backend=backend)
        )
        assert plan_load(Path(path), spec) == spec
        return spec.runtime.device, spec.backend, spec.runtime.drafter

    assert planned("folder") == ("cpu", "torch", "torch")
    assert planned("folder", kind="native") == ("cpu", "torch", "torch")
    gguf = str(tiny_gguf["q8_0"])
    assert planned(gguf) == ("cpu", "llamacpp", "native")
    assert planned(gguf, quantize="int8") == ("cpu", "llamacpp", "torch")
    assert planned(gguf, kind="torch") == ("cpu", "llamacpp", "torch")
    assert planned(gguf, backend="torch") == ("cpu", "torch", "torch")


def test_loading_reports_its_phases_to_the_spec_and_leaves_the_target_as_planned(tmp_path: Path) -> None:
    """load_models tells spec.progress what it loads (no global status line); with the torch drafter beside a GGUF
    target on the CPU, the target is loaded with its head as int8 rows (the plan's choice) and the drafter's load
    changes nothing on it."""
    pytest.importorskip("llama_cpp")
    from dflash_local.drafters import load_drafter
    from dflash_local.generation import load_models
    from dflash_local.gguf.convert import convert
    from dflash_local.runtime import LoadSpec, plan_load
    from dflash_local.targets import load_target
    from dflash_local.targets.llamacpp import LlamaCppTarget

    seen: list[str] = []
    spec = LoadSpec(RuntimeConfig("cpu"), max_context=64, progress=seen.append)
    models = load_models(TINY / "target", TINY / "drafter", spec, auto_block=False)
    assert seen == ["loading the target", "loading the drafter"] and models.drafter is not None
    gguf = convert(TINY / "target", tmp_path / "tiny.gguf", "q8_0", threads=1)
    for kind, int8_head in (("torch", True), ("native", False)):
        spec = plan_load(gguf, LoadSpec(RuntimeConfig("cpu", drafter=kind), max_context=64))
        assert load_target(gguf, spec).rows.int8_head is int8_head
    target = LlamaCppTarget.load(gguf, LoadSpec(RuntimeConfig(threads=1), max_context=64))  # the head as floats
    before = {owner: dict(vars(owner)) for owner in (target, target.rows)}
    load_drafter(TINY / "drafter", target, plan_load(gguf, LoadSpec(RuntimeConfig("cpu", drafter="torch"))))
    for owner, attrs in before.items():
        assert vars(owner).keys() == attrs.keys() and all(vars(owner)[k] is v for k, v in attrs.items())
