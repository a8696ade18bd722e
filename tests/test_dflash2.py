"""DFlash2 drafters (block 8, local convolutions and a candidate selector) draft through llama.cpp's native drafter,
from llama.cpp's own converter's GGUF and from the folder (written by dflash), losslessly at blocks 8, 4 and auto;
their drafts are the walk of the selector's lattice; the torch drafter refuses them in one sentence."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_gguf_lossless import auto_policy
from test_published_drafters import TINY_DRAFTER, _converted

from dflash_local.decode import Settings, run
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams

KERNEL, GROUP, RANK, TOP_K = 3, 32, 16, 4


@pytest.fixture(scope="module")
def dflash2_folder(tmp_path_factory) -> Path:
    """The bundled drafter's trained layers as a DFlash2 drafter: block 8, each layer's two convolutions near identity
    (tap 0 of both sides 1, small other taps and per-token kernels) so its drafts are still accepted at times, and a
    random selector whose pairwise scores (about 4) often overturn the drafter's own top candidate, so the walk's
    predecessor decides picks."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("dflash2") / "drafter"
    folder.mkdir()
    config = json.loads((TINY_DRAFTER / "config.json").read_text())
    config["architectures"], config["block_size"] = ["DFlash2DraftModel"], 8
    config["dflash_config"] |= {
        "block_size": 8,
        "conv_kernel_size": KERNEL,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(TINY_DRAFTER / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    for layer in range(config["num_hidden_layers"]):
        for part in ("attention_conv", "mlp_conv"):  # shapes as llama.cpp's converter maps them (gguf-py)
            base = torch.zeros(2, KERNEL, hidden)
            base[:, 0] = 1.0
            base[:, 1:] = 0.05 * torch.randn(2, KERNEL - 1, hidden, generator=generator)
            weights[f"layers.{layer}.{part}.base_kernel"] = base
            projection = 0.01 * torch.randn(2 * KERNEL * (hidden // GROUP), hidden, generator=generator)
            weights[f"layers.{layer}.{part}.kernel_projection.weight"] = projection
    weights["candidate_selector.predecessor_codebook"] = torch.randn(vocab, RANK, generator=generator)
    weights["candidate_selector.successor_codebook"] = torch.randn(vocab, RANK, generator=generator)
    weights["candidate_selector.hidden_projection.weight"] = torch.randn(RANK, hidden, generator=generator) / 16
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def dflash2_gguf(dflash2_folder, tiny_gguf) -> Path:
    """The DFlash2 folder as llama.cpp's own converter writes it."""
    return _converted(dflash2_folder, tiny_gguf["f16"], dflash2_folder.parent / "dflash2.gguf")


@pytest.fixture(scope="module")
def gguf_target(tiny_gguf):
    from dflash_local.targets.llamacpp import LlamaCppTarget

    return LlamaCppTarget.load(tiny_gguf["f16"], LoadSpec(max_context=256))


def _native(source: Path, target):
    from dflash_local.drafters.native import NativeDrafter

    return NativeDrafter.load(source, target, LoadSpec(RuntimeConfig(threads=1)))


def _walk(lattice: np.ndarray, rows: int) -> list[int]:
    """The drafts of a lattice (block rows x hidden): row i holds TOP_K candidate ids, then TOP_K x TOP_K scores, row
    p of them scoring each candidate after row i-1's candidate p; the walk starts at candidate 0 of row 0."""
    drafts, previous = [], 0
    for row in lattice[1 : rows + 1]:
        scores = row[TOP_K:].reshape(-1)[: TOP_K * TOP_K].reshape(TOP_K, TOP_K)[previous]
        previous = int(scores.argmax())
        drafts.append(int(row[previous]))
    return drafts


def test_the_folder_is_written_as_llamacpps_converter_writes_it(dflash2_folder, dflash2_gguf, gguf_target):
    import gguf

    from dflash_local.drafters.native import cached_drafter_gguf

    native = _native(dflash2_folder, gguf_target)
    written = cached_drafter_gguf(dflash2_folder, native.cfg, gguf_target)
    theirs, ours = gguf.GGUFReader(dflash2_gguf), gguf.GGUFReader(written)
    shapes = [{t.name: tuple(int(n) for n in t.shape) for t in reader.tensors} for reader in (theirs, ours)]
    assert shapes[0] == shapes[1]
    assert {"selector_predecessor.weight", "blk.1.ffn_conv_base", "blk.0.attn_conv_proj.weight"} <= set(shapes[1])
    for key in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        values = [int(reader.fields[f"dflash.{key}"].contents()) for reader in (theirs, ours)]
        assert values[0] == values[1], key
    assert native.cfg.dflash2 == {
        "conv_kernel_size": KERNEL,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    }
    assert _native(dflash2_gguf, gguf_target).cfg.dflash2 == native.cfg.dflash2


def test_drafts_are_the_walk_of_the_selectors_lattice(dflash2_gguf, gguf_target, heldout):
    from dflash_local.llama_lib import dflash2_functions

    native = _native(dflash2_gguf, gguf_target)
    assert (native.selector_top_k, native.block_size) == (TOP_K, 8)
    get_lattice = dflash2_functions()[2]
    hidden = native.cfg.dims.hidden
    gguf_target.trim(0)
    native.check_target(gguf_target)
    ids = heldout[0] + heldout[1]
    features = gguf_target.forward(torch.tensor(ids), features=True).features
    overturned = 0
    for start, rows in ((40, 7), (60, 7), (61, 3), (len(ids) - 1, 7)):
        drafted = native.propose(gguf_target, features[native.length : start], ids, start, 8, rows)
        lattice = np.ctypeslib.as_array(get_lattice(native.context.ctx), shape=(8 * hidden,)).reshape(8, hidden)
        assert torch.isfinite(drafted).sum(dim=1).tolist() == [1] * rows  # a point mass per row
        assert drafted.argmax(dim=1).tolist() == _walk(lattice, rows)
        candidates = lattice[1:, :TOP_K]
        assert (candidates == candidates.round()).all() and len(set(candidates[0].tolist())) == TOP_K
        overturned += sum(  # rows whose pick is not the pick after candidate 0 (a walk that ignores predecessors)
            int(lattice[i, lattice[i, TOP_K : 2 * TOP_K].argmax()]) != token
            for i, token in enumerate(_walk(lattice, rows), start=1)
        )
    assert overturned >= 3, overturned  # the predecessor decides picks, so a wrong walk differs


def test_dflash2_output_equals_plain_decoding(dflash2_folder, dflash2_gguf, gguf_target, heldout):
    taus = []
    for source in (dflash2_gguf, dflash2_folder):
        native = _native(source, gguf_target)
        for prompt in heldout[:2]:
            plain, _ = run(gguf_target, None, prompt, Settings(max_new_tokens=32, draft=False))
            for block_size in (8, 4):
                ids, stats = run(gguf_target, native, prompt, Settings(max_new_tokens=32, block_size=block_size))
                assert ids == plain
                taus.append(stats.tau)
            # --block-size auto: the policy drafts the whole block of 8 and verifies 1 to 8 of it
            ids, stats = run(gguf_target, native, prompt, Settings(max_new_tokens=32), policy=auto_policy(8))
            assert ids == plain and len(set(stats.block_sizes)) > 1, stats.block_sizes
        sampled, stats = run(
            gguf_target, native, heldout[2], Settings(max_new_tokens=16, sampling=SamplingParams(0.8), seed=1)
        )
        assert 0 < len(sampled) <= 16 and stats.tau >= 1.0  # T>0: the point-mass drafts go through rejection sampling
    assert sum(taus) / len(taus) > 1.1, taus  # drafts are accepted: the walked tokens are the drafter's


def test_the_torch_drafter_refuses_dflash2_and_auto_plans_native(dflash2_folder, tmp_path, tiny_gguf):
    from dflash_local.drafters import load_drafter, native_runs
    from dflash_local.runtime import plan_load

    spec = LoadSpec(RuntimeConfig(threads=1, drafter="torch"))
    with pytest.raises(DFlashError, match=r"is a DFlash2 drafter .* runs only on llama.cpp's native drafter beside a "):
        load_drafter(dflash2_folder, SimpleNamespace(max_context=64), spec)
    planned = plan_load(tiny_gguf["f16"], LoadSpec(RuntimeConfig(threads=1)), native_runs(dflash2_folder))
    assert planned.runtime.drafter == "native"
    folder = Path(shutil.copytree(dflash2_folder, tmp_path / "no-top-k"))
    config = json.loads((folder / "config.json").read_text())
    del config["dflash_config"]["selector_top_k"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=r"is a DFlash2 drafter config without dflash_config\.selector_top_k\.$"):
        native_runs(folder)


def test_dflash2_under_a_grammar_equals_constrained_plain_decoding(dflash2_gguf, gguf_target, heldout):
    """A walked draft the grammar forbids ends the block (its point-mass row has no allowed id); constrained output
    stays that of constrained plain decoding at blocks 8 and 4."""
    from test_structured import RECORD

    from dflash_local.gguf.tokenizer import GGUFTokenizer
    from dflash_local.grammar import compile_grammar, json_schema_grammar

    native = _native(dflash2_gguf, gguf_target)
    tokenizer = GGUFTokenizer.of_context(gguf_target.context)
    grammar = compile_grammar(json_schema_grammar(RECORD), tokenizer, gguf_target.vocab_size, gguf_target.stop_ids)
    settings = Settings(max_new_tokens=32, stop_ids=grammar.stop_ids, grammar=grammar)
    plain, _ = run(gguf_target, None, heldout[0], replace(settings, draft=False))
    for block_size in (8, 4):
        ids, stats = run(gguf_target, native, heldout[0], replace(settings, block_size=block_size))
        assert ids == plain
        # blocks cut short by a forbidden pick (1: none allowed), and blocks whose allowed picks were verified
        assert stats.block_sizes.count(1) > 1 and max(stats.block_sizes) > 1, stats.block_sizes
