"""Constrained output asked for by a request, as grammar text the worker compiles: OpenAI's `response_format`
(json_object, json_schema), Ollama's `format` ("json" or a schema) and a forced tool call (`tool_choice` required or
a named function, written as a `<tool_call>` block that tools.parse_calls reads)."""

from __future__ import annotations

from ..errors import DFlashError
from ..grammar import json_schema_grammar
from .protocol import BadRequest
from .tools import CLOSE, OPEN


def _grammar(schema: dict | None, strict: bool, param: str, prefix: str = "", suffix: str = "") -> str:
    """The grammar for one JSON value of schema, or a 400 naming param (as Ollama's error shape has no param field,
    in the message too) when the schema is malformed."""
    try:
        return json_schema_grammar(schema, strict=strict, prefix=prefix, suffix=suffix)
    except DFlashError as exc:
        raise BadRequest(f"'{param}': {exc}", param) from None


def response_format_grammar(body: dict) -> str | None:
    """OpenAI's response_format: None for text (or absent), else the grammar of a JSON object or of the schema."""
    form = body.get("response_format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar(None, True, "response_format")
    if kind != "json_schema":
        raise BadRequest(
            '\'response_format\' must be {"type": "text" | "json_object" | "json_schema"}.', "response_format"
        )
    spec = form.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise BadRequest(
            "'response_format.json_schema' must be {name, schema (an object), strict}.", "response_format.json_schema"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest("'strict' must be true or false.", "response_format.json_schema.strict")
    return _grammar(spec.get("schema", {}), bool(strict), "response_format.json_schema.schema")


def ollama_format_grammar(value: object) -> str | None:
    """Ollama's format: absent or "" for text, "json" for any JSON object, or a JSON schema object."""
    if value in (None, ""):
        return None
    if value == "json":
        return _grammar(None, True, "format")
    if not isinstance(value, dict):
        raise BadRequest("'format' must be \"json\" or a JSON schema object.", "format")
    return _grammar(value, True, "format")


def _call_schema(function: dict) -> dict:
    """A call of one function as JSON: its name, then arguments following its parameters."""
    arguments = function.get("parameters") or {"type": "object"}
    properties = {"name": {"const": function["name"]}, "arguments": arguments}
    return {
        "type": "object",
        "properties": properties,
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_grammar(body: dict, tools: list[dict] | None) -> str | None:
    """tool_choice: None for none or auto; for required (any declared tool) or a named function, the grammar of one
    `<tool_call>` block whose JSON is a valid call. Each function's schema is held strictly only where it says so."""
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        return None
    if not tools:
        raise BadRequest("A required or named tool_choice needs 'tools'.", "tool_choice")
    functions = [tool["function"] for tool in tools]
    if isinstance(choice, dict):
        wanted = choice.get("function") if choice.get("type") == "function" else None
        name = wanted.get("name") if isinstance(wanted, dict) else None
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise BadRequest("'tool_choice' must name a function declared in 'tools'.", "tool_choice")
    elif choice != "required":
        raise BadRequest(
            "'tool_choice' must be none, auto, required or {type: function, function: {name}}.", "tool_choice"
        )
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("A forced tool call cannot also follow a response_format.", "response_format")
    schemas = [_call_schema(function) for function in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    strict = all(function.get("strict") is True for function in functions)
    return _grammar(schema, strict, "tools", prefix=OPEN, suffix=CLOSE)
