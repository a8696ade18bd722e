"""serve's prompt cache across conversations (dflash_local/prompt_cache.py, Session's swap): conversation A, then B,
then A with one more turn reuses A's caches and answers as fresh caches do (the bundled torch pair, a GGUF target with
llama.cpp's native drafter, a hybrid qwen35 target through its checkpoints with lookup's and its MTP layer's drafts);
the store's budget and matching; every API's usage reports the cached tokens in its own shape; Claude Code's billing
header is dropped."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_architectures import build_tiny
from test_mtp import loaded
from test_serve_clients import KEY, TINY, serving
from test_serve_messages import TEMPLATE
from test_session import common_prefix, first_prompt, record_drafts, request_of, same_turns

from dflash_local.chat_template import read_template, use_template
from dflash_local.decode import Settings, run
from dflash_local.drafters.base import Drafter
from dflash_local.generation import LoadedModels, load_models, run_request
from dflash_local.prompt_cache import MIN_GAIN, PromptCache, Saved
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.anthropic_api import parse_request
from dflash_local.server.engine import Engine
from dflash_local.session import Session
from dflash_local.targets.base import Target

CPU = LoadSpec(RuntimeConfig(device="cpu"), max_context=512)
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"


def saved(tokens: list[int], size: int, floor: int = 0) -> Saved:
    return Saved(("pair",), tokens, bytearray(size), None, None, floor)


def test_the_store_matches_the_longest_prefix_and_drops_the_least_recently_used():
    cache = PromptCache(budget=300)
    a, b = saved(list(range(40)), 100), saved([7] * 40, 100)
    cache.add(a)
    cache.add(b)
    assert cache.best(("pair",), list(range(30)) + [99]) == (a, 30)
    assert cache.best(("pair",), list(range(40))) == (a, 39)  # the prompt's last id is always forwarded
    assert cache.best(("other",), list(range(30))) == (None, 0)
    cache.add(cache.take(a))  # used: now the most recent
    cache.add(saved([5] * 40, 150))  # over budget: b, the least recently used, goes
    assert [entry.tokens[0] for entry in cache.entries] == [0, 5]
    assert cache.describe() == {"entries": 2, "bytes": 250, "budget_bytes": 300}
    cache.add(saved(list(range(50)), 100))  # covers a: a goes
    assert [len(entry.tokens) for entry in cache.entries] == [40, 50]
    hybrid = saved(list(range(20)), 10, floor=20)
    cache.add(hybrid)
    assert cache.best(("pair",), list(range(19)) + [0, 1]) == (cache.entries[-2], 19)  # not all of it: not usable
    assert cache.best(("pair",), list(range(20)) + [0]) == (cache.entries[-2], 20)
    cache.add(saved([1], 1000))  # alone over the budget: not kept
    assert all(len(entry.tokens) > 1 for entry in cache.entries)


def test_an_entry_of_a_window_sized_cache_serves_prompts_that_keep_its_floor():
    """A window-sized cache's entry serves a prompt sharing at least its floor (the window's reused cells), and a
    later entry of the same ids with a higher floor does not push out one with a lower floor."""
    cache = PromptCache(budget=1000)
    early = saved(list(range(30)), 10, floor=12)
    cache.add(early)
    assert cache.best(("pair",), list(range(15)) + [99]) == (early, 15)
    assert cache.best(("pair",), list(range(12)) + [99]) == (early, 12)
    assert cache.best(("pair",), list(range(11)) + [99]) == (None, 0)
    later = saved(list(range(40)), 10, floor=25)
    cache.add(later)
    assert cache.entries == [early, later]
    assert cache.best(("pair",), list(range(20)) + [99]) == (early, 20)
    assert cache.best(("pair",), list(range(35)) + [99]) == (later, 35)
    cache.add(saved(list(range(50)), 10, floor=12))  # serves all they serve, as far: both go
    assert [len(entry.tokens) for entry in cache.entries] == [50]


def conversations(models: LoadedModels, monkeypatch, cache: PromptCache | None) -> list[tuple]:
    """A, then B, then A with one more turn, then B with one more: with a prompt cache each continuation prefills
    only what A's (B's) caches lack; without, every request starts from empty caches. Each turn's answer,
    acceptance lengths and drafts (drafts show whether the drafter's caches followed the swaps)."""
    encode, turns = models.tokenizer.encode, []
    drafts = record_drafts(models, monkeypatch)
    models.session = Session(cache)

    def ask(prompt: list[int], cached: int) -> list[int]:
        drafted = len(drafts)
        if cache is None:
            models.session.invalidate()
        result = run_request(models, request_of(models, prompt))
        assert len(prompt) - result["prefill_tokens"] == (cached if cache is not None else 0)
        turns.append((result["output_ids"], result["acceptance_lengths"], torch.cat(drafts[drafted:])))
        return result["output_ids"]

    a1 = first_prompt(models)
    b1 = encode("A different conversation, about the weather in the mountains this week and the next.")
    assert len(a1) >= MIN_GAIN and common_prefix(a1, b1) < MIN_GAIN
    a_out = ask(a1, 0)
    b_out = ask(b1, common_prefix(b1, a1))
    a2 = a1 + a_out + encode(" Tell me more.")
    ask(a2, len(a1) + len(a_out) - 1)  # the answer's last id was never fed
    b2 = b1 + b_out + encode(" And then?")
    ask(b2, len(b1) + len(b_out) - 1)
    monkeypatch.undo()
    return turns


@pytest.fixture(scope="module")
def tiny() -> LoadedModels:
    return load_models(TINY / "target", TINY / "drafter", CPU, auto_block=False)


def test_a_b_then_a_again_reuses_as_answers_from_fresh_caches_on_the_bundled_pair(tiny, monkeypatch):
    cached = conversations(tiny, monkeypatch, PromptCache(2**30))
    same_turns(cached, conversations(tiny, monkeypatch, None))


def test_a_b_then_a_again_reuses_as_answers_from_fresh_caches_on_a_gguf_target(tiny_gguf, monkeypatch):
    pytest.importorskip("llama_cpp")
    spec = replace(CPU, runtime=RuntimeConfig(device="cpu", drafter="native"))
    models = load_models(tiny_gguf["f16"], TINY / "drafter", spec, auto_block=False)
    assert type(models.drafter).__name__ == "NativeDrafter"
    same_turns(conversations(models, monkeypatch, PromptCache(2**30)), conversations(models, monkeypatch, None))


def hybrid_turns(target: Target, drafter: Drafter | None, cache: PromptCache | None, monkeypatch) -> tuple[list, list]:
    """A, B, A' continuing A's prompt but not its answer, B' continuing B's whole sequence: each turn's answer,
    acceptance lengths and drafts, and how many prompt tokens came from the caches (without a cache, each starts
    from empty caches)."""
    a1, b1, turns, counts, drafts = list(range(40, 80)), list(range(300, 330)), [], [], []
    if drafter is not None:
        propose = drafter.propose
        monkeypatch.setattr(drafter, "propose", lambda *args, **kw: drafts.append(propose(*args, **kw)) or drafts[-1])
    session = Session(cache)
    for extend in (lambda: a1, lambda: b1, lambda: a1 + [7, 8, 9] + turns[0][0], lambda: b1 + turns[1][0] + [11]):
        prompt, drafted = extend(), len(drafts)
        session = session if cache is not None else Session()
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=20, block_size=4), session=session)
        turns.append((ids, stats.acceptance_lengths, torch.cat(drafts[drafted:] or [torch.empty(0)]).float()))
        counts.append(len(prompt) - stats.prefill_tokens)
    monkeypatch.undo()
    return turns, counts


@pytest.mark.parametrize("drafting", ["lookup", "mtp"])
def test_a_hybrid_target_reuses_its_exact_checkpoints(mtp_model, drafting, monkeypatch):
    """qwen35 (recurrent layers; lookup's drafts, or its MTP layer's): A' is served by A's checkpoint at the end of
    its prompt, B' by B's whole sequence (saved when A' replaced it); answers, acceptance lengths and drafts are
    those of fresh caches."""
    target, drafter = loaded(mtp_model)
    drafter = drafter if drafting == "mtp" else None
    assert target.recurrent
    cached, counts = hybrid_turns(target, drafter, PromptCache(2**30), monkeypatch)
    fresh, _ = hybrid_turns(target, drafter, None, monkeypatch)
    assert [turn[:2] for turn in cached] == [turn[:2] for turn in fresh]
    assert all(torch.equal(got[2], want[2]) for got, want in zip(cached, fresh, strict=True))  # same batches: bitwise
    assert counts == [0, 0, 40, 30 + len(cached[1][0]) - 1]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> Path:
    pytest.importorskip("llama_cpp")
    return build_tiny(tmp_path_factory.mktemp("hybrid"), "qwen35-mtp") / "qwen35-mtp"


def test_the_billing_header_is_dropped_from_the_system_text():
    body = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": BILLING.format("a3f")}, {"type": "text", "text": "You are brief."}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert parse_request(body).messages[0] == {"role": "system", "content": "You are brief."}


def post(url: str, path: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


@pytest.fixture(scope="module")
def served(tiny):
    """The tiny pair served with a prompt cache, and beside it (same models, another session) without one: a request
    to the second takes the caches from the first session, which then starts afresh."""
    config = tiny.tokenizer.config
    tiny.tokenizer.config = use_template(config, read_template(str(TEMPLATE)), TINY / "target")
    cached = replace(tiny, session=Session(PromptCache(2**30)))
    plain = replace(tiny, session=Session())
    with serving(Engine(cached, 4, None, size=4)) as url, serving(Engine(plain, 4, None, size=4)) as fresh:
        yield url, fresh
    tiny.tokenizer.config = config


def chat(url: str, messages: list[dict]) -> dict:
    return post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0})


def test_each_api_reports_the_cached_tokens_in_its_shape(served):
    url, fresh = served
    a = [{"role": "user", "content": "def fibonacci(n): return the n-th Fibonacci number, computed in a loop."}]
    b = [{"role": "user", "content": "Write a haiku about the sea, the wind, and the long grey evening light."}]
    first = chat(url, a)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chat(url, b)
    a2 = a + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    a2 += [{"role": "user", "content": "Now explain it."}]
    again = chat(url, a2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    completion = post(url, "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0})
    assert "cached_tokens" in completion["usage"]["prompt_tokens_details"]
    response = post(url, "/v1/responses", {"input": a2, "max_output_tokens": 16, "temperature": 0})
    assert response["usage"]["input_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    health = json.load(urllib.request.urlopen(url + "/health", timeout=10))
    assert health["prompt_cache"]["entries"] >= 1 and 0 < health["prompt_cache"]["bytes"] <= 2**30
    assert again["choices"] == chat(fresh, a2)["choices"]  # last: the sessions share the models' caches


def test_claude_codes_requests_reuse_the_prompt_despite_the_billing_header(served):
    """Two requests differing only in the billing header's per-request hex: the second prefills one token (the
    prompt's last) and reports the rest as cache_read_input_tokens, input_tokens being those prefilled."""
    url, _ = served
    usages = []
    for tag in ("a3f", "0c7"):
        system = [{"type": "text", "text": BILLING.format(tag)}, {"type": "text", "text": "You are a coding agent."}]
        messages = [{"role": "user", "content": "List the files in this folder and say which is largest."}]
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "system": system, "messages": messages}
        usages.append(post(url, "/v1/messages", body)["usage"])
    total = usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]
    assert usages[1]["cache_read_input_tokens"] == total - 1 and usages[1]["input_tokens"] == 1
    assert usages[1]["cache_creation_input_tokens"] == 0
