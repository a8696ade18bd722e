"""`dflash serve`'s OpenAI Responses API driven by the `openai` client (whole, streamed, a forced function call,
input items, its error shape) and by Codex CLI itself (`codex exec` with a custom provider), over the bundled pair
served in-process with the tiny model's own turns as a `--chat-template` file."""

from __future__ import annotations

import json
import os
import subprocess

import openai
import pytest
from agent_clients import codex
from test_serve_clients import KEY
from test_serve_messages import models, post, seeded, url  # noqa: F401 (the served pair, shared)

from dflash_local.server.protocol import BadRequest
from dflash_local.server.responses_api import parse_request

ASK = "def fibonacci(n):"  # the tiny model's greedy answer ends well within LONG tokens
LONG = 400
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_response_whole_and_streamed_is_the_same_greedy_text(client):
    whole = client.responses.create(model="tiny", input=ASK, instructions="Be brief.", temperature=0)
    assert whole.status == "completed" and whole.output_text and whole.output[0].type == "message"
    assert whole.usage.output_tokens > 0 and whole.usage.model_extra["dflash"]["tau"] >= 1
    with client.responses.stream(
        model="tiny", input=[{"role": "user", "content": ASK}], instructions="Be brief.", temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text and streamed.usage.input_tokens == whole.usage.input_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.content_part.added"
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_a_response_cut_by_max_output_tokens_is_incomplete(client):
    cut = client.responses.create(model="tiny", input=ASK, max_output_tokens=5, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_function_call_whole_and_streamed(client, choice):
    asked = dict(model="tiny", input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=60, temperature=0)
    whole = client.responses.create(**asked)
    with client.responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    for response in (whole, streamed):
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
        assert call.call_id.startswith("call_") and response.status == "completed"
    assert "response.function_call_arguments.done" in kinds


def test_input_items_become_the_chat_the_template_renders():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call it."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ],
        "tools": [WEATHER, {"type": "web_search"}, {"type": "namespace", "name": "x", "tools": []}],
        "reasoning": {"effort": "none", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
    }
    chat = parse_request(body)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call],
            "reasoning_content": "Call it.",
            "thinking": "Call it.",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    assert [tool["function"]["name"] for tool in chat.tools] == ["get_weather"] and chat.thinking is False
    with pytest.raises(BadRequest, match="keeps no responses"):
        parse_request({"input": "hi", "previous_response_id": "resp_1"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    form = {"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    assert parse_request({"input": "hi", "text": form}).sampling.grammar is not None


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (b"[]", 400),
        (json.dumps({"input": 5}).encode(), 400),
        (json.dumps({"input": []}).encode(), 400),
        (json.dumps({"input": [{"type": "message", "role": "robot", "content": "x"}]}).encode(), 400),
        (json.dumps({"input": [{"type": "function_call", "name": "f", "arguments": "{"}]}).encode(), 400),
        (json.dumps({"input": "hi", "max_output_tokens": 0}).encode(), 400),
        (json.dumps({"input": "hi", "reasoning": {"effort": "extreme"}}).encode(), 400),
        (json.dumps({"input": "hi", "tool_choice": "required"}).encode(), 400),
        (json.dumps({"input": "hi", "previous_response_id": "resp_1"}).encode(), 400),
        (json.dumps({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}).encode(), 400),
        (b'{"input": "' + b"x" * 2**20 + b'"}', 413),
    ],
)
def test_hostile_bodies_get_openais_error_shape_and_the_server_stays_up(url, client, body, status):  # noqa: F811
    got, answer = post(url, "/v1/responses", body, {"Authorization": f"Bearer {KEY}"})
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert client.responses.create(model="tiny", input=ASK, max_output_tokens=2, temperature=0).output_text


def test_serves_seed_repeats_the_sampled_answers_of_requests_that_name_none(seeded):  # noqa: F811
    client = openai.OpenAI(base_url=f"{seeded}/v1", api_key=KEY, max_retries=0, timeout=120)
    first, again = (client.responses.create(model="tiny", input=ASK, max_output_tokens=48).output_text for _ in "12")
    assert first == again
    ask = [{"role": "user", "content": ASK}]
    chats = [client.chat.completions.create(model="tiny", messages=ask, max_tokens=48) for _ in "12"]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content


def test_codex_exec_answers_through_a_custom_provider(seeded, tmp_path):  # noqa: F811
    """`codex exec` with a custom provider (wire_api responses) at the server exits 0 with the model's answer. Short
    instructions and Codex's optional tools and context turned off keep its request inside the tiny model's
    2048-token context (its default one is ~9K tokens); the request holds no path, and the server's seed makes the
    tiny model's sampled answer (Codex sends no temperature: 1) one that ends, 85 tokens, where some samples fill
    the context and Codex then fails on the incomplete response."""
    home = tmp_path / "codex"
    home.mkdir()
    (tmp_path / "instructions.md").write_text("Answer briefly.\n")
    (home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "dflash"\n'
        f'model_instructions_file = "{tmp_path / "instructions.md"}"\n'
        "include_environment_context = false\ninclude_apps_instructions = false\n"
        "include_collaboration_mode_instructions = false\n"
        "[features]\napps = false\ngoals = false\nplugins = false\nmemories = false\nunified_exec = false\n"
        "view_image = false\nshell_tool = false\n[skills]\ninclude_instructions = false\n"
        '[model_providers.dflash]\nname = "dflash"\n'
        f'base_url = "{seeded}/v1"\nwire_api = "responses"\nenv_key = "DFLASH_API_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n"
    )
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("OPENAI_", "CODEX_"))}
    environment |= {"HOME": str(tmp_path), "CODEX_HOME": str(home), "DFLASH_API_KEY": KEY}
    command = [*codex(), "exec", "--skip-git-repo-check", "say hi"]
    done = subprocess.run(
        command, env=environment, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()
