"""Drafters in the layouts z-lab publishes load unchanged and draft as the reference (transformers + PyPI `dflash`):
Qwen3.5/3.6's 5-layer drafters with sliding-window layers, Gemma-style embedding scale and logit soft-cap; a
DFlash2 drafter on the torch drafter and a mismatched pair end in one sentence."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from reference import oracle_python, reference_draft_logits, reference_generate
from test_architectures import llama_cpp_source
from tiny_models import make_drafter

from dflash_local.decode import Settings, run
from dflash_local.drafters.config import DrafterConfig, check_fits
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

# The keys of a published Qwen3.6 drafter's config.json (z-lab/Qwen3.6-*-DFlash: Qwen3Config.save_pretrained of a
# DFlashDraftModel; their first layers slide, the last attends to all of the context).
PUBLISHED_KEYS = {
    "architectures",
    "attention_bias",
    "block_size",
    "dflash_config",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "layer_types",
    "max_window_layers",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "num_target_layers",
    "rms_norm_eps",
    "sliding_window",
    "use_sliding_window",
    "vocab_size",
}
QWEN36_LAYERS = ["sliding_attention"] * 4 + ["full_attention"]
WINDOW = 4  # shorter than the tests' contexts and blocks, so the window cuts both


def _edit_config(folder: Path, edit) -> Path:
    """Rewrite a drafter folder's config.json through edit(config) (a hand-written config, as users may bring)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return folder


def _copy(folder: Path, destination: Path) -> Path:
    return Path(shutil.copytree(folder, destination))


@pytest.fixture(scope="module")
def swa_drafters(tiny_dir, qwen3_target) -> dict[str, Path]:
    """5-layer drafters for the tiny Qwen3 target: as published (sliding layers causal, the reference's default for
    them), with is_causal false, one whose layer types come from max_window_layers, and a hand-written config whose
    sliding layers have no window (use_sliding_window false)."""
    published = make_drafter(
        tiny_dir / "swa-published",
        qwen3_target,
        num_layers=5,
        target_layer_ids=[0, 1, 3],
        seed=34,
        std=0.2,  # a seed and scale whose drafts the tiny target accepts at times
        layer_types=QWEN36_LAYERS,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=5,
    )
    noncausal = make_drafter(
        tiny_dir / "swa-noncausal",
        qwen3_target,
        num_layers=5,
        target_layer_ids=[0, 1, 3],
        seed=32,
        layer_types=QWEN36_LAYERS,
        use_sliding_window=True,
        sliding_window=WINDOW,
        is_causal=False,
    )
    window_off = _edit_config(
        _copy(published, tiny_dir / "swa-window-off"),
        lambda c: c.update(use_sliding_window=False, sliding_window=WINDOW),
    )
    derived = _edit_config(
        _copy(noncausal, tiny_dir / "swa-derived"), lambda c: (c.pop("layer_types"), c.update(max_window_layers=2))
    )
    return {"published": published, "noncausal": noncausal, "window-off": window_off, "derived": derived}


def test_the_sliding_drafter_has_the_published_layout(swa_drafters):
    config = json.loads((swa_drafters["published"] / "config.json").read_text())
    assert PUBLISHED_KEYS <= set(config)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert config["layer_types"] == QWEN36_LAYERS and config["num_hidden_layers"] == 5


@pytest.mark.parametrize(
    ("which", "causal", "window"),
    [
        ("published", [True] * 4 + [False], [WINDOW] * 4 + [None]),
        ("noncausal", [False] * 5, [WINDOW] * 4 + [None]),
        ("derived", [False] * 5, [None, None, WINDOW, WINDOW, WINDOW]),  # layers from max_window_layers on slide
    ],
)
def test_each_layer_slides_as_the_reference_reads_the_config(swa_drafters, which, causal, window):
    drafter = DFlashDrafter.load(swa_drafters[which], LoadSpec())
    attention = [layer.self_attn for layer in drafter.model.layers]
    assert [a.is_causal for a in attention] == causal
    assert [a.sliding_window for a in attention] == window


@pytest.mark.parametrize("which", ["published", "noncausal", "derived"])
def test_sliding_draft_logits_match_the_reference(qwen3_target, swa_drafters, which):
    folder = swa_drafters[which]
    target, drafter = TorchLlamaTarget.load(qwen3_target, LoadSpec()), DFlashDrafter.load(folder, LoadSpec())
    target.set_feature_layers(drafter.target_layer_ids)
    ids = torch.tensor([3, 9, 27, 14, 2, 8, 8, 30, 1, 5, 11, 4, 40, 6])
    # Three steps over one cache, each context longer than the window: the sliding layers drop old keys.
    steps = [(begin, end, int(ids[end])) for begin, end in ((0, 6), (6, 9), (9, 13))]
    expected = reference_draft_logits(qwen3_target, folder, ids.tolist(), steps, 8)
    features = target.forward(ids).features
    for (begin, end, first), want in zip(steps, expected, strict=True):
        logits = drafter.propose(target, features[begin:end], [0] * end + [first], end, 8)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("which", ["published", "noncausal"])
def test_sliding_drafters_decode_as_the_reference(qwen3_target, swa_drafters, which):
    target, drafter = (
        TorchLlamaTarget.load(qwen3_target, LoadSpec()),
        DFlashDrafter.load(swa_drafters[which], LoadSpec()),
    )
    prompt = [3, 9, 27, 14, 2, 8, 8, 30, 1, 5]
    plain, _ = run(target, None, prompt, Settings(max_new_tokens=40, draft=False))
    accepted = 0
    for block_size in (4, 16):
        expected_ids, expected_lengths = reference_generate(qwen3_target, swa_drafters[which], prompt, 40, block_size)
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=40, block_size=block_size))
        assert ids == expected_ids == plain
        assert stats.acceptance_lengths == expected_lengths
        accepted += sum(length > 1 for length in expected_lengths)
    if which == "published":  # (the random non-causal drafter's drafts are never accepted: its logits test checks it)
        assert accepted > 0, "no step accepted a draft, so the drafts went untested"


@pytest.fixture(scope="module")
def gemma_style_drafter(tiny_dir, qwen3_target) -> Path:
    """A drafter with Gemma's DFlash fields in dflash_config: embeddings scaled by sqrt(hidden), logits soft-capped."""
    folder = make_drafter(tiny_dir / "gemma-style", qwen3_target, num_layers=2, target_layer_ids=[0, 2], seed=41)
    scale = {"input_embedding_scale": 8.0, "final_logit_softcapping": 1.5, "output_multiplier": 2.0}
    return _edit_config(folder, lambda c: c["dflash_config"].update(scale))


def test_embedding_scale_and_softcap_draft_and_decode_as_the_reference(qwen3_target, gemma_style_drafter):
    target, drafter = (
        TorchLlamaTarget.load(qwen3_target, LoadSpec()),
        DFlashDrafter.load(gemma_style_drafter, LoadSpec()),
    )
    assert (drafter.cfg.input_embedding_scale, drafter.cfg.final_logit_softcapping) == (8.0, 1.5)
    target.set_feature_layers(drafter.target_layer_ids)
    ids = torch.tensor([7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9])
    steps = [(0, 7, int(ids[7])), (7, 11, int(ids[11]))]
    expected = reference_draft_logits(qwen3_target, gemma_style_drafter, ids.tolist(), steps, 8)
    features = target.forward(ids).features
    for (begin, end, first), want in zip(steps, expected, strict=True):
        logits = drafter.propose(target, features[begin:end], [0] * end + [first], end, 8)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)
        assert logits.abs().max() <= 1.5  # soft-capped
    target.trim(0), drafter.trim(0)
    for block_size in (4, 16):
        expected_ids, expected_lengths = reference_generate(
            qwen3_target, gemma_style_drafter, ids.tolist(), 40, block_size
        )
        generated, stats = run(target, drafter, ids.tolist(), Settings(max_new_tokens=40, block_size=block_size))
        assert generated == expected_ids
        assert stats.acceptance_lengths == expected_lengths


def test_sliding_layers_without_a_window_are_one_sentence(swa_drafters):
    # transformers reads sliding_window only with use_sliding_window; the reference cannot build such a drafter's cache
    with pytest.raises(DFlashError, match=r"layer_types has sliding layers but no window \(transformers reads"):
        DFlashDrafter.load(swa_drafters["window-off"], LoadSpec())


def test_a_dflash2_drafter_is_one_sentence_on_the_torch_drafter(tmp_path, drafters):
    # DFlash2 runs on llama.cpp's native drafter (tests/test_dflash2.py); the torch drafter has no selector
    folder = _copy(drafters["qwen3", 1], tmp_path / "dflash2")
    _edit_config(folder, lambda c: c.update(architectures=["DFlash2DraftModel"]))
    with pytest.raises(DFlashError, match=r"is a DFlash2 drafter config without dflash_config\.conv_kernel_size\.$"):
        DFlashDrafter.load(folder, LoadSpec())
    fields = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    _edit_config(folder, lambda c: c["dflash_config"].update(fields))
    with pytest.raises(DFlashError, match=r"is a DFlash2 drafter .* beside a GGUF target \(--drafter-kind native\), "):
        DFlashDrafter.load(folder, LoadSpec())


TINY_DRAFTER = Path(__file__).resolve().parent.parent / "models" / "tiny" / "drafter"


@pytest.fixture(scope="module")
def gguf_target(tiny_gguf):
    from dflash_local.targets.llamacpp import LlamaCppTarget

    return LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(max_context=256))


def _mismatches(target) -> dict[str, tuple[dict, str]]:
    """Each kind of mismatch: the change to the bundled drafter's config and the words that say it."""
    hidden, vocab, layers = target.hidden_size, target.vocab_size, target.num_layers
    ids = {"mask_token_id": 1, "target_layer_ids": [0, layers + 2]}
    return {
        "hidden size": (
            {"hidden_size": hidden * 2},
            f"its hidden size {hidden * 2} does not match the target's {hidden}",
        ),
        "layer ids": (
            {"dflash_config": ids},
            f"reads target layers [0, {layers + 2}], but the target has only {layers}",
        ),
        "vocabulary": ({"vocab_size": vocab + 5}, f"its vocabulary ({vocab + 5} tokens) does not match the target's"),
        "mask token": ({"dflash_config": {"mask_token_id": vocab}}, f"its mask token id {vocab} is outside"),
    }


@pytest.mark.parametrize("kind", ["hidden size", "layer ids", "vocabulary", "mask token"])
def test_a_mismatched_pair_is_one_sentence_naming_both(gguf_target, tiny_gguf, kind):
    from dflash_local.weights import read_config

    change, words = _mismatches(gguf_target)[kind]
    config = read_config(TINY_DRAFTER)
    config["dflash_config"] = {**config.get("dflash_config", {}), **change.pop("dflash_config", {})}
    cfg = DrafterConfig.from_dict(config | change, TINY_DRAFTER)
    with pytest.raises(DFlashError) as caught:
        check_fits(cfg, gguf_target)
    message = str(caught.value)
    assert message.startswith(f"The drafter {TINY_DRAFTER} does not fit the target {tiny_gguf['f16']}: ")
    assert words in message and ". " not in message and message.endswith(".")


def _converted(folder: Path, target_gguf: Path, out: Path) -> Path:
    """A drafter folder as llama.cpp's own converter writes it (tests/convert_drafter.py, in the oracle env)."""
    script = Path(__file__).parent / "convert_drafter.py"
    command = [oracle_python(), script, llama_cpp_source(), folder, target_gguf, out]
    built = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted_drafter(tiny_gguf, tmp_path_factory) -> Path:
    """The bundled drafter as a llama.cpp drafter GGUF."""
    return _converted(TINY_DRAFTER, tiny_gguf["f16"], tmp_path_factory.mktemp("converted") / "dflash-tiny.gguf")


def test_a_drafter_gguf_from_llamacpps_converter_drafts_natively(converted_drafter, gguf_target, heldout):
    from dflash_local.drafters.native import NativeDrafter
    from dflash_local.weights import read_config

    native = NativeDrafter.load(converted_drafter, gguf_target, LoadSpec(RuntimeConfig(threads=1)))
    published = DrafterConfig.from_dict(read_config(TINY_DRAFTER), TINY_DRAFTER)
    read = native.cfg
    assert (read.dims, read.block_size, read.target_layer_ids) == (published.dims, 16, published.target_layer_ids)
    assert (read.mask_token_id, read.layer_types) == (published.mask_token_id, published.layer_types)
    assert read.source == converted_drafter
    from_folder = NativeDrafter.load(TINY_DRAFTER, gguf_target, LoadSpec(RuntimeConfig(threads=1)))
    taus, folder_taus = [], []
    for prompt in heldout[:3]:
        plain, _ = run(gguf_target, None, prompt, Settings(max_new_tokens=40, draft=False))
        for block_size in (4, 16):
            settings = Settings(max_new_tokens=40, block_size=block_size)
            ids, stats = run(gguf_target, native, prompt, settings)
            assert ids == plain
            taus.append(stats.tau)
            folder_taus.append(run(gguf_target, from_folder, prompt, settings)[1].tau)
    assert sum(taus) / len(taus) > 2.0, taus  # the trained pair accepts: the file's drafts are the drafter's
    assert abs(sum(taus) - sum(folder_taus)) / sum(folder_taus) < 0.05, (taus, folder_taus)


def test_a_drafter_gguf_is_refused_by_the_torch_drafter_and_a_target_gguf_as_drafter(converted_drafter, tiny_gguf):
    from dflash_local.drafters import load_drafter
    from dflash_local.drafters.gguf_drafter import gguf_drafter_config
    from dflash_local.runtime import LoadSpec, RuntimeConfig

    spec = LoadSpec(runtime=RuntimeConfig(drafter="torch"))
    with pytest.raises(DFlashError, match=r"is a llama.cpp drafter GGUF, which runs only as llama.cpp.s native"):
        load_drafter(converted_drafter, None, spec)
    with pytest.raises(DFlashError, match=r"is a llama model, not a DFlash drafter \(GGUF architecture dflash\)\.$"):
        gguf_drafter_config(tiny_gguf["f16"])


@pytest.fixture(scope="module")
def tiny_swa_drafter(tiny_dir) -> Path:
    """A random non-causal 5-layer sliding drafter for the bundled tiny target, its window a block (16)."""
    target = TINY_DRAFTER.parent / "target"
    return make_drafter(
        tiny_dir / "tiny-swa",
        target,
        num_layers=5,
        target_layer_ids=[1, 3, 5],
        seed=5,
        std=0.05,
        layer_types=QWEN36_LAYERS,
        use_sliding_window=True,
        sliding_window=16,
        is_causal=False,
    )


def test_native_sliding_drafters_draft_as_the_torch_one(gguf_target, tiny_swa_drafter, tiny_gguf, tmp_path):
    """Written by dflash or by llama.cpp's converter, a non-causal sliding drafter runs in llama.cpp as the torch
    drafter (the reference's rules) runs it, over contexts longer than the window. (A causal one differs by 2-5.)"""
    from dflash_local.drafters.native import NativeDrafter

    converted = _converted(tiny_swa_drafter, tiny_gguf["f16"], tmp_path / "dflash-swa.gguf")
    natives = [
        NativeDrafter.load(path, gguf_target, LoadSpec(RuntimeConfig(threads=1)))
        for path in (tiny_swa_drafter, converted)
    ]
    assert [d.cfg.layer_types for d in natives] == [QWEN36_LAYERS] * 2 and natives[1].cfg.sliding_window == 16
    reference = DFlashDrafter.load(tiny_swa_drafter, LoadSpec(max_context=256))
    gguf_target.trim(0)
    gguf_target.set_feature_layers([1, 3, 5])
    ids = torch.randint(5, 4000, (90,), generator=torch.Generator().manual_seed(0))
    features = gguf_target.forward(ids, features=True).features
    for begin, end in ((0, 40), (40, 45), (45, 61), (61, 80)):
        want = reference.propose(gguf_target, features[begin:end], ids.tolist(), end, 16)
        for native in natives:
            got = native.propose(gguf_target, features[begin:end], ids.tolist(), end, 16)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.01)  # llama.cpp's F16 KV cache


def test_the_native_drafter_refuses_causal_sliding_layers_in_one_sentence(gguf_target, tiny_swa_drafter, tmp_path):
    from dflash_local.drafters.native import NativeDrafter

    causal = _edit_config(_copy(tiny_swa_drafter, tmp_path / "causal"), lambda c: c.pop("is_causal"))
    refusal = r"native drafter handles only non-causal drafters .*; use --drafter-kind torch\.$"
    with pytest.raises(DFlashError, match=refusal):
        NativeDrafter.load(causal, gguf_target, LoadSpec(RuntimeConfig(threads=1)))


def test_generate_takes_a_drafter_gguf_from_the_command_line(converted_drafter, tiny_gguf, heldout):
    from in_process import invoke

    prompt = ",".join(map(str, heldout[0]))
    common = ["generate", "--target", tiny_gguf["f16"], "--prompt-ids", prompt, "--max-new-tokens", "24", "--json"]
    drafted = invoke(*common, "--drafter", converted_drafter, "--block-size", "16")
    plain = invoke(*common, "--no-draft")
    assert drafted.exit_code == 0 and plain.exit_code == 0, drafted.stderr + plain.stderr
    drafted_json, plain_json = json.loads(drafted.stdout), json.loads(plain.stdout)
    assert drafted_json["output_ids"] == plain_json["output_ids"]
    assert drafted_json["tau"] > 1.5  # the trained pair accepts: the file's drafts are the drafter's
    torch_kind = invoke(*common, "--drafter", converted_drafter, "--drafter-kind", "torch")
    lines = torch_kind.stderr.strip().splitlines()
    assert torch_kind.exit_code == 1 and len(lines) == 1 and "is a llama.cpp drafter GGUF" in lines[0]


def test_auto_plans_the_torch_drafter_for_what_the_native_one_refuses(tiny_swa_drafter, tiny_gguf, tmp_path):
    """Published sliding drafters are causal: beside a GGUF target on the CPU, --drafter-kind auto loads them as the
    torch drafter (the native one refuses them) and a non-causal one as the native drafter."""
    from dflash_local.drafters import native_runs
    from dflash_local.drafters.native import NativeDrafter
    from dflash_local.generation import load_models
    from dflash_local.runtime import plan_load

    causal = _edit_config(_copy(tiny_swa_drafter, tmp_path / "causal"), lambda c: c.pop("is_causal"))
    spec = LoadSpec(RuntimeConfig("cpu", threads=1), max_context=256)
    assert [native_runs(causal), native_runs(tiny_swa_drafter), native_runs(None)] == [False, True, True]
    assert plan_load(tiny_gguf["f16"], spec, native_runs(causal)).runtime.drafter == "torch"
    assert plan_load(tiny_gguf["f16"], spec).runtime.drafter == "native"
    loaded = [load_models(tiny_gguf["f16"], d, spec, auto_block=False).drafter for d in (causal, tiny_swa_drafter)]
    assert [type(d) for d in loaded] == [DFlashDrafter, NativeDrafter]


def test_a_layer_tensor_the_drafter_does_not_have_is_one_sentence(tmp_path):
    """A published drafter whose layers carry a part this engine's layer lacks (gpt-oss-style attention sinks) is
    refused by name, not loaded without it."""
    from safetensors.torch import load_file, save_file

    folder = _copy(TINY_DRAFTER, tmp_path / "sinks")
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "layers.1.self_attn.sinks": torch.zeros(4)}, folder / "model.safetensors")
    with pytest.raises(
        DFlashError,
        match=r"sinks: drafter tensor layers\.1\.self_attn\.sinks belongs to a layer part this drafter does not",
    ):
        DFlashDrafter.load(folder, LoadSpec(max_context=64))
