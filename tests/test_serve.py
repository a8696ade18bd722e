"""`dflash serve tiny` as a live process on a loopback port, driven by the official `openai` client; and the
server's parts that need no process (stop strings, the bounded queue, request checks, the exposure warning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from typer.testing import CliRunner

from dflash_local.cli import app
from dflash_local.cli.options import DecodeOptions
from dflash_local.generation import load_models
from dflash_local.reply.text_stream import End, TextStream
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.sampling import SamplingParams
from dflash_local.server.engine import Engine, Job
from dflash_local.server.hardening import exposure_warning
from dflash_local.server.protocol import BadRequest, Sampling, parse_sampling
from dflash_local.tokenizer import TextTokenizer, stop_token_ids

KEY = "test-key"
TARGET = Path(__file__).resolve().parent.parent / "models" / "tiny" / "target"
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def url():
    """One `dflash serve tiny --api-key` process for the module: its base URL once /health answers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "dflash_local", "serve", "tiny", "--port", "0", "--api-key", KEY]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stderr.readline()
        assert line.startswith("serving tiny on http://127.0.0.1:"), line
        base = line.split()[3].removesuffix("/v1")
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
        deadline = time.monotonic() + 120
        while True:
            try:
                assert health(base)["status"] == "ok"
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and process.poll() is None, "the server did not come up"
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
        return json.loads(response.read())


def post(base: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected() -> dict:
    """`dflash generate`'s greedy answer to MESSAGES rendered by the tiny target's chat template."""
    tokenizer = TextTokenizer.load(TARGET)
    ids = tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    args = ["generate", "--target", "tiny", "--prompt-ids", ",".join(map(str, ids)), "--json"]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", str(MAX_TOKENS)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)["output_ids"]
    ended = out[-1] in stop_token_ids(TARGET)
    text = tokenizer.decode(out[:-1] if ended else out)
    return {"prompt_ids": ids, "output_ids": out, "text": text, "finish": "stop" if ended else "length"}


def test_greedy_chat_whole_and_streamed_equals_dflash_generate(client, expected):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.content == expected["text"]
    assert answer.choices[0].finish_reason == expected["finish"]
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected["prompt_ids"]), len(expected["output_ids"]))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stats = usage.model_extra["dflash"]
    assert len(stats["acceptance_lengths"]) == len(stats["block_sizes"]) > 0
    assert stats["tau"] > 0 and stats["decode_tokens_per_s"] > 0
    assert 1 <= stats["prefill_tokens"] <= usage.prompt_tokens
    assert sum(stats["tokens_by_source"].values()) == usage.completion_tokens  # the target's, the drafter's, lookup's

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected["finish"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["output_ids"])
    assert chunks[-1].usage.model_extra["dflash"]["prefill_tokens"] < usage.prompt_tokens  # the prefix is reused


def test_completions_cut_at_a_stop_string_whole_and_streamed(client):
    def complete(**extra) -> tuple[str, str, int]:
        answer = client.completions.create(model="tiny", prompt="The", temperature=0, max_tokens=24, **extra)
        stats = answer.usage.model_extra["dflash"]
        assert sum(stats["acceptance_lengths"]) + 1 == answer.usage.completion_tokens  # the steps' stats, cut or not
        return answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens

    full, finish, made = complete()
    assert len(full) > 8 and finish in ("stop", "length")
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    text, finish, made_to_stop = complete(stop=[stop, "never in the text"])
    assert (text, finish) == (cut, "stop") and made_to_stop < made
    stream = client.completions.create(model="tiny", prompt="The", temperature=0, max_tokens=24, stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_disconnects_cancels_its_generation(url, client, expected):
    before = health(url)["cancelled"]
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while health(url)["cancelled"] == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.1)
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.content == expected["text"]


def test_eight_concurrent_clients_are_all_answered(client):
    prompts = ["The", "def main():"] * 4

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    assert all(answers)
    assert answers[0::2] == [answers[0]] * 4 and answers[1::2] == [answers[1]] * 4
    assert answers[0] != answers[1]


def test_a_bad_request_is_a_400_in_the_openai_error_shape(url, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=5)
    assert caught.value.status_code == 400
    assert caught.value.param == "temperature" and caught.value.type == "invalid_request_error"
    status, body = post(url, "/v1/chat/completions", b"{not json", {"Authorization": f"Bearer {KEY}"})
    assert status == 400
    assert body == {
        "error": {
            "message": "The request body is not valid JSON.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    status, body = post(url, "/v1/chat/completions", b'{"unknown": 1}', {"Authorization": f"Bearer {KEY}"})
    assert (status, body["error"]["param"]) == (400, "messages")
    failed = health(url)["failed"]
    out_of_vocabulary = json.dumps({"prompt": [10**6], "max_tokens": 2}).encode()
    status, body = post(url, "/v1/completions", out_of_vocabulary, {"Authorization": f"Bearer {KEY}"})
    assert status == 400
    assert body["error"]["message"].startswith("Prompt token id 1000000 is outside the vocabulary")
    assert health(url)["failed"] == failed + 1
    assert client.completions.create(model="tiny", prompt="The", max_tokens=2).choices[0].text


def test_the_api_key_is_required(url, client):
    status, body = post(url, "/v1/completions", b'{"prompt": "The"}', {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_the_text_stream_never_sends_text_after_a_stop_string():
    reply = TextStream(None, frozenset(), ("STOP",), ("<|end|>",))  # text in: no tokenizer
    sent = [reply.add_text(delta).content for delta in ("Hello S", "T", "ill <", "|e", "nd|> more")]
    assert sent == ["Hello ", "", "STill ", "", ""]
    rest, end = reply.finish("length")
    assert (reply.text, reply.hit, rest.content, end) == ("Hello STill ", "<|end|>", "", End("stop", None))
    unfinished = TextStream(None, frozenset(), ("STOP",))
    sent = unfinished.add_text("a ST").content
    assert (sent, unfinished.finish(None)[0].content, unfinished.hit) == ("a ", "ST", None)


def test_a_full_queue_refuses_instead_of_waiting():
    release = threading.Event()
    models = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: "", config={}), stop_ids=frozenset())
    engine = Engine(models, None, None, size=2)
    loop = SimpleNamespace(call_soon_threadsafe=lambda *args: None)
    busy = Job(lambda models: release.wait() and [], Sampling(), loop)
    assert engine.submit(busy)
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline, "the worker never took the first job"
        time.sleep(0.01)
    assert engine.submit(Job(lambda models: [], Sampling(), loop))
    assert engine.submit(Job(lambda models: [], Sampling(), loop))
    assert not engine.submit(Job(lambda models: [], Sampling(), loop))
    release.set()


def test_the_queue_serves_in_arrival_order_and_a_cancelled_job_gives_up_its_place():
    release, served = threading.Event(), []
    models = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: "", config={}), stop_ids=frozenset())
    engine = Engine(models, None, None, size=2)
    loop = SimpleNamespace(call_soon_threadsafe=lambda *args: None)

    def job(name: str) -> Job:
        return Job(lambda models: served.append(name) or (release.wait() and []), Sampling(), loop)

    assert engine.submit(job("first"))
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline, "the worker never took the first job"
        time.sleep(0.01)
    gone, second = job("gone"), job("second")
    assert engine.submit(gone) and engine.submit(second) and not engine.submit(job("refused"))
    gone.cancelled.set()  # its client disconnected while it waited
    assert engine.submit(job("third")) and engine.queued() == 2
    release.set()
    while served != ["first", "second", "third"]:
        assert time.monotonic() < deadline, f"served {served}"
        time.sleep(0.01)
    assert engine.counts["cancelled"] == 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"n": 2}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"user": 5}, "user"),
    ],
)
def test_invalid_fields_name_themselves(body, param):
    with pytest.raises(BadRequest) as caught:
        parse_sampling(body)
    assert caught.value.param == param


def test_fields_clients_send_by_default_are_accepted_and_unknown_ones_ignored_with_a_debug_log(caplog):
    sent = {"frequency_penalty": 0, "presence_penalty": 0.0, "user": "x", "n": 1, "logprobs": False, "stop": "END"}
    sent |= {"parallel_tool_calls": True, "logit_bias": {}, "metadata": {"a": "b"}, "store": False}
    with caplog.at_level("DEBUG", logger="dflash.serve"):
        assert parse_sampling(sent) == Sampling(stop=("END",))
    assert "ignored unknown request fields: metadata, store" in caplog.text


def test_a_non_loopback_address_without_a_key_is_warned_about():
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warning(host, None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    assert exposure_warning("0.0.0.0", None).startswith("warning: listening on 0.0.0.0 without --api-key")


def test_serve_without_a_drafter_at_a_fixed_block_drafts_by_lookup_as_chat_does():
    """No drafter and a fixed --block-size: serve's settings are chat's (one builder), so lookup drafts what followed
    the text's end where it came before, and the answer is plain decoding's; --no-draft drafts nothing."""
    from test_serve_clients import KEY, serving

    models = load_models(TARGET, None, LoadSpec(RuntimeConfig(device="cpu"), max_context=256), auto_block=False)
    sampling = Sampling(max_tokens=MAX_TOKENS, params=SamplingParams())
    chat = DecodeOptions(max_new_tokens=MAX_TOKENS, block_size="4").settings(models)
    assert Engine(models, 4, None, size=1).settings(sampling, 10) == chat and chat.draft
    assert not Engine(models, 4, None, size=1, no_draft=True).settings(sampling, 10).draft
    prompt = "one two three four five six seven eight " * 6 + "one two"
    answers = {}
    for no_draft in (False, True):
        with serving(Engine(models, 4, None, size=1, no_draft=no_draft)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
            answer = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
            answers[no_draft] = (answer.choices[0].text, answer.usage.model_extra["dflash"]["tokens_by_source"])
    assert answers[False][0] == answers[True][0]
    assert answers[False][1].get("lookup", 0) > 0 and "lookup" not in answers[True][1]
