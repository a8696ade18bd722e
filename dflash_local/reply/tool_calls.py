"""A model's tool calls read out of its text (Hermes-style `<tool_call>` JSON as Qwen writes it, Qwen3-Coder's
`<tool_call><function=...>` XML, Llama 3.1's bare JSON), also while the text streams."""

from __future__ import annotations

import json
import re
import uuid

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


def tool_names(tools: list[dict]) -> set[str]:
    """The declared functions' names."""
    return {tool["function"]["name"] for tool in tools}


def json_object(value: object) -> dict | None:
    """value as a JSON object: an object as it is, JSON text of one read, else None (the one reading of a call's
    arguments, in requests and replies alike)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def make_call(name: object, arguments: object, names: set[str]) -> dict | None:
    """One OpenAI tool call of a declared function with arguments (an object, or JSON text of one), else None."""
    arguments = json_object(arguments)
    if not isinstance(name, str) or name not in names or arguments is None:
        return None
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


XML_CALL = re.compile(r"<function=([^>\n]+)>\s*(.*?)\s*</function>", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


def _xml_call(text: str, tools: dict[str, dict]) -> dict | None:
    """One OpenAI tool call from Qwen3-Coder's `<function=NAME><parameter=KEY>\nVALUE\n</parameter></function>`: a
    value is text where its parameter is a string (or undeclared and not JSON), else JSON."""
    found = XML_CALL.fullmatch(text)
    if not found or found.group(1).strip() not in tools:
        return None
    name, body, arguments = found.group(1).strip(), found.group(2), {}
    properties = (tools[name].get("parameters") or {}).get("properties") or {}
    at = 0
    while at < len(body):
        parameter = XML_PARAMETER.match(body, at)
        if not parameter:
            return None
        key, value, at = parameter.group(1).strip(), parameter.group(2), parameter.end()
        kind = properties.get(key, {}).get("type") if isinstance(properties.get(key), dict) else None
        if kind != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                if kind is not None:
                    return None
        arguments[key] = value
    return make_call(name, arguments, set(tools))


def _call(text: str, names: set[str], tools: dict[str, dict] | None = None) -> dict | None:
    """One OpenAI tool call from a JSON object {name, arguments | parameters} naming a declared tool, or from
    Qwen3-Coder's XML call (with the declared functions at hand), else None."""
    if text.startswith("<function=") and tools is not None:
        return _xml_call(text, tools)
    found = json_object(text)
    if found is None:
        return None
    return make_call(found.get("name"), found.get("arguments", found.get("parameters", {})), names)


def parse_calls(text: str, names: set[str], tools: dict[str, dict] | None = None) -> tuple[str, list[dict]]:
    """(the text before any call, the calls) when the text holds tool calls that all parse; else (text, []).
    tools: the declared functions by name, for Qwen3-Coder's XML calls (whose values follow their types)."""
    if OPEN in text:
        before, _, rest = text.partition(OPEN)
        blocks = [block.partition(CLOSE) for block in rest.split(OPEN)]
        if all(not after.strip() for _, _, after in blocks):
            calls = [_call(body.strip(), names, tools) for body, _, _ in blocks]
            if all(calls):
                return before.strip(), calls  # type: ignore[return-value]
        return text, []
    bare = text.strip().removeprefix(PYTHON_TAG).strip()
    call = _call(bare, names) if bare.startswith("{") else None
    return ("", [call]) if call else (text, [])


class ToolText:
    """A streamed reply that may hold tool calls: text is sent as it comes, except from where a call begins (a
    `<tool_call>`, or JSON or `<|python_tag|>` at the start), which is kept and read at the end (TextStream holds
    back a tail that may begin a marker, so a marker arrives whole)."""

    MARKERS = (OPEN, PYTHON_TAG)

    def __init__(self, tools: list[dict]) -> None:
        self.names = tool_names(tools)
        self.functions = {tool["function"]["name"]: tool["function"] for tool in tools}
        self.text, self.sent = "", 0

    def add(self, delta: str) -> str:
        """Append delta; return the text that can be sent now."""
        self.text += delta
        lead = self.text.lstrip()
        if self.sent == 0 and (not lead or lead.startswith(("{", PYTHON_TAG))):
            return ""
        at = self.text.find(OPEN, self.sent)
        end = max(at if at >= 0 else len(self.text), self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The rest of the text (when it holds no calls) or the text before them, and the calls."""
        return parse_calls(self.text[self.sent :], self.names, self.functions)
