"""`dflash serve`'s Anthropic Messages API driven by the `anthropic` client (whole, streamed, a forced tool, token
counts, stop sequences, its error shape) and by Claude Code itself (`claude -p`), over the bundled pair served
in-process with `--chat-template` given a Jinja file (the tiny model's own turns, which take a system prompt)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import anthropic
import pytest
from agent_clients import claude_code
from test_serve_clients import KEY, TINY, serving

from dflash_local.chat_template import read_template, use_template
from dflash_local.generation import load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.anthropic_api import parse_request
from dflash_local.server.engine import Engine, Job
from dflash_local.server.hardening import Limits
from dflash_local.server.protocol import Sampling

TEMPLATE = Path(__file__).resolve().parent / "templates" / "tiny-with-system.jinja"
GREEDY = {"temperature": 0}  # the client has no temperature argument; the API takes the field
ASK = [{"role": "user", "content": "def fibonacci(n):"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def models():
    runtime = RuntimeConfig(device="cpu")
    loaded = load_models(TINY / "target", TINY / "drafter", LoadSpec(runtime, max_context=2048), auto_block=False)
    loaded.tokenizer.config = use_template(loaded.tokenizer.config, read_template(str(TEMPLATE)), TINY / "target")
    return loaded


@pytest.fixture(scope="module")
def url(models):
    with serving(Engine(models, 4, None, size=8), Limits(max_body=2**20)) as url:
        yield url


@pytest.fixture(scope="module")
def seeded(models):
    """`dflash serve --seed 0` over the same pair: requests that name no seed sample the same answer each time, so
    the agents' runs (at their temperature 1) are the same runs each time."""
    with serving(Engine(models, 4, None, size=8, seed=0), Limits(max_body=2**20)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_whole_and_streamed_is_the_same_greedy_text(client):
    whole = client.messages.create(model="tiny", max_tokens=24, messages=ASK, system="Be brief.", extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason == "max_tokens"
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.output_tokens == 24 and whole.usage.dflash["tau"] >= 1
    counted = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    assert whole.usage.input_tokens == counted.input_tokens > 0
    kinds = []
    with client.messages.stream(
        model="tiny", max_tokens=24, messages=ASK, system=[{"type": "text", "text": "Be brief."}], extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text and streamed.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and kinds.count("content_block_stop") == 1


def test_a_stop_sequence_ends_the_message_before_it(client):
    text = client.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.messages.create(model="tiny", max_tokens=24, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_is_a_tool_use_block_whole_and_streamed(client, choice):
    asked = dict(model="tiny", max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice=choice, extra_body=GREEDY)
    whole = client.messages.create(**asked)
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        (use,) = [block for block in message.content if block.type == "tool_use"]
        assert use.name == "get_weather" and set(use.input) == {"city"} and use.id.startswith("toolu_")
    assert whole.content[-1].input == streamed.content[-1].input


def test_blocks_become_the_chat_the_template_renders():
    body = {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "disabled"},
        "max_tokens": 10,
        "metadata": {"user_id": "u"},
        "context_management": {"edits": []},
    }
    chat = parse_request(body)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\nReminder."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call],
            "reasoning_content": "Use the tool.",
            "thinking": "Use the tool.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert [tool["function"]["name"] for tool in chat.tools] == ["get_weather"]
    assert chat.thinking is False and chat.sampling.max_tokens == 10 and chat.sampling.grammar is None


def post(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"} | headers)
    response = connection.getresponse()
    answer = (response.status, json.loads(response.read()))
    connection.close()
    return answer


@pytest.mark.parametrize(
    "body, status, kind",
    [
        (b"{not json", 400, "invalid_request_error"),
        (b"[1, 2]", 400, "invalid_request_error"),
        (json.dumps({"messages": "hi", "max_tokens": 5}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": ASK, "stop_sequences": [5]}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": ASK, "tool_choice": {"type": "maybe"}}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": ASK, "thinking": "on"}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": ASK, "temperature": 1.5}).encode(), 400, "invalid_request_error"),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}]}]}).encode(), 400, None),
        (b'{"messages": "' + b"x" * 2**20 + b'"}', 413, "request_too_large"),
    ],
)
def test_hostile_bodies_get_anthropics_error_shape_and_the_server_stays_up(url, client, body, status, kind):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        got, answer = post(url, path, body, {"x-api-key": KEY})
        assert got == status and answer["type"] == "error" and answer["error"]["message"]
        assert answer["error"]["type"] == (kind or "invalid_request_error")
    assert client.messages.create(model="tiny", max_tokens=2, messages=ASK, extra_body=GREEDY).content  # not an end


def test_the_client_reads_no_such_path_or_method_as_anthropics_errors(client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.list()  # GET /v1/messages/batches: not served
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert missing.value.body["error"]["message"].startswith("Invalid URL (GET /v1/messages/batches)")
    with pytest.raises(anthropic.APIStatusError) as wrong:
        client.get("/v1/messages", cast_to=object)
    assert wrong.value.status_code == 405 and wrong.value.body["error"]["type"] == "invalid_request_error"


def test_keys_are_taken_as_x_api_key_or_bearer_and_a_wrong_one_is_a_401(url):
    body = json.dumps({"messages": ASK, "max_tokens": 2}).encode()
    bearer = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}  # the anthropic client's way
    assert post(url, "/v1/messages", body, bearer)[0] == 200
    claude_code = {"x-api-key": KEY, "anthropic-beta": "claude-code-20250219"}
    assert post(url, "/v1/messages?beta=true", body, claude_code)[0] == 200
    status, answer = post(url, "/v1/messages?beta=true", body, {"x-api-key": "wrong", "anthropic-beta": "x-2025"})
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=ASK
        )


def test_a_prompt_longer_than_the_context_is_a_400_the_client_reads(client):
    with pytest.raises(anthropic.BadRequestError, match=r"does not fit the 2048-token context"):
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x " * 5000}])


def test_a_full_queue_is_anthropics_overloaded_error_and_openais_429(models):
    release = threading.Event()
    engine = Engine(models, 4, None, size=1)
    loop = SimpleNamespace(call_soon_threadsafe=lambda *args: None)
    assert engine.submit(Job(lambda models: release.wait() and [], Sampling(), loop))
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline, "the worker never took the first job"
        time.sleep(0.01)
    assert engine.submit(Job(lambda models: [], Sampling(), loop))  # the queue's one place
    try:
        with serving(engine) as url:
            body = json.dumps({"messages": ASK, "max_tokens": 2}).encode()
            status, answer = post(url, "/v1/messages", body, {"x-api-key": KEY})
            assert status == 529 and answer["error"]["type"] == "overloaded_error"
            status, answer = post(url, "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"})
            assert status == 429 and answer["error"]["message"].startswith("The server is busy")
    finally:
        release.set()


def test_claude_code_answers_a_prompt_through_the_server(seeded, tmp_path):
    """`claude -p` with ANTHROPIC_BASE_URL at the (seeded) server exits 0 with the model's answer. --bare and a short
    system prompt without tools keep its request inside the tiny model's 2048-token context (its default one is
    ~28K)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("ANTHROPIC_", "CLAUDE"))}
    environment |= {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": seeded, "ANTHROPIC_API_KEY": KEY}
    environment |= {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1500"}
    command = [*claude_code(), "--bare", "-p", "--system-prompt", "Answer briefly.", "--tools", "", "--", "say hi"]
    done = subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()
