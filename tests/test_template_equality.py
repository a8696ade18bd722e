"""Every catalog family's real chat template (llama.cpp's vendored copies), rendered by dflash and by transformers'
apply_chat_template in the oracle venv, with tools and thinking: the two texts must be equal."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from reference import oracle_python
from test_architectures import llama_cpp_source

from dflash_local.chat_template import render_chat, uses_thinking
from dflash_local.server.protocol import parse_messages

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny" / "target"
BOS, EOS = "<s>", "</s>"
FAMILIES = {  # catalog family: its template in llama.cpp's models/templates/ (tiny: the bundled tokenizer_config's)
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3.5": "Qwen3.5-4B.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja",
    "gemma2": "google-gemma-2-2b-it.jinja",
    "tiny": None,
}
NO_TOOLS = {"gemma2", "tiny"}  # templates without a tool role: chat only
CHAT = [
    {"role": "user", "content": 'Un café "crème" & <b>deux</b>, s\'il vous plaît?'},
    {
        "role": "assistant",
        "content": "Voilà.\n\n  Indented — and trailing  ",
        "reasoning_content": "They ask; I serve.",
    },
    {"role": "user", "content": "Merci!\n"},
]
SYSTEM = {"role": "system", "content": "You are terse. Today is {{ not a tag }}."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
CALLED = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21, "sky": "clear"}'},
]


def template(family: str) -> str:
    name = FAMILIES[family]
    if name is None:
        return json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    folder = llama_cpp_source() / "models" / "templates"
    assert folder.is_dir(), f"./install.sh --dev unpacks llama.cpp's chat templates into {folder}"
    return (folder / name).read_text()


def cases() -> list[tuple[str, str, dict]]:
    """(family, what, case): each family's template with chat turns, a system turn, tools with a call and its result,
    and thinking on and off where the template reads it; messages as dflash's server hands them to templates."""
    found = []
    for family in FAMILIES:
        source = template(family)
        conversations = {"chat": CHAT} if family in NO_TOOLS else {"chat": CHAT, "system": [SYSTEM, *CHAT]}
        for what, messages in conversations.items():
            found.append((family, what, {"messages": messages, "tools": None, "kwargs": {}}))
        if family not in NO_TOOLS:
            found.append((family, "tools", {"messages": [SYSTEM, *CALLED], "tools": TOOLS, "kwargs": {}}))
        if uses_thinking({"chat_template": source}):
            for on in (True, False):
                kwargs = {"enable_thinking": on}
                found.append((family, f"thinking={on}", {"messages": CHAT, "tools": TOOLS, "kwargs": kwargs}))
    for family, _, case in found:
        case["messages"] = parse_messages({"messages": case["messages"]})
        case["template"] = template(family)
        case["kwargs"] |= {"bos_token": BOS, "eos_token": EOS}
    return found


CASES = cases()


@pytest.fixture(scope="module")
def oracle() -> list:
    """transformers' rendering of every case, in one oracle process."""
    payload = json.dumps([case for _, _, case in CASES])
    command = [oracle_python(), Path(__file__).parent / "template_oracle.py", TINY]
    done = subprocess.run(command, input=payload, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{family}-{what}" for family, what, _ in CASES])
def test_dflash_renders_as_transformers(oracle, index):
    family, what, case = CASES[index]
    expected = oracle[index]
    assert isinstance(expected, str), expected  # transformers renders every case: the inputs are the template's own
    config = {"chat_template": case["template"], "bos_token": BOS, "eos_token": EOS}
    thinking = case["kwargs"].get("enable_thinking")
    assert render_chat(config, case["messages"], True, thinking, case["tools"]) == expected
