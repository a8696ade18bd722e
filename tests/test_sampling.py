"""At temperature > 0, DFlash samples sequences with exactly the target's distribution."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_drafter, make_target

import dflash_local.sampling as sampling
from dflash_local.block_policy import AcceptanceEstimate, BlockPolicy, CostTable
from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.runtime import LoadSpec
from dflash_local.sampling import SamplingParams, probabilities
from dflash_local.targets.torch_llama import TorchLlamaTarget

VOCAB, NEW_TOKENS, SAMPLES = 5, 3, 3000
PROMPT = [1, 3, 0, 2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_vocab")
    target_dir = make_target(folder / "target", vocab_size=VOCAB, hidden_size=32, seed=5, std=0.5)
    drafter_dir = make_drafter(folder / "drafter", target_dir, num_layers=1, target_layer_ids=[1], seed=6, std=0.5)
    return TorchLlamaTarget.load(target_dir, LoadSpec()), DFlashDrafter.load(drafter_dir, LoadSpec())


def _exact_distribution(target, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..xn | prompt) for every sequence, from the target's own conditionals."""
    table = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        target.trim(0)
        logits = target.forward(torch.tensor(PROMPT + list(sequence[:-1])), features=False).logits
        probs = probabilities(logits[len(PROMPT) - 1 :], params)
        table[sequence] = float(torch.prod(probs[torch.arange(NEW_TOKENS), torch.tensor(sequence)]))
    return table


def _p_value(target, drafter, params: SamplingParams, policy: BlockPolicy | None = None) -> float:
    exact = _exact_distribution(target, params)
    counts = dict.fromkeys(exact, 0)
    settings = Settings(max_new_tokens=NEW_TOKENS, sampling=params)
    for seed in range(SAMPLES):
        ids, _ = run(target, drafter, PROMPT, replace(settings, seed=seed), policy)
        counts[tuple(ids)] += 1
    # Pool sequences whose expected count is small into one cell so the chi-square test is valid.
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    impossible = sum(counts[sequence] for sequence, probability in exact.items() if probability == 0)
    if impossible:
        return 0.0  # the sampler produced sequences that top-k / top-p rule out
    for sequence, probability in exact.items():
        if probability == 0:
            continue
        if probability * SAMPLES < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[sequence], pooled_exp + probability * SAMPLES
        else:
            observed.append(counts[sequence])
            expected.append(probability * SAMPLES)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert len(observed) >= 8, "too few outcomes for a meaningful test"
    total = sum(expected)
    return chisquare(observed, [e * SAMPLES / total for e in expected]).pvalue


@pytest.mark.parametrize(
    "params, auto",
    [(SamplingParams(temperature=1.0), False), (SamplingParams(temperature=1.5, top_k=3, top_p=0.95), True)],
)
def test_dflash_sampling_matches_target_distribution(pair, params, auto):
    """With auto, a block policy picks each step's verify size (costs where plain, short and full blocks compete)."""
    target, drafter = pair
    policy, used = None, []
    if auto:
        block = drafter.block_size
        steps = {k: 1.0 + 0.3 * (k - 1) for k in range(1, block + 1)}
        policy = BlockPolicy(
            block, CostTable(steps, dict.fromkeys(range(2, block + 1), 0.2)), AcceptanceEstimate.empty(block - 1, 0.999)
        )
        original = policy.choose
        policy.choose = lambda limit: used.append(original(limit)) or used[-1]
    assert _p_value(target, drafter, params, policy) > 1e-3
    if auto:
        assert 1 in used and len(set(used)) >= 2, set(used)  # plain steps and drafting steps both sampled


def test_biased_sampler_is_detected(pair, monkeypatch):
    """A sampler that keeps every draft (no rejection) must fail the same test."""
    target, drafter = pair

    def accept_everything(draft, draft_probs, target_probs, generator):
        return draft.shape[0], int(torch.multinomial(target_probs[-1], 1, generator=generator))

    monkeypatch.setattr(sampling, "accept_sampled", accept_everything)
    assert _p_value(target, drafter, SamplingParams(temperature=1.0)) < 1e-6


def test_seed_makes_sampling_reproducible(pair):
    target, drafter = pair
    settings = Settings(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=42)
    assert run(target, drafter, PROMPT, settings)[0] == run(target, drafter, PROMPT, settings)[0]


def test_draw_takes_each_row_s_distribution_and_never_an_id_without_mass(monkeypatch):
    """Rows need not sum to 1; ids without mass are never drawn, even where the uniform draw lands on the row's total;
    a NaN is one sentence."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 0.4, 0.0, 1.0, 0.6, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0, 0.0]])
    drawn = torch.stack([sampling.draw(probs, generator) for _ in range(4000)])
    assert set(drawn[:, 1].tolist()) == {0}
    counts = torch.bincount(drawn[:, 0], minlength=6).tolist()
    assert counts[0] == counts[2] == counts[5] == 0
    assert chisquare(counts[1:5:2] + counts[4:5], [800, 2000, 1200]).pvalue > 1e-3
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=kwargs["dtype"]))
    assert sampling.draw(probs, generator).tolist() == [4, 0]  # the last id with mass, not one past the end
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.zeros(shape, dtype=kwargs["dtype"]))
    assert sampling.draw(probs, generator).tolist() == [1, 0]  # the first id with mass, not the massless id 0
    monkeypatch.undo()
    with pytest.raises(DFlashError, match="NaN or infinite"):
        sampling.draw(torch.tensor([[0.5, float("nan")]]), generator)


def test_a_point_mass_draft_is_rejection_sampled_exactly():
    """A drafter that names one token (DFlash2's walked picks: logit 0 there, -inf elsewhere) at T > 0: the first
    token follows the target's row and, after an accepted draft, the bonus follows the next row."""
    params = SamplingParams(temperature=1.0)
    sampler = sampling.RandomSampler(params, torch.Generator().manual_seed(0))
    rows = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.5, 0.05, 0.05, 0.1, 0.3]])
    point = torch.full((1, 5), float("-inf"))
    point[0, 1] = 0.0
    firsts, bonuses = [], []
    for _ in range(6000):
        draft, draft_probs = sampler.draft(point)
        accepted, tokens = sampler.accept(draft, draft_probs, rows.log())
        assert draft.tolist() == [1] and tokens[:accepted] == [1] * accepted
        firsts.append(tokens[0])
        bonuses += tokens[1:]
    for drawn, row in ((firsts, rows[0]), (bonuses, rows[1])):
        counts = torch.bincount(torch.tensor(drawn), minlength=5)
        expected = (len(drawn) * row.double() / row.double().sum()).tolist()
        assert chisquare(counts.tolist(), expected).pvalue > 1e-3, counts.tolist()
