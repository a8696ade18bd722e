"""OpenAI's Responses API (what Codex CLI speaks): POST /v1/responses, stateless (nothing is stored, so a
previous_response_id is refused), its input items translated to the one chat request inside, and the answer as a
response object or as the Responses stream of events, in OpenAI's error shape."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..reply.channels import Parts
from ..sampling import SamplingParams
from .constrained import forced_call_grammar, response_format_grammar
from .engine import Ending, Event, Failure
from .images import MEDIA_MARKER, attach, of_url
from .protocol import BadRequest, Sampling, error_response, flag, number, reasoned, tool_call, top_p, whole
from .request import REASONING, Blocks, InnerRequest, Server, Step, dflash_stats, request_job, sse_event
from .tools import parse_tools

log = logging.getLogger("dflash.serve")

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
NO_STATE = "'previous_response_id' cannot be honoured: dflash serve keeps no responses; send the whole conversation."
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def _text(content: object, where: str, images: list | None = None) -> str:
    """An item's content: a string, or its text parts joined (input_image parts, where images is a list, as media
    markers, their images put into it; files and audio refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for index, part in enumerate(content):
            kind = part.get("type")
            if kind == "input_image" and images is not None:
                url = part.get("image_url")
                if isinstance(part.get("file_id"), str) and url is None:
                    raise BadRequest("An input_image by file_id needs the Files API; send its image_url.", where)
                images.append(of_url(url, f"{where}[{index}].image_url"))
                texts.append(MEDIA_MARKER)
            elif kind in ("input_image", "input_file", "input_audio"):
                raise BadRequest("Only text and (in user messages) image input is supported.", where)
            elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "".join(texts)
    raise BadRequest("Content must be a string or a list of text parts.", where)


def _messages(body: dict) -> list[dict[str, Any]]:
    """`input` (a string, or message, function_call, function_call_output and reasoning items) as chat turns; items
    of other kinds (server tools' calls) are left out."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a non-empty string or list of items.", "input")
    turns: list[dict[str, Any]] = []
    reasoning = ""
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest("A message item's role must be user, assistant, system or developer.", where)
            images: list | None = [] if role == "user" else None
            turn = {"role": role, "content": _text(item.get("content"), f"{where}.content", images)}
            turns.append(attach(turn, images or []))
        elif kind == "function_call":
            call = _call(item, where)
            last = turns[-1] if turns else None
            if last is None or last["role"] != "assistant" or last.get("tool_calls") is None:
                last = {"role": "assistant", "content": "", "tool_calls": []}
                turns.append(last)
            last["tool_calls"].append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest("A function_call_output needs its call_id.", where)
            output = _text(item.get("output", ""), f"{where}.output")
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            reasoning += _text(item.get("content") or item.get("summary") or [], f"{where}.summary")
            continue
        elif kind == "item_reference":
            raise BadRequest(NO_STATE, where)
        elif kind is None:
            raise BadRequest("Each input item must be an object.", where)
        else:
            log.debug("ignored an input item of type %s", kind)
            continue
        reasoned(turns[-1], reasoning)
        reasoning = ""
    return turns


def _call(item: dict, where: str) -> dict:
    """A function_call item as a chat tool call (arguments as an object)."""
    message = "A function_call must be {call_id, name, arguments (a JSON object, as text)}."
    return tool_call(item.get("call_id", ""), item.get("name"), item.get("arguments", "{}"), message, where)


def _tools(body: dict) -> tuple[list[dict] | None, object]:
    """The function tools (other kinds, which run on OpenAI's side, are left out) and tool_choice, both in chat
    completions' words."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of tools.", "tools")
    functions = []
    for tool in tools or []:
        if tool.get("type") != "function":
            log.debug("ignored a tool of type %s", tool.get("type"))
            continue
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        functions.append({"type": "function", "function": function})
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return functions, choice


def _format(body: dict) -> dict:
    """text.format in chat completions' words (response_format)."""
    text = body.get("text") or {}
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return {}
    if not isinstance(form, dict):
        raise BadRequest("'text.format' must be an object.", "text.format")
    if form.get("type") != "json_schema":
        return {"response_format": form}
    spec = {key: form[key] for key in ("name", "schema", "strict") if key in form}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _thinking(body: dict) -> bool | None:
    """reasoning.effort as the template's thinking switch: none or minimal off, low and above on."""
    reasoning = body.get("reasoning") or {}
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}.", "reasoning.effort")
    return None if effort is None else EFFORTS[effort]


def parse_request(body: dict) -> InnerRequest:
    """A Responses request as the request inside (unknown fields ignored)."""
    if body.get("previous_response_id") is not None:
        raise BadRequest(NO_STATE, "previous_response_id")
    instructions = body.get("instructions") or ""
    if not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", "instructions")
    tools, choice = _tools(body)
    checked = parse_tools({"tools": tools, "tool_choice": choice})
    asked = {"tool_choice": choice} | _format(body)
    sampling = Sampling(
        max_tokens=whole(body, "max_output_tokens", 1, 2**31 - 1),
        params=SamplingParams(number(body, "temperature", 1.0, 0.0, 2.0), top_p(body)),
        stream=flag(body, "stream"),
        grammar=forced_call_grammar(asked, checked) or response_format_grammar(asked),
    )
    return InnerRequest(sampling, _messages(body), tools=checked, thinking=_thinking(body), system=instructions)


def _call_item(call: dict, status: str = "completed") -> dict:
    """A chat tool call as a function_call item."""
    function = call["function"]
    item = {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"]}
    return item | {"name": function["name"], "arguments": function["arguments"], "status": status}


class Reply:
    """How /v1/responses writes a job's answer: one response object, or the Responses events (created, in_progress,
    each output item added, its deltas and done, completed with usage)."""

    media_type = "text/event-stream"

    def __init__(self, model: str) -> None:
        self.model = model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.sequence = 0

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, headers=headers)

    def _response(self, status: str, output: list[dict], ending: Ending | None = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status} | {
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
        }
        if ending is not None:
            body["usage"] = _usage(ending)
            if ending.finish_reason == "length" and not any(i["type"] == "function_call" for i in output):
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body

    def _item(self, kind: str, index: int, text: str) -> dict:
        """A finished reasoning or message item of this text."""
        if kind == REASONING:
            content = [{"type": "reasoning_text", "text": text}]
            return {"type": "reasoning", "id": f"rs_{self.id[5:]}_{index}", "summary": [], "content": content}
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": f"msg_{self.id[5:]}_{index}", "status": "completed", "role": "assistant"}
        return item | {"content": [part]}

    def whole(self, parts: Parts, ending: Ending) -> dict:
        output = []
        for index, (kind, value) in enumerate(((REASONING, parts.reasoning), ("text", parts.content))):
            if value:
                output.append(self._item(kind, index, value))
        output += [_call_item(call) for call in parts.calls]
        return self._response("completed", output, ending)

    def _emit(self, kind: str, body: dict) -> str:
        self.sequence += 1
        return sse_event(kind, body | {"sequence_number": self.sequence})

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        yield self._emit("response.created", {"response": self._response("in_progress", [])})
        yield self._emit("response.in_progress", {"response": self._response("in_progress", [])})
        blocks, output = Blocks(), []
        async for event in events:
            if isinstance(event, Parts):
                for step in blocks.add(event):
                    yield self._step(step, output)
            elif isinstance(event, Failure):
                failed = self._response("failed", output) | {
                    "error": {"code": "server_error", "message": event.message}
                }
                yield self._emit("response.failed", {"response": failed})
            else:
                for step in blocks.close():
                    yield self._step(step, output)
                done = self._response("completed", output, event)
                yield self._emit(f"response.{done['status']}", {"response": done})

    def _step(self, step: Step, output: list[dict]) -> str:
        """One block step as Responses events; finished items join output."""
        action, index, kind, value = step
        item_id = self._item(kind, index, "")["id"] if action != "call" else None
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if action == "open":
            item = self._item(kind, index, "") | {"status": "in_progress", "content": []}
            text = self._emit("response.output_item.added", {"output_index": index, "item": item})
            if kind != REASONING:
                part = {"type": "output_text", "text": "", "annotations": []}
                text += self._emit("response.content_part.added", where | {"part": part})
            return text
        if action == "delta":
            name = "response.reasoning_text.delta" if kind == REASONING else "response.output_text.delta"
            return self._emit(name, where | {"delta": value} | ({} if kind == REASONING else {"logprobs": []}))
        if action == "close":
            item = self._item(kind, index, value)
            output.append(item)
            name = "response.reasoning_text.done" if kind == REASONING else "response.output_text.done"
            text = self._emit(name, where | {"text": value})
            if kind != REASONING:
                text += self._emit("response.content_part.done", where | {"part": item["content"][0]})
            return text + self._emit("response.output_item.done", {"output_index": index, "item": item})
        item = _call_item(value)
        output.append(item)
        at = {"item_id": item["id"], "output_index": index}
        return (
            self._emit("response.output_item.added", {"output_index": index, "item": item | {"arguments": ""}})
            + self._emit("response.function_call_arguments.delta", at | {"delta": item["arguments"]})
            + self._emit("response.function_call_arguments.done", at | {"arguments": item["arguments"]})
            + self._emit("response.output_item.done", {"output_index": index, "item": item})
        )


def _usage(ending: Ending) -> dict:
    """The Responses usage, with the DFlash loop's numbers beside it."""
    stats = ending.stats
    return {
        "input_tokens": ending.prompt_tokens,
        "input_tokens_details": {"cached_tokens": ending.cached_tokens},
        "output_tokens": stats.new_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": ending.prompt_tokens + stats.new_tokens,
        "dflash": dflash_stats(stats),
    }


def routes(server: Server) -> list[Route]:
    """The Responses endpoint over the server's engine (the model is the one served, whatever name a request gives)."""
    engine, model = server.engine, server.model

    async def responses(request: Request, body: dict) -> Response:
        chat = parse_request(body)
        job = request_job(engine, chat)
        return await server.answer(request, job, Reply(model))

    return [Route("/v1/responses", server.endpoint(responses), methods=["POST"])]
