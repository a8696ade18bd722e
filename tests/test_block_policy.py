"""The cost-aware block size: choices from scripted costs and acceptances, learning, caching, and losslessness."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from test_lossless import PROMPTS, OracleDrafter, _autoregressive

from dflash_local.block_policy import (
    HISTORY_DECAY,
    AcceptanceEstimate,
    BlockPolicy,
    CostTable,
    expected_tokens,
    load_policy,
    measure_costs,
)
from dflash_local.block_policy.policy import PROBE_SHARE, RECHECK
from dflash_local.decode import Settings, generate, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


def policy_with(target: dict[int, float], draft: dict[int, float], rate: float, block: int = 16) -> BlockPolicy:
    """A policy with scripted costs and a drafter history that accepted each position at `rate` (1000 steps)."""
    history = AcceptanceEstimate([1000.0] * (block - 1), [1000.0 * rate] * (block - 1), HISTORY_DECAY)
    return BlockPolicy(block, CostTable(target, draft), history)


def linear(base: float, per_token: float, block: int = 16, first: int = 1) -> dict[int, float]:
    return {k: base + per_token * (k - 1) for k in range(first, block + 1)}


def test_expected_tokens_multiplies_conditional_rates():
    assert expected_tokens([0.5, 0.5, 0.5], 4) == [0.0, 1.0, 1.5, 1.75, 1.875]
    assert expected_tokens([1.0, 0.0, 1.0], 4) == [0.0, 1.0, 2.0, 2.0, 2.0]  # nothing past a never-accepted position
    assert expected_tokens([0.9] * 15, 1) == [0.0, 1.0]


def test_full_block_when_verify_is_free():
    policy = policy_with(linear(1.0, 0.0), linear(0.1, 0.0, first=2), rate=0.8)
    assert policy.choose(100) == 16
    assert policy.choose(5) == 5  # never more than the tokens left


def test_a_drafter_with_no_history_is_tried_with_small_blocks_first():
    """Free verification and an optimistic prior, but no steps seen yet: k = 2, then doubling per drafting step."""
    policy = BlockPolicy(16, CostTable(linear(1.0, 0.0), linear(0.1, 0.0, first=2)), AcceptanceEstimate.empty(15, 1.0))
    choices = []
    for _ in range(5):
        choices.append(policy.choose(100))
        policy.observe(choices[-1], choices[-1] - 1, 0.1, 1.0)
    assert choices == [2, 4, 8, 16, 16]
    # Drafting that pays only at large k (verify is cheap, the drafter step dear) is still tried, small first.
    policy = BlockPolicy(16, CostTable(linear(1.0, 0.0), linear(1.5, 0.0, first=2)), AcceptanceEstimate.empty(15, 1.0))
    assert policy.choose(100) == 2


def test_plain_steps_when_drafting_loses_with_bounded_probes():
    costs_t, costs_d = linear(1.0, 0.5), linear(2.0, 0.0, first=2)
    policy = policy_with(costs_t, costs_d, rate=0.3)
    choices = [policy.choose(100) for _ in range(2000)]
    probes = [k for k in choices if k > 1]
    assert choices[0] == 1
    assert 1 <= len(probes) <= 8  # it keeps probing, ever more rarely
    extra = sum(policy.costs.step_s(k) - policy.costs.step_s(1) for k in probes)
    assert extra <= 2 * PROBE_SHARE * len(choices) * policy.costs.step_s(1)


def test_in_between_block():
    # verify costs 1 + 0.25(k-1), drafting 0.25, each draft accepted with p = 0.6: tokens per second of cost
    # k=1: 1/1 = 1.0, k=2: 1.6/1.5 = 1.067, k=3: 1.96/1.75 = 1.12, k=4: 2.176/2.0 = 1.088, k=5: 2.31/2.25 = 1.02.
    policy = policy_with(linear(1.0, 0.25), linear(0.25, 0.0, first=2), rate=0.6)
    assert policy.choose(100) == 3


def test_learns_to_stop_and_to_resume_drafting():
    policy = BlockPolicy(8, CostTable(linear(1.0, 0.05, 8), linear(0.5, 0.0, 8, 2)), AcceptanceEstimate.empty(7, 1.0))
    first = policy.choose(100)
    assert first > 1  # no history: the optimistic prior tries drafting
    for _ in range(40):
        k = policy.choose(100)
        if k > 1:
            policy.observe(k, 0, 0.5, 1.0)  # nothing accepted
    assert policy.choose(100) == 1
    for _ in range(5000):  # now the text is predictable: the next probes accept everything
        k = policy.choose(100)
        if k > 1:
            policy.observe(k, k - 1, 0.5, 1.0)
            if policy.choose(100) > 1:
                break
    assert policy.choose(100) == 8


def test_costs_follow_timed_steps():
    """Same acceptance (3 drafts per step), different timings: the drafter measured 50x slower than calibrated
    makes plain steps win, the calibrated one keeps drafting."""
    slow, steady = (policy_with(linear(1.0, 0.0), linear(0.1, 0.0, first=2), rate=0.8) for _ in range(2))
    for _ in range(50):
        slow.observe(16, 3, 5.0, 1.0)
        steady.observe(16, 3, 0.1, 1.0)
    assert slow.costs.draft_s[2] > 4.0  # every k's drafter cost follows
    assert slow.choose(100) == 1
    assert steady.choose(100) > 1


def test_plain_steps_are_learnt_from_in_bulk_as_one_by_one():
    """Plain steps settle at the next fresh choice: costs and fading as if each had been observed on its own."""
    bulk, single = (policy_with(linear(1.0, 0.5), linear(2.0, 0.0, first=2), rate=0.3) for _ in range(2))
    for policy in (bulk, single):
        policy.observe(4, 2, 2.0, 2.5)
    for _ in range(5):
        bulk.observe(1, 0, 0.0, 1.6)
    for _ in range(5):
        single.costs.observe(1, 0.0, 1.6)
        single.current.fade(1)
    bulk.choose(100)
    assert bulk.costs.target_s == pytest.approx(single.costs.target_s, rel=1e-12)
    assert bulk.current.reached == pytest.approx(single.current.reached, rel=1e-12)
    assert bulk.costs.target_s[1] > 1.3  # it did move toward the slower plain steps


def test_a_plain_run_is_reconsidered_every_recheck_steps():
    """Mid plain run the choice stands; once drafting starts paying, a drafting step comes within RECHECK steps."""
    policy = policy_with(linear(1.0, 0.5), linear(2.0, 0.0, first=2), rate=0.3)
    assert [policy.choose(100) for _ in range(3)] == [1, 1, 1]
    policy.costs = CostTable(linear(1.0, 0.0), linear(0.1, 0.0, first=2))  # verification became free
    waited = 0
    while policy.choose(100) == 1:
        waited += 1
        assert waited < RECHECK


def test_policy_is_cached_per_pair(tmp_path):
    calls = []

    def calibrate() -> CostTable:
        calls.append(1)
        return CostTable(linear(1.0, 0.1, 4), linear(0.2, 0.0, 4, 2))

    path = tmp_path / "costs" / "pair.json"
    first = load_policy(path, 4, calibrate)
    first.observe(3, 2, 0.2, 1.2)
    first.save()
    second = load_policy(path, 4, calibrate)
    assert len(calls) == 1
    assert second.history.accepted == first.history.accepted and second.history.accepted[1] > 0
    assert second.costs.target_s == first.costs.target_s
    path.write_text("{not json")
    load_policy(path, 4, calibrate)
    assert len(calls) == 2
    load_policy(path, 8, lambda: CostTable(linear(1.0, 0.1, 8), linear(0.2, 0.0, 8, 2)))
    assert json.loads(path.read_text())["block_size"] == 8


def test_measured_costs_cover_every_size_and_leave_models_reset():
    target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=256))
    drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=256))
    costs = measure_costs(target, drafter, repeats=1)
    assert sorted(costs.target_s) == list(range(1, 17)) and sorted(costs.draft_s) == list(range(2, 17))
    assert all(v > 0 for v in [*costs.target_s.values(), *costs.draft_s.values()])
    assert target.length == 0 and drafter.length == 0


@pytest.fixture(scope="module")
def target(llama_target) -> TorchLlamaTarget:
    return TorchLlamaTarget.load(llama_target, LoadSpec())


@pytest.mark.parametrize("error_rate", [0.15, 0.95])
def test_auto_block_is_lossless(target, error_rate):
    """Greedy ids equal autoregressive ones whatever k the policy picks, plain steps and probes included."""
    policy = policy_with(linear(1.0, 0.1), linear(0.3, 0.0, first=2), rate=0.8)
    sizes = set()
    for index, prompt in enumerate(PROMPTS):
        max_new = 20 + index * 3
        expected = _autoregressive(target, prompt, max_new)
        drafter = OracleDrafter(prompt + expected + [0] * 32, target.vocab_size, error_rate=error_rate, seed=index)
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=max_new), policy)
        assert ids == expected
        assert sum(stats.acceptance_lengths) + 1 == len(ids)
        assert all(1 <= n <= k for n, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True))
        sizes.update(stats.block_sizes)
    assert len(sizes) >= 3, sizes
    if error_rate > 0.5:
        assert 1 in sizes  # drafting lost: plain steps


def test_the_policys_time_is_counted_as_drafting(target):
    """The policy's choosing and learning (here 10 ms each, all plain steps) lies in each step's draft time, so the
    decode time and tokens/s that stats and bench report include it."""
    policy = policy_with(linear(1.0, 0.5), linear(2.0, 0.0, first=2), rate=0.3)
    choose, observe = policy.choose, policy.observe

    def slow_choose(limit):
        time.sleep(0.01)
        return choose(limit)

    def slow_observe(*args):
        time.sleep(0.01)
        observe(*args)

    policy.choose, policy.observe = slow_choose, slow_observe
    prompt = PROMPTS[0]
    drafter = OracleDrafter(prompt + [0] * 40, target.vocab_size, error_rate=1.0, seed=0)
    steps = list(generate(target, drafter, prompt, Settings(max_new_tokens=6, lookup=False), policy))
    assert [step.block_size for step in steps[1:]] == [1] * 5
    assert all(step.draft_s >= 0.02 for step in steps[1:]), steps


def test_plain_steps_between_drafts_keep_the_drafter_context():
    """The bundled pair with verify sizes scripted as 1, 1, 16, 4, 1, 16, ...: the drafter receives the features of
    the plain steps' positions too (no run of plain steps is under way), drafts as well as with full blocks, and ids
    stay AR's."""
    target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=512))
    drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512))
    prompt = json.loads((TINY / "heldout_prompts.jsonl").read_text().splitlines()[2])["prompt"]
    from dflash_local.tokenizer import TextTokenizer

    ids = TextTokenizer.load(TINY / "target").encode(prompt)
    expected, _ = run(target, None, ids, Settings(max_new_tokens=96, draft=False))
    policy = policy_with(linear(1.0, 0.0), linear(0.1, 0.0, first=2), rate=0.8)
    script = iter([1, 1, 16, 4, 1] * 100)
    policy.choose = lambda limit: min(next(script), limit)
    got, stats = run(target, drafter, ids, Settings(max_new_tokens=96, lookup=False), policy)
    assert got == expected
    full = [n for n, k in zip(stats.acceptance_lengths, stats.block_sizes, strict=True) if k == 16]
    assert sum(full) / len(full) > 2.5, full


@pytest.mark.parametrize("backend", ["torch", "gguf"])
def test_probes_after_plain_runs_stay_lossless(backend, request):
    """The bundled pair (torch; or its Q8_0 GGUF with llama.cpp's native drafter) with drafting scripted to lose but
    probed every 60 steps or so: every forward makes the drafter's features, probes draft with the whole context
    (they accept, and drafting resumes), and ids stay those of plain decoding."""
    if backend == "torch":
        target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=512))
        drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512))
    else:
        from dflash_local.drafters.native import NativeDrafter
        from dflash_local.targets.llamacpp import LlamaCppTarget

        target = LlamaCppTarget.load(
            request.getfixturevalue("tiny_gguf")["q8_0"], LoadSpec(RuntimeConfig(threads=1), max_context=512)
        )
        drafter = NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1)))
    prompt = json.loads((TINY / "heldout_prompts.jsonl").read_text().splitlines()[4])["prompt"]
    from dflash_local.tokenizer import TextTokenizer

    ids = TextTokenizer.load(TINY / "target").encode(prompt)
    expected, _ = run(target, None, ids, Settings(max_new_tokens=160, draft=False))
    forward, read = target.forward, []

    def spy_forward(*args, **kwargs):
        read.append(kwargs["features"])
        return forward(*args, **kwargs)

    target.forward = spy_forward
    policy = policy_with(linear(1.0, 0.1), linear(0.5, 0.0, first=2), rate=0.05)  # k = 2 at 0.66x, probes every 60
    policy.costs.observe = lambda *args, **kwargs: None  # the scripted costs stay
    got, _ = run(target, drafter, ids, Settings(max_new_tokens=160), policy)
    assert got == expected
    assert all(read), read


def test_an_abandoned_turn_leaves_no_stale_features():
    """The bundled pair: a turn leaves the session with pending features; the next turn starts in a plain run and is
    abandoned after its first token; a third turn drafts at once, and its drafter gets the target's own features of
    exactly the positions below each block, not the first turn's."""
    from dflash_local.session import Session
    from dflash_local.tokenizer import TextTokenizer

    target = TorchLlamaTarget.load(TINY / "target", LoadSpec(max_context=512))
    drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=512))
    prompt = json.loads((TINY / "heldout_prompts.jsonl").read_text().splitlines()[4])["prompt"]
    first = TextTokenizer.load(TINY / "target").encode(prompt)
    session = Session()
    answer, _ = run(target, drafter, first, Settings(max_new_tokens=24), session=session)
    assert drafter.held is not None  # the last step's features, which the drafter has not taken yet
    second = first + answer + first[:5]
    policy = policy_with(linear(1.0, 0.1), linear(0.5, 0.0, first=2), rate=0.05)  # k = 2 at 0.66x, probes every 60
    steps = generate(target, drafter, second, Settings(max_new_tokens=50), policy, session)
    third = second + next(steps).token_ids
    steps.close()
    propose, given = drafter.propose, []

    def spy_propose(model_target, new_features, tokens, start, size, rows=None):
        held = [part for part in (drafter.held, new_features) if part is not None]  # what it caches first
        given.append((start, torch.cat(held)))
        return propose(model_target, new_features, tokens, start, size, rows)

    drafter.propose = spy_propose
    got, _ = run(target, drafter, third, Settings(max_new_tokens=40), session=session)
    target.trim(0)
    whole = target.forward(torch.tensor(third + got), all_logits=False).features
    assert given
    for start, features in given:
        torch.testing.assert_close(features, whole[start - len(features) : start], atol=1e-4, rtol=1e-4)


def test_lookup_length_follows_the_match_and_what_its_length_has_shown():
    """Verify costs 1 + 0.5 per extra row and a drafter at 10%: a 32-token match with no history yet is verified in
    a longer block (prior 0.94), a 1-token one is not (prior 0.33, plain wins); after a 32-token match failed at its
    first draft many times, plain steps win for it too, while 16-token matches keep their prior."""
    from dflash_local.drafters.suffix_index import Match

    policy = policy_with(linear(1.0, 0.5), linear(0.05, 0.0, first=2), rate=0.1)
    long, short = Match(list(range(15)), 32, 3), Match(list(range(15)), 1, 40)
    source, k = policy.choose_step(100, long)
    assert source == "lookup" and 4 <= k < 16, (source, k)  # long, yet short of what costs more than it makes
    assert policy.choose_step(100, short) == ("plain", 1)
    assert policy.choose_step(100, Match([5, 6], 32, 1)) == ("lookup", 3)  # never past the match's tokens
    for _ in range(30):
        policy.observe_lookup(32, 16, 0, 0.0, policy.costs.target_s[16])
    assert policy.choose_step(100, long) == ("plain", 1)
    assert policy.choose_step(100, Match(list(range(15)), 16, 2))[0] == "lookup"


def test_without_a_drafter_only_lookup_and_plain_steps():
    """Free verification: a drafter's optimistic prior would draft; with no drafter, plain steps or lookup's."""
    from dflash_local.drafters.suffix_index import Match

    costs = CostTable(linear(1.0, 0.0), linear(0.0001, 0.0, first=2))
    policy = BlockPolicy(16, costs, AcceptanceEstimate.empty(15, 1.0), drafts=False)
    assert policy.choose_step(100, None) == ("plain", 1)
    assert policy.choose_step(100, Match(list(range(15)), 4, 1)) == ("lookup", 16)


def test_lookup_follows_what_its_verifies_cost_when_the_table_is_off():
    """The table says a verify of 5 costs 3 plain steps; lookup steps that accept everything but take 3x that (a
    calibration whose shape is off at real contexts) make plain steps win, and the table's costs stay."""
    from dflash_local.drafters.suffix_index import Match

    policy = policy_with(linear(1.0, 0.5), linear(0.05, 0.0, first=2), rate=0.1)
    long = Match(list(range(15)), 32, 3)
    assert policy.choose_step(100, long)[0] == "lookup"
    for _ in range(20):
        source, k = policy.choose_step(100, long)
        if source == "lookup":
            policy.observe_lookup(32, k, k - 1, 0.0, 3 * policy.costs.target_s[k])
    assert policy.choose_step(100, long) == ("plain", 1)
    assert policy.costs.target_s == linear(1.0, 0.5)
