"""OpenAI's API: /v1/chat/completions, /v1/completions and /v1/models, their answers whole or as SSE chunks, and usage
built from the loop's Stats."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..reply.channels import Parts
from .constrained import forced_call_grammar, response_format_grammar
from .engine import Ending, Event, Failure
from .images import of_url
from .protocol import error_response, parse_messages, parse_prompt, parse_sampling, parse_thinking
from .request import InnerRequest, Server, dflash_stats, request_job, sse
from .tools import parse_tools


def usage(ending: Ending) -> dict:
    """OpenAI usage (cached_tokens: the prompt's tokens the caches held) plus a `dflash` object: tau, acceptance
    lengths, block sizes, decode tokens/s, prefilled tokens."""
    stats = ending.stats
    return {
        "prompt_tokens": ending.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": ending.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": ending.cached_tokens},
        "dflash": dflash_stats(stats),
    }


def parse_chat(body: dict) -> InnerRequest:
    """A chat completions body as the one internal request: messages, sampling (with any forced call or
    response_format grammar), tools and the thinking switch."""
    messages, sampling, thinking = parse_messages(body, of_url), parse_sampling(body), parse_thinking(body)
    tools = parse_tools(body)
    grammar = forced_call_grammar(body, tools) or response_format_grammar(body)
    return InnerRequest(replace(sampling, grammar=grammar), messages, tools=tools, thinking=thinking)


class Shape:
    """How one OpenAI endpoint writes its answers: whole, or as SSE chunks (with a usage chunk when asked)."""

    media_type = "text/event-stream"

    def __init__(self, model: str, include_usage: bool = False, chat: bool = False) -> None:
        """chat: a chat completion's answers (else a completion's)."""
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return body if usage is None else body | {"usage": usage}

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, headers=headers)

    def whole(self, parts: Parts, ending: Ending) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": parts.content, "finish_reason": ending.finish_reason}
            return self._object("text_completion", [choice], usage(ending))
        finish = ending.finish_reason
        message = {"role": "assistant", "content": parts.content or (None if parts.calls else "")}
        if parts.reasoning:
            message["reasoning_content"] = parts.reasoning  # where llama-server and vLLM put it; clients read it there
        if parts.calls:
            message["tool_calls"], finish = parts.calls, "tool_calls"
        return self._object(
            "chat.completion", [{"index": 0, "message": message, "finish_reason": finish}], usage(ending)
        )

    def chunk(self, text: str | None, finish: str | None = None, usage: dict | None = None) -> dict:
        """A stream chunk: text (None: the opening role chunk of a chat), a finish reason, or (no choices) usage."""
        if usage is not None:
            return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage)
        if not self.chat:
            return self._object("text_completion", [{"index": 0, "text": text or "", "finish_reason": finish}])
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish}])

    def _calls_chunk(self, calls: list[dict]) -> dict:
        """The tool calls as one delta (each with its index, as OpenAI streams them)."""
        delta = {"tool_calls": [{"index": index} | call for index, call in enumerate(calls)]}
        return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": None}])

    def _parts(self, parts: Parts) -> list[str]:
        """The chunks of a reply's reasoning and answer text (a reasoning_content delta, then a content delta)."""
        chunks = []
        if parts.reasoning:
            delta = {"reasoning_content": parts.reasoning}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            chunks.append(sse(self._object("chat.completion.chunk", [choice])))
        if parts.content:
            chunks.append(sse(self.chunk(parts.content)))
        return chunks

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        """SSE chunks: the chat's role chunk, each text (a chat's reasoning apart; tool calls as deltas at the end),
        the finish reason, usage if asked, then [DONE]."""
        calls: list[dict] = []
        if self.chat:
            yield sse(self.chunk(None))
        async for event in events:
            if isinstance(event, Failure):
                yield sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": None}})
            elif isinstance(event, Parts):
                calls += event.calls
                for chunk in self._parts(event):
                    yield chunk
            else:
                if calls:
                    yield sse(self._calls_chunk(calls))
                yield sse(self.chunk("", "tool_calls" if calls else event.finish_reason))
                if self.include_usage:
                    yield sse(self.chunk(None, usage=usage(event)))
        yield sse("[DONE]")


def routes(server: Server) -> list[Route]:
    """The OpenAI endpoints over the server's engine."""
    engine, model = server.engine, server.model

    async def chat(request: Request, body: dict) -> Response:
        asked = parse_chat(body)
        shape = Shape(model, asked.sampling.include_usage, chat=True)
        return await server.answer(request, request_job(engine, asked), shape)

    async def completions(request: Request, body: dict) -> Response:
        sampling = replace(parse_sampling(body), grammar=response_format_grammar(body))
        job = request_job(engine, InnerRequest(sampling, prompt=parse_prompt(body)))
        return await server.answer(request, job, Shape(model, sampling.include_usage))

    async def models(request: Request, body: None) -> Response:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "dflash-local"}
        return JSONResponse({"object": "list", "data": [card]})

    return [
        Route("/v1/chat/completions", server.endpoint(chat), methods=["POST"]),
        Route("/v1/completions", server.endpoint(completions), methods=["POST"]),
        Route("/v1/models", server.endpoint(models), methods=["GET"]),
    ]
