"""`dflash serve` driven by the clients people use: the `openai` client with the fields clients send by default, the
`ollama` client on the Ollama routes, a plain urllib client sending a 20 MB body, and a browser's CORS preflight. The
server runs in-process on a loopback port (the real app and protocol) over one engine of the bundled pair."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ollama
import openai
import pytest

from dflash_local.generation import load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.app import create_app
from dflash_local.server.engine import Engine
from dflash_local.server.hardening import Limits, listen, uvicorn_server

KEY = "test-key"
TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
CONTEXT = 160  # small, so that a request without max_tokens runs to the end of the context quickly
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]
ORIGIN = "http://app.example"
BLOCK = 4  # a fixed block: a seeded sample repeats only where the steps' block sizes do (auto's follow the timings)


@pytest.fixture(scope="module")
def engine() -> Engine:
    runtime = RuntimeConfig(device="cpu")
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(runtime, max_context=CONTEXT), auto_block=False)
    return Engine(models, BLOCK, None, size=8)


@contextmanager
def serving(engine: Engine, limits: Limits = Limits(), origins: tuple[str, ...] = ()) -> Iterator[str]:
    """`dflash serve --api-key KEY` with these limits and CORS origins on a free loopback port: its base URL."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn_server(create_app(engine, "tiny", KEY, limits, origins), limits)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield "http://{}:{}".format(*sock.getsockname()[:2])
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    with serving(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(url) -> ollama.Client:
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def greedy(client) -> str:
    """The greedy answer to MESSAGES in 24 tokens, asked with no extra fields."""
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content
    return answer.choices[0].message.content


def test_the_fields_clients_send_by_default_are_accepted(client, greedy):
    defaults = {"user": "someone", "n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0}
    defaults |= {"parallel_tool_calls": True, "seed": 3}
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"metadata": {"app": "x"}}, **defaults
    )
    assert answer.choices[0].message.content == greedy


def test_stream_options_include_usage_adds_a_last_chunk_with_usage_and_no_choices(client, greedy):
    def chunks(**extra) -> list:
        ask = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 24, "stream": True}
        return list(client.chat.completions.create(**ask, **extra))

    with_usage = chunks(stream_options={"include_usage": True})
    assert "".join(c.choices[0].delta.content or "" for c in with_usage if c.choices) == greedy
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in with_usage[:-1])
    without = chunks()
    assert all(c.choices and c.usage is None for c in without)


def test_a_seed_repeats_a_sampled_answer(client):
    def sample(seed: int) -> str:
        answer = client.completions.create(model="tiny", prompt="The", temperature=1, max_tokens=16, seed=seed)
        return answer.choices[0].text

    assert sample(7) == sample(7)


def test_no_max_tokens_means_up_to_the_context(client):
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    usage = answer.usage
    assert answer.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("frequency_penalty", 0.5)])
def test_what_cannot_be_honoured_is_a_400_in_the_openai_shape(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **{field: value})
    assert caught.value.param == field and caught.value.type == "invalid_request_error"


def test_the_ollama_client_lists_and_shows_the_model(local):
    assert [m.model for m in local.list().models] == ["tiny"]
    shown = local.show("tiny")
    assert shown.modelinfo["dflash.context_length"] == CONTEXT
    assert shown.capabilities == ["completion", "tools"]  # clients offer tools only to a model that lists them
    assert local._request_raw("GET", "/api/version").json()["version"]


def test_the_ollama_client_chats_whole_and_streamed_as_the_openai_api_answers(local, greedy):
    options = {"temperature": 0, "num_predict": 24}
    answer = local.chat(model="tiny", messages=MESSAGES, options=options)
    assert (answer.message.role, answer.message.content) == ("assistant", greedy)
    assert answer.done and answer.done_reason == "length" and answer.eval_count == 24 and answer.prompt_eval_count > 0
    parts = list(local.chat(model="tiny", messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == greedy
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == 24


def test_the_ollama_client_generates_with_options_whole_and_streamed(local):
    whole = local.generate(model="tiny", prompt="def main():", raw=True, options={"temperature": 0, "num_predict": 12})
    assert whole.response and whole.done_reason == "length" and whole.eval_count == 12
    stop = whole.response[len(whole.response) // 2 :][:2]
    cut = whole.response[: whole.response.find(stop)]
    options = {"temperature": 0, "num_predict": 12, "stop": [stop]}
    parts = list(local.generate(model="tiny", prompt="def main():", raw=True, options=options, stream=True))
    assert "".join(p.response for p in parts) == cut and parts[-1].done_reason == "stop"
    seeded = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 5, "num_predict": 12}
    first, again = (local.generate(model="tiny", prompt="The", options=seeded).response for _ in range(2))
    assert first == again
    assert local.generate(model="tiny", prompt="").done_reason == "load"


def test_the_ollama_api_refuses_what_it_cannot_honour_in_its_error_shape(local, url):
    with pytest.raises(ollama.ResponseError) as caught:
        local.generate(model="tiny", prompt="The", suffix="return")
    assert caught.value.status_code == 400 and "'suffix'" in caught.value.error
    request = urllib.request.Request(f"{url}/api/tags")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401 and set(json.loads(refused.value.read())) == {"error"}


def test_the_ollama_client_reads_no_such_path_or_method_in_its_error_shape(local):
    with pytest.raises(ollama.ResponseError) as missing:
        local.delete("tiny")  # DELETE /api/delete: not served
    assert missing.value.status_code == 404 and missing.value.error.startswith("Invalid URL (DELETE /api/delete)")
    with pytest.raises(ollama.ResponseError) as wrong:
        local._request_raw("GET", "/api/chat")
    assert wrong.value.status_code == 405 and wrong.value.error == "GET /api/chat is not allowed: use POST."


def test_a_plain_urllib_client_sending_a_20_mb_body_reads_the_413(url):
    body = json.dumps({"messages": MESSAGES, "padding": "x" * (20 << 20)}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 413
    error = json.loads(caught.value.read())["error"]
    assert error["message"] == f"The request body is {len(body)} bytes, over the {4 << 20}-byte limit (--max-body)."


def preflight(url: str) -> dict[str, str]:
    """The headers of a browser's CORS preflight for a chat request from ORIGIN."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        connection.request(
            "OPTIONS", "/v1/chat/completions", headers=asks | {"Access-Control-Request-Headers": "authorization"}
        )
        response = connection.getresponse()
        response.read()
        return {name.lower(): value for name, value in response.getheaders()}
    finally:
        connection.close()


def test_cors_answers_only_the_origins_given(engine, url):
    assert "access-control-allow-origin" not in preflight(url)
    with serving(engine, origins=(ORIGIN,)) as allowing:
        assert preflight(allowing)["access-control-allow-origin"] == ORIGIN
        request = urllib.request.Request(
            f"{allowing}/v1/models", headers={"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.headers["access-control-allow-origin"] == ORIGIN
