"""Greedy DFlash output equals greedy autoregressive output, whatever the drafter proposes."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable
from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec
from dflash_local.targets.torch_llama import TorchLlamaTarget

PROMPTS = [[random.Random(seed).randrange(60) for _ in range(1 + seed % 13)] for seed in range(20)]


class OracleDrafter:
    """Proposes the true continuation, corrupting each position with some probability.

    Real random-weight drafters rarely get accepted; this one exercises every acceptance length.
    """

    target_layer_ids: list[int] = []
    cache_owner: object | None = None  # the Drafter protocol's (session.Session sets it)

    def __init__(self, truth: list[int], vocab_size: int, error_rate: float, seed: int, block_size: int = 16) -> None:
        self.truth, self.vocab_size, self.error_rate = truth, vocab_size, error_rate
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.source = "dflash"
        self.calls = 0

    def check_target(self, target) -> None:
        pass

    def extend(self, features) -> None:
        pass

    def trim(self, length: int) -> None:
        pass

    def propose(self, target, new_features, tokens, start, size, rows=None):
        assert self.truth[: start + 1] == tokens
        self.calls += 1
        rows = size - 1 if rows is None else rows
        logits = torch.zeros(rows, self.vocab_size)
        for row, position in enumerate(range(start + 1, start + 1 + rows)):
            token = self.truth[position] if position < len(self.truth) else 0
            if self.rng.random() < self.error_rate:
                token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            logits[row, token] = 1.0
        return logits


@pytest.fixture(scope="module")
def target(llama_target) -> TorchLlamaTarget:
    return TorchLlamaTarget.load(llama_target, LoadSpec())


def _autoregressive(target, prompt, max_new_tokens, stop_ids=frozenset()):
    ids, stats = run(target, None, prompt, Settings(max_new_tokens=max_new_tokens, draft=False, stop_ids=stop_ids))
    assert stats.acceptance_lengths == [1] * (len(ids) - 1)
    return ids


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_oracle_drafts_are_lossless(target, block_size):
    lengths_seen = set()
    for index, prompt in enumerate(PROMPTS):
        max_new = 20 + index * 3  # ends at assorted offsets inside a block
        expected = _autoregressive(target, prompt, max_new)
        drafter = OracleDrafter(prompt + expected + [0] * 32, target.vocab_size, error_rate=0.15, seed=index)
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=max_new, block_size=block_size))
        assert ids == expected
        assert len(ids) == max_new
        assert sum(stats.acceptance_lengths) + 1 == len(ids)
        assert all(1 <= n <= block_size for n in stats.acceptance_lengths)
        lengths_seen.update(stats.acceptance_lengths)
    assert lengths_seen == set(range(1, block_size + 1))


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_stop_token_mid_block(target, block_size):
    for index, prompt in enumerate(PROMPTS):
        full = _autoregressive(target, prompt, 40)
        stop = full[7 + index % 11]
        expected = full[: full.index(stop) + 1]
        assert _autoregressive(target, prompt, 40, frozenset([stop])) == expected
        drafter = OracleDrafter(prompt + full + [0] * 32, target.vocab_size, error_rate=0.05, seed=index)
        settings = Settings(max_new_tokens=40, block_size=block_size, stop_ids=frozenset([stop]))
        ids, stats = run(target, drafter, prompt, settings)
        assert ids == expected
        assert stats.finish_reason == "stop"


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_real_drafters_are_lossless(llama_target, qwen3_target, drafters, block_size):
    """Reference-built random drafters at every depth: the autoregressive ids, and at least one draft accepted (about
    1% of steps accept one: the accept and rollback paths run, the oracle drafter above covers every length)."""
    steps = accepted = 0
    for (kind, depth), drafter_dir in drafters.items():
        target = TorchLlamaTarget.load(llama_target if kind == "llama" else qwen3_target, LoadSpec())
        drafter = DFlashDrafter.load(drafter_dir, LoadSpec())
        for prompt in PROMPTS[depth::4]:
            prompt = [t % target.vocab_size for t in prompt]
            expected = _autoregressive(target, prompt, 33)
            ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=33, block_size=block_size))
            assert ids == expected
            steps += len(stats.acceptance_lengths)
            accepted += sum(n - 1 for n in stats.acceptance_lengths)
    assert accepted >= 1, (accepted, steps)  # random drafters: 12, 21, 5 and 1 drafts over ~950 steps at 2..16


def test_first_token_can_stop(target):
    first = _autoregressive(target, PROMPTS[0], 1)[0]
    drafter = OracleDrafter([0] * 64, target.vocab_size, 0.0, 0)
    ids, stats = run(target, drafter, PROMPTS[0], Settings(max_new_tokens=30, stop_ids=frozenset([first])))
    assert ids == [first] and stats.acceptance_lengths == [] and stats.finish_reason == "stop"


def test_context_limit_ends_generation(llama_target):
    target = TorchLlamaTarget.load(llama_target, LoadSpec(max_context=24))
    prompt = PROMPTS[5]
    expected = _autoregressive(target, prompt, 100)
    assert len(prompt) + len(expected) == 24
    drafter = OracleDrafter(prompt + expected + [0] * 32, target.vocab_size, 0.1, 1)
    ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=100, block_size=8))
    assert ids == expected and stats.finish_reason == "context"


@pytest.mark.parametrize("bad_block", [1, 17])
def test_block_size_outside_trained_range(target, bad_block):
    drafter = OracleDrafter([0] * 64, target.vocab_size, 0.0, 0)
    with pytest.raises(DFlashError, match="between 2 and the drafter's trained 16"):
        run(target, drafter, [1, 2], Settings(block_size=bad_block))


def scripted_policy(block: int, drafts: bool) -> BlockPolicy:
    """--block-size auto's policy with costs that stay: a plain step 1, a verify of k tokens 0.9 + 0.1 k, a draft 0.1
    (so that both lookup and the drafter win steps)."""
    costs = CostTable({k: 0.9 + 0.1 * k for k in range(1, block + 1)}, dict.fromkeys(range(2, block + 1), 0.1))
    costs.observe = lambda *args, **kwargs: None
    return BlockPolicy(block, costs, AcceptanceEstimate.empty(block - 1, 0.999), drafts=drafts)


@pytest.mark.parametrize("block_size", [4, 16, None])
def test_lookup_without_a_drafter_is_lossless(target, block_size):
    """No drafter: lookup drafts (fixed blocks where the index matches, or auto's choice) and the ids equal plain
    decoding's; on repeated prompts most tokens are lookup's."""
    policy = scripted_policy(16, drafts=False) if block_size is None else None
    taus, sources = [], {}
    for prompt in PROMPTS[:8]:
        prompt = prompt * 3  # repetition gives the lookup something to find
        expected = _autoregressive(target, prompt, 40)
        ids, stats = run(target, None, prompt, Settings(max_new_tokens=40, block_size=block_size), policy)
        assert ids == expected
        taus.append(stats.tau)
        for source, count in stats.tokens_by_source.items():
            sources[source] = sources.get(source, 0) + count
    assert sum(taus) / len(taus) > 2.0, taus
    assert set(sources) == {"lookup", "target"} and sources["lookup"] > sources["target"], sources


def test_lookup_beside_a_drafter_is_lossless(target):
    """A drafter that errs half the time and lookup, the policy picking per step: the ids equal plain decoding's and
    both sources' drafts are kept; with --no-lookup only the drafter's are."""
    policy = scripted_policy(16, drafts=True)
    used: dict[str, int] = {}
    for seed, prompt in enumerate(PROMPTS[:8]):
        prompt = prompt * 2
        expected = _autoregressive(target, prompt, 40)
        drafter = OracleDrafter(prompt + expected, target.vocab_size, 0.5, seed)
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=40), policy)
        assert ids == expected
        for source, count in stats.tokens_by_source.items():
            used[source] = used.get(source, 0) + count
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=40, lookup=False), policy)
        assert ids == expected and "lookup" not in stats.tokens_by_source
    assert used.get("lookup", 0) > 0 and used.get("dflash", 0) > 0, used


def test_no_drafter_and_no_lookup_is_one_sentence(target):
    with pytest.raises(DFlashError, match="no drafter was given"):
        run(target, None, [1, 2], Settings(lookup=False))
