"""The `<think>` family's reasoning and Qwen3-Coder's XML tool calls through all four APIs (OpenAI chat completions,
Ollama, Anthropic's Messages, OpenAI's Responses), whole and streamed, each read by its own client. The bundled pair
serves with the family's real chat template (Qwen3.5's generation prompt opens `<think>` itself) and a scripted
generation (the pair cannot write these formats), so the whole server path runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import ollama
import openai
import pytest
from test_serve_clients import KEY, TINY, serving
from test_serve_tools import TEMPLATES

from dflash_local.decode import Stats
from dflash_local.generation import load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server import engine as engine_module
from dflash_local.server.engine import Engine

THOUGHT, ANSWER = "The user greets me.", "Hello there!"
OPENED = f"{THOUGHT}\n</think>\n\n{ANSWER}"  # after a generation prompt that opened <think>
ASK = [{"role": "user", "content": "Hi"}]
CODER_CALL = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": SCHEMA}}
CALLED = {"city": "San Francisco", "days": 3}


@pytest.fixture(scope="module")
def tiny_models():
    return load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)


@pytest.fixture
def scripted(tiny_models, monkeypatch):
    """The server over the pair with this real template, whose generation writes `text`; the prompts rendered."""
    prompts: list[str] = []

    def make(template: str, text: str):
        def stream(models, request):
            prompts.append(models.tokenizer.decode(request.prompt))
            stats = Stats()
            stats.finish_reason = "stop"  # the reply ends as the model's end-of-turn would end it
            ids = models.tokenizer.encode(text, add_special_tokens=False)
            for at in range(0, len(ids), 2):
                yield SimpleNamespace(step=SimpleNamespace(token_ids=ids[at : at + 2]), stats=stats)

        monkeypatch.setattr(engine_module, "stream", stream)
        source = (TEMPLATES / template).read_text()
        monkeypatch.setattr(tiny_models.tokenizer, "config", tiny_models.tokenizer.config | {"chat_template": source})
        return serving(Engine(tiny_models, 4, None, size=2))

    make.prompts = prompts
    return make


def test_qwen35s_reasoning_comes_apart_through_all_four_apis_whole_and_streamed(scripted):
    with scripted("Qwen3.5-4B.jinja", OPENED) as url:
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        message = chat.chat.completions.create(model="m", messages=ASK, max_tokens=64).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (f"{THOUGHT}\n", ANSWER)
        deltas = [c.choices[0].delta for c in chat.chat.completions.create(model="m", messages=ASK, stream=True)]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == f"{THOUGHT}\n"
        assert "".join(d.content or "" for d in deltas) == ANSWER

        local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        answer = local.chat(model="m", messages=ASK, stream=False)
        assert (answer.message.thinking, answer.message.content) == (f"{THOUGHT}\n", ANSWER)
        parts = list(local.chat(model="m", messages=ASK, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == f"{THOUGHT}\n"
        assert "".join(p.message.content for p in parts) == ANSWER
        assert "thinking" in local.show("m").capabilities

        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        whole = claude.messages.create(model="m", max_tokens=64, messages=ASK)
        with claude.messages.stream(model="m", max_tokens=64, messages=ASK) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        for message in (whole, streamed):
            assert [block.type for block in message.content] == ["thinking", "text"]
            assert (message.content[0].thinking, message.content[1].text) == (f"{THOUGHT}\n", ANSWER)
        assert kinds.count("content_block_start") == 2 and kinds.count("content_block_stop") == 2

        responses = chat.responses.create(model="m", input="Hi")
        with chat.responses.stream(model="m", input="Hi") as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        for response in (responses, final):
            assert [item.type for item in response.output] == ["reasoning", "message"]
            assert response.output[0].content[0].text == f"{THOUGHT}\n" and response.output_text == ANSWER
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert all(prompt.endswith("<|im_start|>assistant\n<think>\n") for prompt in scripted.prompts)


def test_the_thinking_switch_of_each_api_reaches_the_template(scripted):
    with scripted("Qwen3.5-4B.jinja", ANSWER) as url:
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="m", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}).chat(model="m", messages=ASK, think=False)
        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        answer = claude.messages.create(model="m", max_tokens=9, messages=ASK, thinking={"type": "disabled"})
        response = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).responses.create(
            model="m", input="Hi", reasoning={"effort": "none"}
        )
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text == ANSWER
    assert [item.type for item in response.output] == ["message"] and response.output_text == ANSWER
    assert len(scripted.prompts) == 4
    assert all(prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for prompt in scripted.prompts)


def test_qwen3_coders_xml_calls_are_read_through_all_four_apis_whole_and_streamed(scripted):
    with scripted("Qwen3-Coder.jinja", CODER_CALL) as url:
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
        calls = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content == (
            "I will look it up."
        )
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", CALLED)]
        chunks = list(chat.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True))
        streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert [json.loads(c.function.arguments) for c in streamed] == [CALLED]
        assert "<function=" not in "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

        local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        parts = list(local.chat(model="m", messages=ASK, tools=[WEATHER], stream=True))
        assert parts[-1].message.tool_calls[0].function.arguments == CALLED

        claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        tool = {"name": "get_weather", "description": "The weather.", "input_schema": SCHEMA}
        with claude.messages.stream(model="m", max_tokens=64, messages=ASK, tools=[tool]) as stream:
            message = stream.get_final_message()
        assert message.stop_reason == "tool_use" and message.content[-1].input == CALLED

        function = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
        with chat.responses.stream(model="m", input="Hi", tools=[function]) as stream:
            response = stream.get_final_response()
        assert [json.loads(i.arguments) for i in response.output if i.type == "function_call"] == [CALLED]
