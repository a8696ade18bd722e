"""At T > 0 over HTTP, the bundled pair's answers follow the target's distribution and a seed picks the answer.

`/v1/completions` on an in-process server (the real app and protocol) continues a fixed prompt by LENGTH tokens at
temperature TEMPERATURE, top-k TOP_K, one request per sample, each with its own seed. The exact distribution of
the continuations comes from logits dflash did not compute (the reference implementation's, through the oracle),
truncated by tests/sampled_reference.py; answers are compared as texts, the exact distribution carried over to the
texts the continuations decode to. The sample count is the fewest at which the chi-square test (alpha = 1e-3) finds,
with 99% power, a server whose answers are all alike (the temperature or the seed ignored, one random state for
every request): its effect is w^2 = (1 - p) / p for the text it repeats. A server that ignored top-k draws texts
outside the support (p-value 0). How the sampler itself follows the target is tests/test_sampled_lossless.py's.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from pathlib import Path

import pytest
from reference import reference_next_logits
from sampled_reference import continuations, p_value, samples_for_power
from test_server_hostile import AUTH, serving

from dflash_local.generation import load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.engine import Engine
from dflash_local.tokenizer import TextTokenizer

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
PROMPT_TEXT, LENGTH, TEMPERATURE, TOP_K = "def fibonacci(n):", 3, 1.0, 3
UNSEEDED = 20


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return TextTokenizer.load(TINY / "target").encode(PROMPT_TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def exact(prompt) -> dict[tuple[str], float]:
    """The probability of each answer text (as a 1-tuple): the exact continuation distribution, carried over to the
    texts the continuations decode to."""
    tokenizer = TextTokenizer.load(TINY / "target")
    rows = continuations(
        lambda prefixes: reference_next_logits(TINY / "target", prefixes), prompt, LENGTH, TEMPERATURE, TOP_K
    )
    by_text: dict[tuple[str], float] = Counter()
    for sequence, probability in rows.items():
        by_text[(tokenizer.decode(list(sequence)),)] += probability
    return dict(by_text)


@pytest.fixture(scope="module")
def answers(prompt, exact) -> dict[str, list[str]]:
    """Seeded answers (as many as the power calculation asks), the first seeds asked again, and unseeded answers."""
    alike = min((1 - p) / p for p in exact.values())  # the effect of a server that repeats one text
    samples = samples_for_power(alike, exact)
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)
    with serving(Engine(models, None, None, size=8)) as address:
        connection = http.client.HTTPConnection(*address, timeout=60)

        def complete(seed: int | None) -> dict:
            body = {"prompt": prompt, "max_tokens": LENGTH, "temperature": TEMPERATURE, "top_k": TOP_K}
            body |= {"ignore_eos": True} | ({"seed": seed} if seed is not None else {})
            connection.request("POST", "/v1/completions", json.dumps(body), AUTH)
            reply = connection.getresponse()
            assert reply.status == 200
            return json.loads(reply.read())

        seeded = [complete(seed) for seed in range(samples)]
        again = [complete(seed) for seed in range(8)]
        unseeded = [complete(None) for _ in range(UNSEEDED)]
        connection.close()
    blocks = [reply["usage"]["dflash"]["acceptance_lengths"] for reply in seeded]
    assert any(blocks)  # the answers went through drafted, verified blocks
    return {"seeded": texts(seeded), "again": texts(again), "unseeded": texts(unseeded)}


def texts(replies: list[dict]) -> list[str]:
    return [reply["choices"][0]["text"] for reply in replies]


def test_sampled_answers_follow_the_targets_distribution(exact, answers):
    counts = Counter((text,) for text in answers["seeded"])
    assert p_value(exact, counts) > 1e-3, (counts, exact)


def test_a_seed_picks_the_answer(exact, answers):
    assert answers["again"] == answers["seeded"][: len(answers["again"])]  # the same seed, the same answer
    assert max(exact.values()) ** (UNSEEDED - 1) < 1e-6  # all alike by chance: under one in a million
    assert len(set(answers["unseeded"])) > 1  # no seed: a fresh random state for each request
