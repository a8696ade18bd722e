"""Replies of the families that write their own markup (gpt-oss's harmony, Gemma 4) in `dflash serve`: the family
chosen from the real chat template, tool history rendered by those templates, the families' exact reply texts read
into reasoning, answer and tool calls (whole and in every split as they stream), Gemma 4's markers through its real
vocabulary, and the whole server path (openai and ollama clients) over a scripted reply, since the bundled pair
cannot write these formats. Output no reader can read stays text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import ollama
import openai
import pytest
from test_architectures import llama_cpp_source
from test_serve_clients import KEY, TINY, serving
from test_serve_tools import ENDING, HISTORY, TEMPLATES, WEATHER, read, read_whole, rendered

from dflash_local.decode import Stats
from dflash_local.generation import load_models
from dflash_local.reply.channels import GEMMA4, HARMONY, PLAIN, THINK, ReplyReader, reply_family
from dflash_local.reply.text_stream import TextStream
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server import engine as engine_module
from dflash_local.server import ollama_api
from dflash_local.server.engine import Engine
from dflash_local.server.openai_api import Shape

NAMES = [WEATHER]
HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris"}'
)  # <|call|> is a stop token: the reply ends before it
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>It is sunny, say so.<|end|><|start|>assistant<|channel|>final<|message|>"
    "18 C and sunny in Paris."
)
GEMMA4_CALL = (
    "<|channel>thought\nI need the weather.<channel|>"
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{metric:true,tags:[<|"|>a, b<|"|>,null]}}'
    "<tool_call|>"
)  # <|tool_response> is a stop token


def config(template: str) -> dict:
    return {"chat_template": (TEMPLATES / template).read_text()}


@pytest.mark.parametrize(
    "template, family",
    [
        ("openai-gpt-oss-120b.jinja", HARMONY),
        ("google-gemma-4-31B-it.jinja", GEMMA4),
        ("Qwen-Qwen3-0.6B.jinja", THINK),
        ("Qwen3.5-4B.jinja", THINK),
        ("Qwen3-Coder.jinja", PLAIN),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", PLAIN),
        ("google-gemma-2-2b-it.jinja", PLAIN),
    ],
)
def test_the_family_is_chosen_from_the_chat_templates_markers(template, family):
    assert reply_family(config(template)) == family


def test_gpt_oss_renders_the_tools_and_the_tool_history_as_harmony():
    text = rendered("openai-gpt-oss-120b.jinja", HISTORY, [WEATHER])
    assert (
        "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: {\ncity: string,\n}) => any;"
        in text
    )
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C, sunny"<|end|>'
        "<|start|>assistant"
    ) in text
    assert text.endswith("<|start|>assistant") and "&lt;" not in text


def test_gemma4_renders_the_tools_and_the_tool_history_itself():
    text = rendered("google-gemma-4-31B-it.jinja", HISTORY, [WEATHER])
    assert '<|tool>declaration:get_weather{description:<|"|>The weather in a city.<|"|>' in text
    assert text.endswith(
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>18 C, sunny<|"|>}<tool_response|>'
    )


@pytest.mark.parametrize(
    "family, text, reasoning, content, calls",
    [
        (HARMONY, HARMONY_CALL, "The user wants the weather; call get_weather.", "", [{"city": "Paris"}]),
        (HARMONY, HARMONY_ANSWER, "It is sunny, say so.", "18 C and sunny in Paris.", []),
        (  # the recipient in the role part of the header, and the stop token written out
            HARMONY,
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
            "",
            "",
            [{"city": "Rome"}],
        ),
        (  # a forced call's grammar writes Hermes-style JSON, no harmony header
            HARMONY,
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            "",
            "",
            [{"city": "Oslo"}],
        ),
        (
            GEMMA4,
            GEMMA4_CALL,
            "I need the weather.",
            "",
            [{"city": "Paris", "days": 3, "units": {"metric": True, "tags": ["a, b", None]}}],
        ),
        (
            GEMMA4,
            'Let me look.<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><|tool_response>',
            "",
            "Let me look.",
            [{"city": "Rome"}],
        ),
        (GEMMA4, "<|channel>thought\nShort.<channel|>It is sunny.", "Short.", "It is sunny.", []),
    ],
)
def test_each_familys_reasoning_answer_and_calls_are_read_whole_and_in_every_split(
    family, text, reasoning, content, calls
):
    whole = read_whole(family, NAMES, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert [json.loads(c["function"]["arguments"]) for c in whole.calls] == calls
    assert all(c["function"]["name"] == "get_weather" and c["id"].startswith("call_") for c in whole.calls)
    for size in (1, 2, 3, 7):  # streamed: markers cut anywhere
        parts = read(family, NAMES, [text[at : at + size] for at in range(0, len(text), size)])
        assert "".join(p.reasoning for p in parts) == reasoning
        assert "".join(p.content for p in parts).strip() == content
        assert [json.loads(c["function"]["arguments"]) for p in parts for c in p.calls] == calls


@pytest.mark.parametrize(
    "family, text",
    [
        (HARMONY, "Just text, no channels."),
        (HARMONY, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '),  # cut off
        (HARMONY, "<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}"),  # not declared
        (HARMONY, '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}'),
        (HARMONY, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>["Paris"]'),
        (HARMONY, "<|channel|>final"),  # a header never finished
        (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Par'),  # cut off
        (GEMMA4, "<|tool_call>call:launch{}<tool_call|>"),  # not declared
        (GEMMA4, "<|tool_call>call:get_weather{city:Paris}<tool_call|>"),  # an unquoted string
        (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>} extra<tool_call|>'),
        (GEMMA4, "<|tool_call>get_weather(city='Paris')<tool_call|>"),
    ],
)
def test_a_reply_no_reader_can_read_stays_text(family, text):
    parts = read_whole(family, NAMES, text)
    assert (parts.reasoning, parts.content, parts.calls) == ("", text, [])


def test_gemma4s_markers_are_single_tokens_of_its_real_vocabulary_and_read_back_token_by_token():
    from dflash_local.gguf.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.load(llama_cpp_source() / "models" / "ggml-vocab-gemma-4.gguf")
    for marker in ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'):
        assert tokenizer.token_id(marker) is not None, marker
    ids = tokenizer.encode(GEMMA4_CALL, add_special_tokens=False)
    reply = TextStream(tokenizer, frozenset(), reader=ReplyReader(GEMMA4, NAMES))
    parts = [reply.add([token]) for token in ids] + [reply.finish("stop")[0]]
    assert "".join(p.reasoning for p in parts) == "I need the weather."
    assert [json.loads(c["function"]["arguments"])["city"] for p in parts for c in p.calls] == ["Paris"]


def chunks_of(family: str, pieces: list[str], tools: list[dict] | None) -> list[dict]:
    """The SSE chunks a chat stream writes for these text deltas, for a model of this family."""

    async def events() -> AsyncIterator:
        for parts in read(family, tools, pieces):
            yield parts
        yield ENDING

    async def collect() -> list[str]:
        return [line async for line in Shape("m", chat=True).stream(events())]

    return [json.loads(line.removeprefix("data: ")) for line in asyncio.run(collect())[:-1]]


def test_a_streamed_harmony_reply_sends_reasoning_apart_and_the_call_as_a_tool_calls_delta():
    deltas = [
        c["choices"][0]["delta"] for c in chunks_of(HARMONY, [HARMONY_CALL[i : i + 5] for i in range(0, 200, 5)], NAMES)
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather; call get_weather."
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    answer = chunks_of(HARMONY, [HARMONY_ANSWER], None)  # no tools: the analysis channel is still not the answer
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in answer) == "18 C and sunny in Paris."
    assert answer[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def tiny_models():
    return load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)


@pytest.fixture
def scripted(tiny_models, monkeypatch):
    """An engine of the bundled pair whose chat template is a real family's and whose generation writes the given
    text (the loop replaced: the pair cannot write these formats), for the whole server path."""

    def make(template: str, text: str) -> Engine:
        def stream(models, request):
            ids = models.tokenizer.encode(text, add_special_tokens=False)
            for at in range(0, len(ids), 2):
                yield SimpleNamespace(step=SimpleNamespace(token_ids=ids[at : at + 2]), stats=Stats())

        monkeypatch.setattr(engine_module, "stream", stream)
        monkeypatch.setattr(tiny_models.tokenizer, "config", tiny_models.tokenizer.config | config(template))
        monkeypatch.setattr(tiny_models, "stop_ids", frozenset())  # the pair's <|end|> is no stop token for gpt-oss
        return Engine(tiny_models, 4, None, size=2)

    return make


def test_the_openai_client_reads_a_gpt_oss_call_and_its_reasoning_whole_and_streamed(scripted):
    with serving(scripted("openai-gpt-oss-120b.jinja", HARMONY_CALL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="m", messages=HISTORY[:1], tools=[WEATHER], max_tokens=64)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.model_extra["reasoning_content"] == "The user wants the weather; call get_weather."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        stream = client.chat.completions.create(
            model="m", messages=HISTORY, tools=[WEATHER], max_tokens=64, stream=True
        )
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas).startswith("The user")
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_ollama_client_reads_a_gemma4_call_and_its_thinking(scripted):
    with serving(scripted("google-gemma-4-31B-it.jinja", GEMMA4_CALL)) as url:
        local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        answer = local.chat(model="m", messages=HISTORY[:1], tools=[WEATHER], stream=False)
        assert answer.message.thinking == "I need the weather." and answer.message.content == ""
        assert [c.function.arguments["city"] for c in answer.message.tool_calls] == ["Paris"]
        parts = list(local.chat(model="m", messages=HISTORY[:1], tools=[WEATHER], stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "I need the weather."
        assert parts[-1].done and parts[-1].message.tool_calls[0].function.arguments["days"] == 3
        assert local.show("m").capabilities == ["completion", "tools", "thinking"]


def test_a_reply_the_reader_cannot_read_is_answered_as_text_never_a_500(scripted):
    broken = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{not json"
    with serving(scripted("openai-gpt-oss-120b.jinja", broken)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="m", messages=HISTORY[:1], tools=[WEATHER], max_tokens=64)
        assert answer.choices[0].message.content == broken and answer.choices[0].message.tool_calls is None
        assert answer.choices[0].finish_reason != "tool_calls"  # the scripted loop gives no reason: "length"


def test_ollama_reply_shape_carries_thinking():
    reply = ollama_api.Reply("m", chat=True).whole(read_whole(HARMONY, None, HARMONY_ANSWER), ENDING)
    parsed = ollama.ChatResponse.model_validate(reply)
    assert (parsed.message.thinking, parsed.message.content) == ("It is sunny, say so.", "18 C and sunny in Paris.")


def test_the_reasoning_a_client_sends_back_renders_before_the_call_it_led_to():
    turn = HISTORY[1] | {"reasoning_content": "I should call get_weather."}  # as the reply above gave it
    text = rendered("openai-gpt-oss-120b.jinja", [HISTORY[0], turn, HISTORY[2]], [WEATHER])
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I should call get_weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    ) in text
    gemma = rendered("google-gemma-4-31B-it.jinja", [HISTORY[0], turn, HISTORY[2]], [WEATHER])
    assert (
        "<|turn>model\n<|channel>thought\nI should call get_weather.\n<channel|><|tool_call>call:get_weather" in gemma
    )
    ollama_turn = {"role": "assistant", "content": "", "thinking": "I should call get_weather."} | {
        "tool_calls": HISTORY[1]["tool_calls"]
    }
    assert "analysis<|message|>I should call get_weather." in rendered(
        "openai-gpt-oss-120b.jinja", [HISTORY[0], ollama_turn, HISTORY[2]], [WEATHER]
    )
