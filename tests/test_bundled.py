"""The shipped tiny pair: loads, decodes losslessly, drafts well, and the reference agrees with us."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import reference_generate

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.tokenizer import TextTokenizer, stop_token_ids

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


@pytest.fixture(scope="module")
def pair():
    return TorchLlamaTarget.load(TINY / "target", LoadSpec()), DFlashDrafter.load(TINY / "drafter", LoadSpec())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = TextTokenizer.load(TINY / "target")
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()
    return [tokenizer.encode(json.loads(line)["prompt"]) for line in lines[:4]]


def test_shipped_pair_is_lossless_and_accepts(pair, prompts):
    target, drafter = pair
    assert drafter.block_size == 16
    stop = stop_token_ids(TINY / "target")
    taus = []
    for prompt in prompts:
        expected, _ = run(target, None, prompt, Settings(max_new_tokens=64, draft=False, stop_ids=stop))
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=64, stop_ids=stop))
        assert ids == expected
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 2.0, taus


def test_reference_reproduces_shipped_pair(pair, prompts):
    target, drafter = pair
    for prompt in prompts[:2]:
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=48))
        ref_ids, ref_lengths = reference_generate(TINY / "target", TINY / "drafter", prompt, 48, 16)
        assert ref_ids == ids
        assert ref_lengths == stats.acceptance_lengths
