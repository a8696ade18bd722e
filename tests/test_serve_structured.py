"""Constrained output through `dflash serve`: OpenAI's response_format (json_object, json_schema, the openai client's
`.parse()` with a pydantic model), forced tool calls (tool_choice required or a named function), Ollama's `format`,
and a malformed schema or tool list answered 400 naming the field. The served answers equal the engine's own
constrained plain decoding (no drafter) of the same grammar, so DFlash changes nothing but speed."""

from __future__ import annotations

import json
import time
from typing import Literal

import ollama
import openai
import pytest
from pydantic import BaseModel, Field
from test_serve_clients import KEY, TINY, serving

from dflash_local.decode import Settings
from dflash_local.generation import GenerationRequest, load_models, run_request
from dflash_local.grammar import compile_grammar, json_schema_grammar
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.constrained import forced_call_grammar
from dflash_local.server.engine import Engine
from dflash_local.server.tools import CLOSE, OPEN, conversation

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["kind", "age", "name"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 5}, "exact": {"type": "boolean"}},
            "required": ["word", "exact"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=6)


@pytest.fixture(scope="module")
def engine() -> Engine:
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)
    return Engine(models, 4, None, size=4)


@pytest.fixture(scope="module")
def client(engine):
    with serving(engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120), url


def plain_constrained(engine: Engine, messages: list[dict], grammar_text: str) -> str:
    """The engine's constrained plain decoding (no drafter, greedy) of the chat, less the end-of-sequence text the
    server holds back: the text DFlash must equal."""
    models = engine.models
    grammar = compile_grammar(grammar_text, models.tokenizer, models.target.vocab_size, models.stop_ids)
    ids = models.tokenizer.encode_chat(messages, True, None)
    settings = Settings(max_new_tokens=100, draft=False, stop_ids=models.stop_ids, grammar=grammar)
    text = run_request(models, GenerationRequest(ids, settings))["text"]
    return next((text.removesuffix(eos) for eos in engine.eos_texts if text.endswith(eos)), text)


def test_a_json_schema_answer_follows_its_schema_and_equals_plain_constrained_decoding(client, engine):
    openai_client, _ = client
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    answer = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=100, response_format=form
    )
    content = answer.choices[0].message.content
    Pet.model_validate_json(content)
    assert answer.choices[0].finish_reason == "stop"
    assert content == plain_constrained(engine, MESSAGES, json_schema_grammar(PET))


def test_the_openai_clients_parse_with_a_pydantic_model_and_json_object(client):
    openai_client, _ = client
    parsed = openai_client.chat.completions.parse(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=100, response_format=Pet
    )
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    answers = [
        openai_client.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=1, seed=seed, max_tokens=40,
            response_format={"type": "json_object"},
        ).choices[0]
        for seed in range(8)
    ]  # fmt: skip
    closed = [answer.message.content for answer in answers if answer.finish_reason == "stop"]
    assert closed and all(isinstance(json.loads(content), dict) for content in closed)  # the rest ran out of tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_forced_tool_call_always_parses_whole_and_streamed(client, engine, choice):
    openai_client, _ = client
    ask = {"model": "tiny", "messages": MESSAGES, "tools": [LOOKUP, CLOCK], "tool_choice": choice, "max_tokens": 100}
    for temperature in (0, 1):
        answer = openai_client.chat.completions.create(**ask, temperature=temperature, seed=1)
        calls = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert calls[0].function.name in (("lookup", "clock") if choice == "required" else ("lookup",))
        assert isinstance(json.loads(calls[0].function.arguments), dict)
    chunks = list(openai_client.chat.completions.create(**ask, temperature=0, stream=True))
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(deltas) == 1
    grammar = forced_call_grammar({"tool_choice": choice}, [LOOKUP, CLOCK])
    turns, _ = conversation(MESSAGES, [LOOKUP, CLOCK], False)  # the tiny template takes no tools: the generic prompt
    expected = plain_constrained(engine, turns, grammar)
    assert expected.startswith(OPEN) and expected.endswith(CLOSE)
    assert json.loads(expected.removeprefix(OPEN).removesuffix(CLOSE))["name"] == deltas[0].function.name


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format.json_schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [LOOKUP], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [LOOKUP], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"type": "nonsense"}}}, "strict": True}}], "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_a_malformed_schema_or_tool_choice_is_a_400_naming_the_field(client, extra, param):
    openai_client, _ = client
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **extra)
    assert caught.value.param == param and caught.value.type == "invalid_request_error"


def test_ollamas_format_takes_json_and_a_schema(client):
    _, url = client
    local = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    options = {"temperature": 0, "num_predict": 100}
    answer = local.chat(model="tiny", messages=MESSAGES, format=PET, options=options)
    Pet.model_validate_json(answer.message.content)
    sampled = [{"temperature": 1, "seed": seed, "num_predict": 40} for seed in range(6)]
    generated = [local.generate(model="tiny", prompt="A pet:", format="json", options=o) for o in sampled]
    closed = [answer.response for answer in generated if answer.done_reason == "stop"]
    assert closed and all(isinstance(json.loads(response), dict) for response in closed)  # the rest ran out of tokens
    with pytest.raises(ollama.ResponseError) as caught:
        local.chat(model="tiny", messages=MESSAGES, format={"type": 3}, options=options)
    assert caught.value.status_code == 400 and "'format'" in caught.value.error


def test_the_grammar_tokenizer_is_built_when_the_server_starts_not_at_the_first_json_request(monkeypatch):
    from dflash_local import grammar
    from dflash_local.server.protocol import Sampling

    builds = []
    build = grammar._build_lltokenizer
    monkeypatch.setattr(grammar, "_build_lltokenizer", lambda *args: builds.append(args) or build(*args))
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)
    engine = Engine(models, 4, None, size=2)  # a fresh tokenizer: nothing cached for it yet
    deadline = time.monotonic() + 60
    while not builds:
        assert time.monotonic() < deadline, "the server built no grammar tokenizer at start"
        time.sleep(0.01)
    settings = engine.settings(Sampling(grammar=json_schema_grammar(None)), 5)  # the first json request's compile
    assert settings.grammar is not None and len(builds) == 1
