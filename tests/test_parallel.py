"""Several sequences decoded together (serve --parallel N, dflash_local/lanes.py).

A sequence's verify rows in one llama_decode beside other sequences' rows give the bits they give alone (a context of
one sequence); two requests sent at once are decoded together and each answers what llama.cpp's own greedy run
gives; at T > 0, with two sequences always in flight, the answers follow the target's distribution (chi-square
against llama.cpp's own logits, enumerated); beyond N the queue holds --max-queue; each response's usage is its own;
a request goes to the idle worker whose caches hold the longest prefix of its prompt.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from in_process import invoke
from sampled_reference import continuations, p_value, samples_for_power
from test_gguf_lossless import llamacpp_greedy
from test_sampled_lossless import EFFECT_FLOOR, FIXED_BLOCK, NEW_TOKENS, PROMPT, folders, llamacpp_next_logits
from test_server_hostile import AUTH, serving

from dflash_local.atomic import write_text_atomic
from dflash_local.decode import Settings, generate
from dflash_local.drafters.native import NativeDrafter
from dflash_local.generation import LoadedModels, load_models, share
from dflash_local.lanes import Lanes
from dflash_local.prompt_cache import MIN_GAIN, PromptCache, Saved
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams
from dflash_local.server.engine import Engine, Worker, choose
from dflash_local.session import Session
from dflash_local.targets.llamacpp import VERIFY_ROWS, LlamaCppTarget

__all__ = ["folders"]  # test_sampled_lossless's fixture, used here

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
NEW = 24  # tokens a served answer makes (the first of two sent at once: LONG, so that it is still under way when
LONG = 160  # the second's request has arrived, however slowly the machine runs it)


def together(lanes: Lanes, work: list) -> list:
    """Run work[seq] on its own thread as sequence seq's generation, every sequence generating from before the first
    starts (so that each forward waits for the others' while they run: one shared decode per step)."""
    with lanes.turn:
        lanes.generating.update(range(len(work)))

    def run(seq: int):
        try:
            return work[seq]()
        finally:
            with lanes.turn:
                lanes.generating.discard(seq)
                lanes.turn.notify_all()

    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(run, range(len(work))))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_rows_beside_other_sequences_rows_give_the_bits_they_give_alone(kind, tiny_gguf, heldout, drafter):
    """Three sequences (48, 600 and 48 cached tokens: the long one makes every sequence's attention span more cells)
    verify blocks of 16, 1 and 5 rows in one llama_decode, then, rolled back, 1, 7 and 1: each sequence's logits and
    features equal, bit for bit, those a context holding that sequence alone computes."""
    path, layers = tiny_gguf[kind], drafter.target_layer_ids
    spec = LoadSpec(RuntimeConfig(threads=1), max_context=1024)
    alone, shared = LlamaCppTarget.load(path, spec), LlamaCppTarget.load(path, replace(spec, sequences=3))
    alone.set_feature_layers(layers)
    long = [token for prompt in heldout * 2 for token in prompt][:600]
    prefixes = [heldout[0], long, heldout[2]]
    rounds = [([16, 1, 5], None), ([1, 7, 1], 3)]  # (block sizes, positions kept of the last block, at most all)
    generator = torch.Generator().manual_seed(0)
    lanes = Lanes(shared.context, VERIFY_ROWS)
    views = [shared.sequence(seq, lanes) for seq in range(3)]
    for view, prefix in zip(views, prefixes, strict=True):
        view.set_feature_layers(layers)
        view.forward(torch.tensor(prefix), all_logits=False)
    vocab = alone.vocab_size
    blocks = [torch.randint(0, vocab, (sum(sizes),), generator=generator).split(sizes) for sizes, _ in rounds]
    expected = [[] for _ in views]
    for seq, prefix in enumerate(prefixes):
        alone.trim(0)
        alone.forward(torch.tensor(prefix), all_logits=False)
        for step, (_, kept) in enumerate(rounds):
            if kept is not None:
                alone.trim(alone.length - len(blocks[step - 1][seq]) + min(kept, len(blocks[step - 1][seq])))
            expected[seq].append(alone.forward(blocks[step][seq]))
    for step, (_, kept) in enumerate(rounds):
        if kept is not None:
            for seq, view in enumerate(views):
                view.trim(view.length - len(blocks[step - 1][seq]) + min(kept, len(blocks[step - 1][seq])))
        outs = together(lanes, [partial(view.forward, block) for view, block in zip(views, blocks[step], strict=True)])
        assert lanes.shared == step + 1
        for seq, out in enumerate(outs):
            want = expected[seq][step]
            assert torch.equal(out.logits, want.logits), (kind, step, seq)
            assert torch.equal(out.features, want.features), (kind, step, seq)


@pytest.fixture(scope="module")
def served(tiny_gguf) -> LoadedModels:
    """The bundled pair as serve --parallel 2 loads it: the Q8_0 GGUF target, llama.cpp's native drafter."""
    spec = LoadSpec(RuntimeConfig(device="cpu", threads=1), max_context=512, sequences=2)
    models = load_models(tiny_gguf["q8_0"], TINY / "drafter", spec, auto_block=False)
    assert isinstance(models.drafter, NativeDrafter)
    return models


def stream(address, prompt: list[int], log: list, name: str, lock: threading.Lock, **body) -> dict:
    """A streamed /v1/completions answer at T = 0: its text and usage; each chunk's arrival goes into log as (name,
    "text" or "end")."""
    connection = http.client.HTTPConnection(*address, timeout=120)
    request = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}
    request |= {"stream_options": {"include_usage": True}} | body
    connection.request("POST", "/v1/completions", json.dumps(request), AUTH)
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()
    text, usage = "", None
    for line in reply:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            break
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            text += choice.get("text") or ""
            with lock:
                log.append((name, "text"))
    with lock:
        log.append((name, "end"))
    connection.close()
    return {"text": text, "usage": usage}


@pytest.fixture(scope="module")
def address(tiny_gguf) -> Iterator[tuple[str, int]]:
    """`dflash serve` of the bundled pair as a Q8_0 GGUF with llama.cpp's native drafter, --parallel 2, block 4, as
    a live process on a loopback port: its host and port once /health answers."""
    args = [sys.executable, "-m", "dflash_local", "serve", tiny_gguf["q8_0"], "--drafter", TINY / "drafter"]
    args += ["--parallel", "2", "--block-size", "4", "--threads", "1", "--max-context", "512", "--port", "0"]
    args += ["--api-key", AUTH["Authorization"].split()[1]]
    process = subprocess.Popen([str(arg) for arg in args], stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        while line and not line.startswith("serving "):
            line = process.stderr.readline()
        assert line, "the server ended before serving"
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
        host, port = line.split()[3].removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        wait_for(lambda: health((host, int(port))) is not None, 120)
        yield host, int(port)
    finally:
        process.terminate()
        process.wait(timeout=30)


def health(address: tuple[str, int]) -> dict | None:
    """GET /health's answer (None while the server does not answer)."""
    try:
        connection = http.client.HTTPConnection(*address, timeout=10)
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())
    except OSError:
        return None


def test_two_requests_at_once_are_decoded_together_each_as_alone(address, served, tiny_gguf, heldout, monkeypatch):
    """`dflash serve --parallel 2`: two streamed requests sent at once: the second's first token comes before the
    first ends, decodes held both, each text is llama.cpp's own greedy run's, and each usage is what the same request
    gets sent alone (its prompt, its tokens, its acceptance lengths)."""
    prompts, lengths = [heldout[0], heldout[3][:20]], [LONG, NEW]
    expected = [
        llamacpp_greedy(tiny_gguf["q8_0"], [p], monkeypatch, n)[0] for p, n in zip(prompts, lengths, strict=True)
    ]
    texts = [served.tokenizer.decode(ids) for ids in expected]
    lock, log = threading.Lock(), []
    assert health(address)["parallel"] == 2
    alone = [stream(address, p, [], "alone", lock, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    before = health(address)["shared_decodes"]
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(stream, address, p, log, str(i), lock, max_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        answers = [future.result() for future in futures]
    shared = health(address)["shared_decodes"] - before
    assert [answer["text"] for answer in alone] == texts
    assert [answer["text"] for answer in answers] == texts
    assert log.index(("1", "text")) < log.index(("0", "end")), log  # the second's first token before the first ends
    assert shared > 0
    for answer, single, prompt, length in zip(answers, alone, prompts, lengths, strict=True):
        assert answer["usage"]["prompt_tokens"] == len(prompt) and answer["usage"]["completion_tokens"] == length
        assert answer["usage"]["dflash"]["acceptance_lengths"] == single["usage"]["dflash"]["acceptance_lengths"]


def test_requests_beyond_parallel_wait_in_the_queue_up_to_max_queue(served, heldout):
    """With both sequences busy (held at their first decode), one more request waits (--max-queue 1) and the next is
    refused (429); released, all three answer."""
    engine = Engine(served, 4, None, size=1, parallel=2)
    lock, log, answers = threading.Lock(), [], {}
    with serving(engine) as address:

        def ask(name: str) -> None:
            answers[name] = stream(address, heldout[int(name)], log, name, lock)

        threads = [threading.Thread(target=ask, args=(str(i),)) for i in range(3)]
        with served.target.context.lock:
            for running, thread in enumerate(threads[:2], 1):  # one at a time: a job waits until a worker takes it
                thread.start()
                wait_for(lambda running=running: engine.running == running)
            threads[2].start()
            wait_for(lambda: engine.queued() == 1)
            connection = http.client.HTTPConnection(*address, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps({"prompt": heldout[4], "max_tokens": 2}), AUTH)
            assert connection.getresponse().status == 429
        for thread in threads:
            thread.join(120)
    assert sorted(answers) == ["0", "1", "2"]
    assert all(answer["usage"]["completion_tokens"] == NEW for answer in answers.values())


def wait_for(condition, seconds: float = 60) -> None:
    """Poll until condition() holds."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sampled_answers_of_sequences_in_flight_together_follow_the_targets_distribution(folders):
    """T = 2, top-k 4, top-p 0.9, four tokens at block 2 from the 5-token model's Q8_0 GGUF and llama.cpp's native
    drafter: two sequences always in flight (each step one shared decode), one seed per answer. The chi-square against
    llama.cpp's own logits, enumerated, passes; drafts were kept and bonus tokens drawn after whole blocks."""
    params = SamplingParams(temperature=2.0, top_k=4, top_p=0.9)
    exact = continuations(llamacpp_next_logits(folders["gguf"]), PROMPT, NEW_TOKENS, 2.0, 4, 0.9)
    samples = samples_for_power(EFFECT_FLOOR, exact)
    spec = LoadSpec(RuntimeConfig(threads=1), max_context=64, sequences=2)
    target = LlamaCppTarget.load(folders["gguf"], spec)
    base = LoadedModels(target, NativeDrafter.load(folders["drafter"], target, spec), None, frozenset())
    pairs = share(base, 2)
    lanes = pairs[0].target.lanes
    counts: dict[tuple[int, ...], int] = {}
    lengths: list[tuple[int, int]] = []

    def sample(models, seed: int) -> list:
        settings = Settings(NEW_TOKENS, params, FIXED_BLOCK, seed=seed)
        return list(generate(models.target, models.drafter, PROMPT, settings, None, models.session))

    for seed in range(0, samples, 2):
        for steps in together(lanes, [lambda m=m, s=seed + i: sample(m, s) for i, m in enumerate(pairs)]):
            ids = tuple(token for step in steps for token in step.token_ids)
            counts[ids] = counts.get(ids, 0) + 1
            lengths += [(step.acceptance_length, step.block_size) for step in steps if step.source == "dflash"]
    assert p_value(exact, counts) > 1e-3, counts
    assert lanes.shared >= samples // 2  # every pair shared its decodes
    assert sum(n for n, _ in lengths) / len(lengths) > 1.3 and sum(n == k for n, k in lengths) > samples / 20


@pytest.mark.parametrize(
    "args, sentence",
    [
        ((TINY / "target", "--device", "cpu"), "error: --parallel 2 cannot serve this model: only a GGUF target"),
        ((TINY / "target", "--mmproj", TINY / "README.md"), "error: --parallel 2 takes no images yet: serve --mmproj"),
        ((TINY / "target", "--parallel", "0"), "error: --parallel must be at least 1, got 0."),
    ],
)
def test_what_parallel_cannot_serve_is_one_sentence(args, sentence):
    """serve --parallel 2 with the bundled torch target, or with an image projector, and --parallel 0: one error
    sentence, before it serves."""
    result = invoke("serve", "--parallel", "2", "--port", "0", *args)
    assert result.exit_code != 0 and "serving" not in result.stderr
    lines = result.stderr.splitlines()  # (loading may say where the models were placed first)
    assert lines[-1].startswith(sentence) and result.stderr.count("error") == 1, result.stderr


def test_workers_saving_one_file_at_once_each_write_it_whole(tmp_path):
    """Two threads (serve --parallel's workers saving the block policy's costs) writing one file 300 times each: no
    write fails, and the file holds one of them whole."""
    path, errors = tmp_path / "costs.json", []

    def save(text: str) -> None:
        for _ in range(300):
            try:
                write_text_atomic(path, text)
            except OSError as exc:
                errors.append(exc)

    texts = [json.dumps({"worker": name, "costs": list(range(2000))}) for name in "ab"]
    threads = [threading.Thread(target=save, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and path.read_text() in texts


def holding(tokens: list[int], saved: tuple[list[int], ...] = ()) -> Worker:
    """An idle worker whose caches hold tokens and whose prompt cache holds the saved sequences (a stand-in target:
    only its cache's length, owner and kind)."""
    target = SimpleNamespace(length=len(tokens), cache_owner=None, recurrent=False, trim_floor=0)
    session = Session(PromptCache(2**20))
    session.owner, target.cache_owner = (target, None, None), session
    session.record(list(tokens), len(tokens))
    for ids in saved:
        session.cache.add(Saved(session.owner, list(ids), b"", None, None, floor=0))
    return Worker(SimpleNamespace(session=session))


def test_a_job_goes_to_the_idle_worker_holding_the_longest_prefix_of_its_prompt():
    """choose: the caches' sequence or a saved entry holding the longest prefix wins, wherever it stands among the idle
    workers; under MIN_GAIN tokens held, a tie, or a text prompt (images): the worker idle longest (the first)."""
    a, b, c = list(range(100, 140)), list(range(200, 240)), list(range(300, 340))
    prompt = a + [7, 8, 9]
    idle = [holding(b), holding(a[:20]), holding(c, saved=(a,))]
    assert choose(idle, prompt) is idle[2]  # 40 of the prompt saved beats 20 in the caches
    assert choose(idle[:2], prompt) is idle[1]
    assert choose([holding(b, saved=(c,)), holding(a)], prompt).models.session.tokens == a
    assert choose(idle[:1], prompt) is idle[0]
    short = [holding(b), holding(a[: MIN_GAIN - 1])]
    assert choose(short, prompt) is short[0]
    tied = [holding(b + a), holding(a), holding(a)]
    assert choose(tied, prompt) is tied[1]
    assert choose(idle, "text with <__media__>") is idle[0]


def test_a_conversation_continued_goes_to_the_worker_whose_caches_hold_it(served, tiny_gguf, heldout, monkeypatch):
    """In-process `serve --parallel 2` with a prompt cache, each request sent after the last answer ends: A, B, C (a
    worker idle longest: the one that served A, which saves A), then A with one more turn: it goes to that worker,
    reports A's prompt and answer as cached and answers what llama.cpp's own greedy run does; then A once more goes to
    the same worker (the other one is idle longest). Routing by arrival alone sends both to the other worker."""
    a, b, c = heldout[0][:24], heldout[1][:24], heldout[2][:24]
    answer = llamacpp_greedy(tiny_gguf["q8_0"], [a], monkeypatch, NEW)[0]
    again = a + answer + heldout[3][:8]  # 56 tokens: every prefill under 64 rows, computed row by row
    expected = served.tokenizer.decode(llamacpp_greedy(tiny_gguf["q8_0"], [again], monkeypatch, NEW)[0])
    models = replace(served, session=Session(PromptCache(64 * 2**20)))
    engine = Engine(models, 4, None, size=4, parallel=2)
    lock, log = threading.Lock(), []
    with serving(engine) as address:
        first = stream(address, a, log, "a", lock)
        stream(address, b, log, "b", lock)
        stream(address, c, log, "c", lock)
        second = stream(address, again, log, "again", lock)
        third = stream(address, again + heldout[4][:8], log, "third", lock, max_tokens=4)
    assert first["text"] == served.tokenizer.decode(answer)
    assert second["text"] == expected
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(a) + NEW - 1
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(again)
