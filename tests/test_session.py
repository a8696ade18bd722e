"""Prefix reuse: the session's caches give the same answers as fresh ones, prefilling only what is new; the
incremental detokenizer gives the text of decoding everything at once."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dflash_local.chat import Chat
from dflash_local.decode import Settings, generate, run
from dflash_local.drafters.base import DraftContext
from dflash_local.generation import GenerationRequest, LoadedModels, load_models, run_request
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams
from dflash_local.session import Session
from dflash_local.tokenizer import Detokenizer

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
CPU = LoadSpec(RuntimeConfig(device="cpu"), max_context=512)
NEW_TOKENS = 24


class Stop(Exception):
    """What a consumer raises to abandon a generation (e.g. a server whose client went away)."""


@pytest.fixture(scope="module")
def tiny() -> LoadedModels:
    return load_models(TINY / "target", TINY / "drafter", CPU, auto_block=False)


def request_of(models: LoadedModels, prompt: list[int], new_tokens: int = NEW_TOKENS, draft: bool = True, **sampling):
    """A request as the front-ends make it: stopping at the models' end-of-sequence ids."""
    seed = sampling.pop("seed", None)
    settings = Settings(new_tokens, SamplingParams(**sampling), draft=draft, stop_ids=models.stop_ids, seed=seed)
    return GenerationRequest(prompt, settings)


def first_prompt(models: LoadedModels) -> list[int]:
    line = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[0]
    return models.tokenizer.encode(json.loads(line)["prompt"])[-40:]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def record_drafts(models: LoadedModels, monkeypatch) -> list:
    """The list every later draft of the pair's drafter (its logits, copied) is appended to."""
    drafts, propose = [], models.drafter.propose

    def spy(*args, **kwargs):
        logits = propose(*args, **kwargs)
        drafts.append(logits.float().clone())
        return logits

    monkeypatch.setattr(models.drafter, "propose", spy)
    return drafts


def converse(models: LoadedModels, monkeypatch, reuse: bool, **sampling) -> list[tuple]:
    """A scripted conversation: prompts extending the last prompt and answer (one replacing the answer's last two
    ids), one editing the middle, drafting off and on again, a shorter one. With reuse, two generations are
    abandoned midway on the way, and each turn prefills only what the caches lack; without, the session is emptied
    before every turn. Returns each turn's answer, acceptance lengths and drafts (the drafter saw the same context)."""
    encode, turns, cached, calls = models.tokenizer.encode, [], [], []
    drafts = record_drafts(models, monkeypatch)

    def ask(prompt: list[int], draft: bool = True) -> list[int]:
        nonlocal cached
        drafted = len(drafts)
        if not reuse:
            models.session.invalidate()
            cached = []
        request = request_of(models, prompt, draft=draft, **sampling)
        result = run_request(models, request)
        assert result["prefill_tokens"] == len(prompt) - min(common_prefix(prompt, cached), len(prompt) - 1)
        turns.append(
            (result["output_ids"], result["acceptance_lengths"], torch.cat(drafts[drafted:] or [torch.empty(0)]))
        )
        cached = prompt + result["output_ids"][:-1]  # the answer's last id is never fed to the target
        return result["output_ids"]

    def stop_on_second_text(text: str) -> None:
        calls.append(text)
        if len(calls) == 2:
            raise Stop

    models.session.invalidate()
    p1 = first_prompt(models)
    p2 = p1 + ask(p1) + encode(" Tell me more about it.")
    if reuse:
        with pytest.raises(Stop):
            run_request(models, request_of(models, p2), stop_on_second_text)
        cached = p2
    then = encode(" And then?")
    p3 = p2 + ask(p2) + then
    p4 = p3 + ask(p3)[:-2] + then  # the cut falls among positions the drafter has not cached yet
    answer = ask(p4)
    if reuse:  # a generator closed after two steps
        steps = generate(models.target, models.drafter, p4 + answer, Settings(NEW_TOKENS), session=models.session)
        next(steps), next(steps)
        steps.close()
        cached = p4 + answer
    middle = len(p1) // 2
    edited = p4[:middle] + [(p4[middle] + 1) % models.target.vocab_size] + p4[middle + 1 :] + answer
    ask(edited)
    cached = []  # drafting off, then on again: nothing is reused
    ask(edited, draft=False)
    cached = []
    ask(p3)
    ask(p1[:middle])
    monkeypatch.undo()
    return turns


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}], ids=["greedy", "seeded"])
def test_reuse_answers_as_fresh_caches_do_on_the_bundled_pair(tiny, monkeypatch, sampling):
    same_turns(converse(tiny, monkeypatch, True, **sampling), converse(tiny, monkeypatch, False, **sampling))


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_reuse_answers_as_fresh_caches_do_on_a_gguf_target(tiny_gguf, monkeypatch, kind):
    pytest.importorskip("llama_cpp")
    spec = LoadSpec(RuntimeConfig(device="cpu", drafter=kind), max_context=512)
    models = load_models(tiny_gguf["f16"], TINY / "drafter", spec, auto_block=False)
    assert type(models.drafter).__name__ == {"torch": "DFlashDrafter", "native": "NativeDrafter"}[kind]
    same_turns(converse(models, monkeypatch, True), converse(models, monkeypatch, False))


def test_caches_used_without_the_session_are_not_reused(tiny):
    """A generation through the same models but another session (or none) leaves nothing this session may trust."""
    p1 = first_prompt(tiny)
    first = run_request(tiny, request_of(tiny, p1))["output_ids"]
    run(tiny.target, tiny.drafter, p1[::-1] + first, Settings(NEW_TOKENS))  # same length, other ids
    again = run_request(tiny, request_of(tiny, p1 + first))
    assert again["prefill_tokens"] == len(p1 + first)
    tiny.session.invalidate()
    assert again["output_ids"] == run_request(tiny, request_of(tiny, p1 + first, 128))["output_ids"][:NEW_TOKENS]


def test_a_second_chat_turn_prefills_only_the_new_tokens(tiny):
    settings = Settings(max_new_tokens=NEW_TOKENS, stop_ids=tiny.stop_ids)
    chat = Chat(tiny, settings, Console(file=io.StringIO()), Console(file=io.StringIO()))
    fresh = load_models(TINY / "target", TINY / "drafter", CPU, auto_block=False)
    first_ids = chat.encode([{"role": "user", "content": "Write a function that adds two numbers."}])
    chat.answer("Write a function that adds two numbers.")
    assert chat.state.last.prefill_tokens == len(first_ids)
    first_answer, _ = run(fresh.target, fresh.drafter, first_ids, settings)
    second_ids = chat.encode([*chat.state.messages, {"role": "user", "content": "Now subtract them."}])
    chat.answer("Now subtract them.")
    cached = first_ids + first_answer[:-1]  # the answer's last token was never fed to the target
    kept = common_prefix(second_ids, cached)
    assert kept > len(first_ids) and chat.state.last.prefill_tokens == len(second_ids) - kept
    second_answer, _ = run(fresh.target, fresh.drafter, second_ids, settings)
    shown = fresh.tokenizer.decode([t for t in second_answer if t not in tiny.stop_ids])
    assert chat.state.messages[-1]["content"] == shown


MULTIBYTE = "naïve café — 日本語のテキストです 🙂🚀 ünïcödé · Ωμέγα "


def tokenizers(tiny_gguf) -> list:
    from dflash_local.gguf.tokenizer import GGUFTokenizer
    from dflash_local.tokenizer import TextTokenizer

    return [TextTokenizer.load(TINY / "target"), GGUFTokenizer.load(tiny_gguf["f16"])]


def test_the_incremental_detokenizer_equals_decoding_the_whole_answer(tiny_gguf):
    text = "".join(f"{MULTIBYTE}line {n} of a long answer\n" for n in range(60))
    for tokenizer in tokenizers(tiny_gguf):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert sum(tokenizer.decode([i]).endswith("\ufffd") for i in ids) > 100  # characters split across ids
        detokenizer, deltas, widest, at = Detokenizer(tokenizer), [], 0, 0
        for size in [1, 2, 3, 1, 5] * len(ids):
            if at >= len(ids):
                break
            deltas.append(detokenizer.add(ids[at : at + size]))
            at += size
            widest = max(widest, len(detokenizer.window))
        assert "".join(deltas) == tokenizer.decode(ids) and text in tokenizer.decode(ids)
        assert widest <= Detokenizer.CONTEXT + Detokenizer.HOLD + 5  # constant work per step


def same_turns(got: list[tuple], expected: list[tuple]) -> None:
    """Equal answers and acceptance lengths; draft logits equal up to float noise (the caches' K/V and features were
    computed in other batches), which moves a value by a 7-bit step where the head is int8 rows (a torch drafter on
    a CPU GGUF target: fbgemm rounds the hidden state to 7 bits per call)."""
    assert [turn[:2] for turn in got] == [turn[:2] for turn in expected]
    for (_, _, logits), (_, _, reference) in zip(got, expected, strict=True):
        torch.testing.assert_close(logits, reference, atol=0.05, rtol=2**-7)


class Cache:
    """What a session needs of a target: a length it trims anywhere (trim_floor 0), and its cache owner."""

    def __init__(self) -> None:
        self.length = 0
        self.trim_floor = 0
        self.cache_owner: object | None = None

    def trim(self, length: int) -> None:
        self.length = length


class Context(DraftContext):
    """A drafter's context bookkeeping (drafters.base) with no cache behind it, and its cache owner."""

    def __init__(self) -> None:
        super().__init__()
        self.cache_owner: object | None = None

    def _save_cache(self) -> None:
        return None

    def _load_cache(self, state: None) -> None:
        pass


def test_a_resume_keeps_the_pending_features_below_the_kept_prefix():
    """Pending features cover the drafter's length to the cached length: a resume keeps those of positions below
    the kept prefix, and the drafter's length where it is below that."""
    target, drafter, session = Cache(), Context(), Session()
    tokens = list(range(100, 151))
    session.resume(target, drafter, tokens[:2], (1,))  # the session owns both caches from here
    features = torch.arange(40.0, 50.0)[:, None]  # positions 40..49
    for kept, want, drafted in ((45, [40.0, 41.0, 42.0, 43.0, 44.0], 40), (38, [], 38)):
        drafter.trim(0)
        target.length, drafter.length = 50, 40
        drafter.extend(features)
        session.record(tokens, 50)
        assert session.resume(target, drafter, tokens[:kept] + [7], (1,)) == kept
        held = [] if drafter.held is None else drafter.held.flatten().tolist()
        assert held == want
        assert drafter.length == drafted and target.length == kept


def test_a_session_trusts_only_caches_it_filled_last():
    """Once another session has used the target, or the drafter alone, this session reuses nothing, even where the
    target's cache is as long as it left it."""
    tokens = list(range(100, 120))
    target, drafter, other = Cache(), Cache(), Cache()
    ours, theirs = Session(), Session()
    for shared in ((target, None), (other, drafter)):
        ours.resume(target, drafter, tokens[:2], (1,))
        target.length = drafter.length = 10
        ours.record(tokens, 10)
        assert ours.common_prefix(target, drafter, tokens, (1,)) == 10
        theirs.resume(*shared, tokens[:2], (1,))
        target.length = 10  # the other session filled as many positions
        assert ours.common_prefix(target, drafter, tokens, (1,)) == 0
