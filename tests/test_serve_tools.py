"""Tool calling in `dflash serve`: tools and tool history rendered by real chat templates (Qwen3, Llama 3.1, and
Gemma 2's, which takes no tools: the generic prompt; tests/templates/README.md says where they come from), the
model's calls read back whole and streamed, output that is no call kept as text, and the openai client end to end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import ollama
import openai
import pytest
from test_serve_clients import KEY, TINY, serving

from dflash_local.chat_template import render_chat, takes_tools
from dflash_local.decode import Stats
from dflash_local.errors import DFlashError
from dflash_local.generation import load_models
from dflash_local.reply.channels import PLAIN, Parts, ReplyReader, collected
from dflash_local.reply.text_stream import TextStream
from dflash_local.reply.tool_calls import parse_calls
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server import anthropic_api, ollama_api, openai_api, responses_api
from dflash_local.server.engine import Ending, Engine
from dflash_local.server.openai_api import Shape
from dflash_local.server.protocol import BadRequest, parse_messages
from dflash_local.server.tools import conversation, parse_tools

TEMPLATES = Path(__file__).resolve().parent / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ENDING = Ending("stop", 5, Stats())


def read(family: str, tools: list[dict] | None, deltas: list[str], inside: bool = False) -> list[Parts]:
    """The parts the worker's TextStream gives for a reply's text deltas (its finish last)."""
    reply = TextStream(None, frozenset(), reader=ReplyReader(family, tools, inside))  # text in: no tokenizer
    return [reply.add_text(delta) for delta in deltas] + [reply.finish("stop")[0]]


def read_whole(family: str, tools: list[dict] | None, text: str, inside: bool = False) -> Parts:
    """A whole reply read as the server collects it."""
    parts = Parts()
    for part in read(family, tools, [text], inside):
        parts += part
    return collected(parts)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def rendered(template: str, messages: list[dict], tools: list[dict] | None) -> str:
    """What the server renders for messages and tools with a real template."""
    config = {"chat_template": (TEMPLATES / template).read_text(), "bos_token": "<bos>", "eos_token": "<eos>"}
    turns, shown = conversation(parse_messages({"messages": messages}), tools, takes_tools(config))
    return render_chat(config, turns, True, None, shown)


def test_qwen3_renders_the_tools_and_the_tool_history_itself():
    text = rendered("Qwen-Qwen3-0.6B.jinja", HISTORY, [WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama31_renders_the_tools_and_the_tool_history_itself():
    text = rendered("meta-llama-Llama-3.1-8B-Instruct.jinja", HISTORY, [WEATHER])
    assert "Given the following functions" in text and json.dumps(WEATHER, indent=4) in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C, sunny"' in text


def test_gemma2_takes_no_tools_so_the_generic_prompt_goes_in_the_first_user_turn():
    text = rendered("google-gemma-2-2b-it.jinja", HISTORY, [WEATHER])  # the template refuses a system turn
    first_turn = text.split("<end_of_turn>")[0]
    assert first_turn.startswith("<bos><start_of_turn>user\nYou can call these tools")
    assert json.dumps(WEATHER["function"]) in first_turn and first_turn.endswith("Weather in Paris?")
    assert (
        '<start_of_turn>model\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    )
    assert "<start_of_turn>user\n<tool_response>\n18 C, sunny\n</tool_response><end_of_turn>" in text
    plain = rendered("google-gemma-2-2b-it.jinja", HISTORY[:1], None)
    assert plain == "<bos><start_of_turn>user\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize(
    "text, content, arguments",
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [{"city": "Paris"}]),
        (
            'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n',
            "Checking.",
            [{"city": "A"}],
        ),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>',
            "",
            [{"city": "A"}, {"city": "B"}],
        ),
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [{"city": "Rome"}]),  # Llama 3.1
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [{"city": "Rome"}]),
    ],
)
def test_calls_are_read_from_each_familys_format(text, content, arguments):
    found, calls = parse_calls(text, {"get_weather"})
    assert found == content
    assert [json.loads(c["function"]["arguments"]) for c in calls] == arguments
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        "Just text.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # not JSON
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not a declared tool
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> and then more text',
        '{"name": "get_weather", "parameters": [1]}',
        '{"answer": 42}',
    ],
)
def test_output_that_is_no_call_stays_text(text):
    assert parse_calls(text, {"get_weather"}) == (text, [])


def streamed(pieces: list[str], tools: list[dict] | None = None) -> list[dict]:
    """The SSE chunks a chat stream writes for these text events."""

    async def events() -> AsyncIterator:
        for parts in read(PLAIN, tools, pieces):
            yield parts
        yield ENDING

    async def collect() -> list[str]:
        return [line async for line in Shape("tiny", chat=True).stream(events())]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_streamed_call_is_sent_as_a_tool_calls_delta_after_the_text_before_it():
    pieces = [
        "Let me ",
        "check. <tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    chunks = streamed(pieces, [WEATHER])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check. "
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_text_that_is_no_call_arrives_whole_and_plain_text_is_not_held():
    broken = streamed(["<tool_call>{oops", "}</tool_call>"], [WEATHER])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in broken) == "<tool_call>{oops}</tool_call>"
    assert broken[-1]["choices"][0]["finish_reason"] == "stop"
    plain = streamed(["Hello", " world"], [WEATHER])
    assert [c["choices"][0]["delta"].get("content") for c in plain[1:3]] == ["Hello", " world"]  # sent as it came


@pytest.mark.parametrize(
    "tools, param",
    [
        ({"type": "function"}, "tools"),
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "no spaces"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ],
)
def test_a_malformed_tool_list_is_a_400_naming_the_field(tools, param):
    with pytest.raises(BadRequest) as caught:
        parse_tools({"tools": tools})
    assert caught.value.param == param


@pytest.fixture(scope="module")
def tool_engine() -> Engine:
    """The bundled pair with room for a tool prompt (the tiny model's template takes no tools: the generic one)."""
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)
    return Engine(models, 4, None, size=2)


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_the_three_chat_apis_take_a_past_call_by_one_rule(arguments):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    openai_call = {"id": "c1", "function": {"name": "get_weather", "arguments": arguments}}
    chat = parse_messages({"messages": [{"role": "assistant", "content": "", "tool_calls": [openai_call]}]})
    use = {"type": "tool_use", "id": "c1", "name": "get_weather", "input": arguments}
    messages = anthropic_api.parse_request({"messages": [{"role": "assistant", "content": [use]}]}).messages
    item = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments}
    responses = responses_api.parse_request({"input": [item]}).messages
    assert chat == messages == responses == [{"role": "assistant", "content": "", "tool_calls": [call]}]
    broken = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{not json"}
    with pytest.raises(BadRequest, match="A function_call must be"):
        responses_api.parse_request({"input": [broken]})


def test_every_chat_api_joins_system_turns_into_one_at_the_start():
    """OpenAI's chat and Ollama's /api/chat put system and developer turns as Anthropic's and the Responses API do:
    one system message first, which Qwen3.5's template requires (it refuses a system turn anywhere else)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    config = {"chat_template": (TEMPLATES / "Qwen3.5-4B.jinja").read_text(), "bos_token": "<bos>", "eos_token": "<eos>"}
    with pytest.raises(DFlashError, match="System message must be at the beginning"):
        render_chat(config, parse_messages({"messages": messages[:3] + [messages[0]]}), True, None, None)
    system = {"role": "system", "content": "Be brief.\n\nAnswer in French."}
    responses = responses_api.parse_request({"input": messages}).messages
    for parse in (openai_api.parse_chat, ollama_api.parse_chat):
        chat = parse({"messages": messages}).messages
        assert chat == [system, *messages[1:3], messages[4]] == responses
        text = render_chat(config, chat, True, False, None)
        assert text.startswith("<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>\n<|im_start|>user\n")
        assert text.count("<|im_start|>system") == 1 and "And tomorrow?" in text


def test_the_openai_client_sends_tools_and_tool_history_and_reads_text_back(tool_engine):
    with serving(tool_engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="tiny", messages=HISTORY, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=8
        )
        assert answer.choices[0].message.tool_calls is None  # the tiny model writes code, never a call: text
        assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
        city = {"type": "string", "maxLength": 12}  # bounded, so the tiny model's call ends within max_tokens
        parameters = {"type": "object", "properties": {"city": city}, "required": ["city"]}
        parameters["additionalProperties"] = False
        bounded = {"type": "function", "function": WEATHER["function"] | {"parameters": parameters}}
        forced = client.chat.completions.create(
            model="tiny", messages=HISTORY, tools=[bounded], tool_choice="required", temperature=0, max_tokens=60
        )
        call = forced.choices[0].message.tool_calls[0].function  # constrained: a call, whatever the model prefers
        assert forced.choices[0].finish_reason == "tool_calls" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city"}


def test_ollama_replies_carry_the_calls_in_ollamas_shape_whole_and_streamed():
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    reply = ollama_api.Reply("tiny", chat=True)
    whole = ollama.ChatResponse.model_validate(reply.whole(read_whole(PLAIN, [WEATHER], text), ENDING))
    assert whole.message.content == "Sure." and whole.done
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]

    async def events() -> AsyncIterator:
        for parts in read(PLAIN, [WEATHER], [text[:9], text[9:30], text[30:]]):
            yield parts
        yield ENDING

    async def lines() -> list[str]:
        return [line async for line in reply.stream(events())]

    parts = [ollama.ChatResponse.model_validate_json(line) for line in asyncio.run(lines())]
    assert "".join(p.message.content for p in parts) == "Sure."
    assert parts[-1].done and parts[-1].message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_the_ollama_client_sends_tools_and_tool_history_and_reads_text_back(tool_engine):
    with serving(tool_engine) as url:
        local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        history = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]}]
        history.append({"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"})
        answer = local.chat(
            model="tiny", messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 8}
        )
        assert answer.message.content and not answer.message.tool_calls and answer.done
