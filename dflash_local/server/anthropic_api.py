"""Anthropic's Messages API (what Claude Code speaks): POST /v1/messages and /v1/messages/count_tokens, the content
blocks (text, tool_use, tool_result, thinking) translated to the one chat request inside, the answer as a message or
as Anthropic's stream of events, and every error in Anthropic's shape."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..reply.channels import Parts
from ..sampling import SamplingParams
from .constrained import forced_call_grammar
from .engine import Ending, Event, Failure, Job
from .images import MEDIA_MARKER, Image, attach, decoded, of_url
from .protocol import BadRequest, Refused, Sampling, flag, number, reasoned, stop_strings, tool_call, whole
from .request import REASONING, Blocks, InnerRequest, Server, Step, dflash_stats, request_job, sse_event
from .tools import parse_tools

log = logging.getLogger("dflash.serve")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request system block (cc_version=...; ...)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Anthropic's error body, {"type": "error", "error": {"type", "message"}} (another 4xx is an
    invalid_request_error, another 5xx an api_error); a full queue is its 529 overloaded."""
    status = 529 if status == 429 else status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def refusal(exc: Refused) -> Response:
    """A refusal in Anthropic's error shape (the field it names, if any, in the message)."""
    message = str(exc) if exc.param is None or exc.param in str(exc) else f"{exc.param}: {exc}"
    return error_response(exc.status, message, exc.headers())


def _text(content: object, where: str) -> str:
    """A text field: a string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        if any(b.get("type") == "image" or b.get("type") == "document" for b in content):
            raise BadRequest("Only text content is supported (no images or documents).", where)
        return "".join(b["text"] for b in content if b.get("type") == "text" and isinstance(b.get("text"), str))
    raise BadRequest("Content must be a string or a list of content blocks.", where)


def _blocks(message: dict, where: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise BadRequest("A message's content must be a string or a list of content blocks.", f"{where}.content")
    return content


def _turns(message: dict, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat turns: tool results as tool turns, tool_use blocks as tool calls, thinking as
    the assistant's reasoning; blocks of other types (server tools' results, redacted thinking) are left out."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant", "system"):
        raise BadRequest("Each message must be an object with role user or assistant.", where)
    turns, texts, calls, reasoning, images = [], [], [], "", []
    for index, block in enumerate(_blocks(message, where)):
        kind, at = block.get("type"), f"{where}.content[{index}]"
        if kind == "text":
            texts.append(_text([block], at))
        elif kind == "image" and role == "user":
            images.append(_image(block.get("source"), f"{at}.source"))
            texts.append(MEDIA_MARKER)
        elif kind in ("image", "document"):
            raise BadRequest("Only text content is supported (no images or documents).", at)
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise BadRequest("A tool_result needs its tool_use_id.", at)
            result = _text(block.get("content", ""), f"{at}.content")
            turns.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind == "tool_use" and role == "assistant":
            message = "A tool_use block must be {id, name, input (an object)}."
            calls.append(tool_call(block.get("id", ""), block.get("name"), block.get("input", {}), message, at))
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning += block["thinking"]
    if texts or calls or not turns:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(attach(reasoned(turn, reasoning), images))
    return turns


def _image(source: object, where: str) -> Image:
    """An image block's source: {type: base64, data} (checked), or {type: url, url}."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return decoded(source.get("data"), f"{where}.data")
    if kind == "url":
        return of_url(source.get("url"), f"{where}.url")
    raise BadRequest("An image's source must be {type: base64, media_type, data} or {type: url, url}.", where)


def _tools(body: dict) -> list[dict] | None:
    """Anthropic's client tools as OpenAI function tools (server tools, which have a type, are left out)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of {name, description, input_schema}.", "tools")
    functions = []
    for tool in tools:
        if tool.get("type") not in (None, "custom"):
            log.debug("ignored a server tool: %s", tool.get("type"))
            continue
        schema = tool.get("input_schema", {"type": "object"})
        function = {"name": tool.get("name"), "description": tool.get("description", ""), "parameters": schema}
        functions.append({"type": "function", "function": function})
    return functions


def _without_billing(system: object) -> object:
    """The system blocks without Claude Code's billing header (a text block it sends first, changing with every
    request: at the prompt's start it would defeat the prompt cache; vLLM, ollama and llama-server drop it too)."""
    if not isinstance(system, list):
        return system
    return [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]


def _tool_choice(body: dict) -> object:
    """tool_choice in OpenAI's words: auto, required (any), a named function (tool), or none."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise BadRequest("'tool_choice' must be {type: auto | any | none} or {type: tool, name}.", "tool_choice")


def _thinking(body: dict) -> bool | None:
    """The thinking parameter as the template's switch: enabled on, disabled off, adaptive or absent the default."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("'thinking' must be {type: enabled | disabled | adaptive}.", "thinking")
    return {"enabled": True, "disabled": False, "adaptive": None}[kind]


def parse_request(body: dict) -> InnerRequest:
    """A Messages request as the request inside (unknown fields ignored)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    turns = [turn for index, m in enumerate(messages) for turn in _turns(m, f"messages[{index}]")]
    system = _text(_without_billing(body.get("system") or ""), "system")
    choice = _tool_choice(body)
    tools = parse_tools({"tools": _tools(body), "tool_choice": choice})
    sampling = Sampling(
        max_tokens=whole(body, "max_tokens", 1, 2**31 - 1),
        params=SamplingParams(
            number(body, "temperature", 1.0, 0.0, 1.0),
            number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
            whole(body, "top_k", 0, 2**31 - 1) or 0,
        ),
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
        stream=flag(body, "stream"),
        grammar=forced_call_grammar({"tool_choice": choice}, tools),
    )
    return InnerRequest(sampling, turns, tools=tools, system=system, thinking=_thinking(body))


def _content(parts: Parts) -> list[dict]:
    """The content blocks of a whole reply: thinking, text, then the tool calls."""
    blocks: list[dict] = []
    if parts.reasoning:
        blocks.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
    if parts.content:
        blocks.append({"type": "text", "text": parts.content})
    blocks += [_tool_use(call) for call in parts.calls]
    return blocks


def _tool_use(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block."""
    function, named = call["function"], f"toolu_{call['id'].removeprefix('call_')}"
    return {"type": "tool_use", "id": named, "name": function["name"], "input": json.loads(function["arguments"])}


class Reply:
    """How /v1/messages writes a job's answer: one message, or Anthropic's events (message_start, the content
    blocks' start, deltas and stop, message_delta with the stop reason and usage, message_stop)."""

    media_type = "text/event-stream"

    def __init__(self, model: str, job: Job) -> None:
        self.model, self.job = model, job
        self.id = f"msg_{uuid.uuid4().hex}"

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, headers)

    def _message(self, content: list[dict], stop: str | None, sequence: str | None, usage: dict) -> dict:
        head = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}
        return head | {"stop_reason": stop, "stop_sequence": sequence, "usage": usage}

    def whole(self, parts: Parts, ending: Ending) -> dict:
        return self._message(_content(parts), *_stop(parts.calls, ending), _usage(ending))

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        usage = _counts(self.job.prompt_tokens, self.job.cached_tokens) | {"output_tokens": 0}
        yield sse_event("message_start", {"message": self._message([], None, None, usage)})
        yield sse_event("ping", {})
        blocks, calls = Blocks(), []
        async for event in events:
            if isinstance(event, Parts):
                calls += event.calls
                for step in blocks.add(event):
                    yield _from_step(step)
            elif isinstance(event, Failure):
                yield sse_event("error", {"error": {"type": "api_error", "message": event.message}})
            else:
                for step in blocks.close():
                    yield _from_step(step)
                stop, sequence = _stop(calls, event)
                delta = {"delta": {"stop_reason": stop, "stop_sequence": sequence}, "usage": _usage(event)}
                yield sse_event("message_delta", delta)
                yield sse_event("message_stop", {})


def _from_step(step: Step) -> str:
    """One block step as Anthropic's events (a tool call: its block's start, its input as one delta, its stop)."""
    action, index, kind, value = step
    thinking = kind == REASONING
    if action == "open":
        block = {"type": "thinking", "thinking": "", "signature": ""} if thinking else {"type": "text", "text": ""}
        return sse_event("content_block_start", {"index": index, "content_block": block})
    if action == "delta":
        delta = {"type": "thinking_delta", "thinking": value} if thinking else {"type": "text_delta", "text": value}
        return sse_event("content_block_delta", {"index": index, "delta": delta})
    if action == "close":
        return sse_event("content_block_stop", {"index": index})
    block = _tool_use(value)
    start = {"index": index, "content_block": block | {"input": {}}}
    delta = {"index": index, "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
    return (
        sse_event("content_block_start", start)
        + sse_event("content_block_delta", delta)
        + sse_event("content_block_stop", {"index": index})
    )


def _stop(calls: list[dict], ending: Ending) -> tuple[str, str | None]:
    """The stop reason (tool_use, stop_sequence, end_turn or max_tokens) and the stop sequence that ended it."""
    if calls:
        return "tool_use", None
    if ending.stop_sequence is not None:
        return "stop_sequence", ending.stop_sequence
    return STOP_REASONS[ending.finish_reason], None


def _counts(prompt_tokens: int, cached: int) -> dict:
    """Anthropic's input counts: input_tokens are those prefilled, cache_read_input_tokens those the caches held."""
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _usage(ending: Ending) -> dict:
    """Anthropic's usage, with the DFlash loop's numbers beside it."""
    counts = _counts(ending.prompt_tokens, ending.cached_tokens) | {"output_tokens": ending.stats.new_tokens}
    return counts | {"dflash": dflash_stats(ending.stats)}


def routes(server: Server) -> list[Route]:
    """The Messages endpoints over the server's engine (the model is the one served, whatever name a request gives)."""
    engine, model = server.engine, server.model

    async def messages(request: Request, body: dict) -> Response:
        chat = parse_request(body)
        job = request_job(engine, chat)
        return await server.answer(request, job, Reply(model, job))

    async def count_tokens(request: Request, body: dict) -> Response:
        body = body | {"max_tokens": 1, "stream": False}
        chat = parse_request(body)
        job = request_job(engine, chat, count_only=True)
        return await server.answer(request, job, Counted(model))

    return [
        Route("/v1/messages", server.endpoint(messages, refusal), methods=["POST"]),
        Route("/v1/messages/count_tokens", server.endpoint(count_tokens, refusal), methods=["POST"]),
    ]


class Counted:
    """count_tokens' answer: the rendered prompt's length (never streamed)."""

    media_type = "application/json"

    def __init__(self, model: str) -> None:
        self.model = model

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, headers)

    def whole(self, parts: Parts, ending: Ending) -> dict:
        return {"input_tokens": ending.prompt_tokens}
