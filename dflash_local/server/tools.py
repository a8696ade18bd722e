"""Tool calling's request side: the request's `tools` checked and the conversation put the way the chat template takes
it (its own tool rendering, else a generic tool prompt); reply.tool_calls reads the calls back."""

from __future__ import annotations

import json
from typing import Any

from ..reply.tool_calls import CLOSE, NAME, OPEN
from .protocol import BadRequest

GENERIC_PROMPT = (
    "You can call these tools (each a JSON object: the function's name, description and JSON Schema parameters):\n"
    "{tools}\n"
    'To call a tool, answer with only <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call>, one block '
    "per call; a tool's result comes back in <tool_response></tool_response>. Otherwise answer as usual."
)


def parse_tools(body: dict) -> list[dict] | None:
    """The request's function tools (None: no tools, or tool_choice "none"), each checked and named in a 400."""
    tools = body.get("tools")
    if tools in (None, []) or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools.", "tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise BadRequest('Each tool must be {"type": "function", "function": {...}}.', where)
        if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
            raise BadRequest("A function's name must be 1 to 64 letters, digits, _, . or -.", f"{where}.function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise BadRequest("A function's parameters must be a JSON Schema object.", f"{where}.function.parameters")
        if not isinstance(function.get("description", ""), str):
            raise BadRequest("A function's description must be a string.", f"{where}.function.description")
    return tools


def conversation(
    messages: list[dict[str, Any]], tools: list[dict] | None, template_takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and tools as the chat template takes them: as they are where it renders tools itself (or none
    are involved), else the generic conversation and no tools."""
    involved = tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if template_takes_tools or not involved:
        return messages, tools
    return generic_conversation(messages, tools), None


def generic_conversation(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
    """For a template that takes no tools: the tool prompt before the first user turn's text, calls and results
    written as text, and turns of the same role joined (such templates often allow only alternating turns)."""
    plain: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        for call in message.get("tool_calls") or []:
            text = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            content = f"{content}\n{OPEN}{text}{CLOSE}".lstrip("\n")
        if plain and plain[-1]["role"] == role:
            plain[-1] = {"role": role, "content": f"{plain[-1]['content']}\n\n{content}"}
        else:
            plain.append({"role": role, "content": content})
    first = next((m for m in plain if m["role"] == "user"), None)
    if tools and first is not None:
        lines = "\n".join(json.dumps(tool["function"]) for tool in tools)
        first["content"] = f"{GENERIC_PROMPT.format(tools=lines)}\n\n{first['content']}"
    return plain
