"""Ollama's native API beside OpenAI's: /api/version, /api/tags, /api/show, /api/chat and /api/generate (NDJSON
streaming, the options clients send), for clients that speak only Ollama's API."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..chat_template import uses_thinking
from ..reply.channels import PLAIN, Parts
from ..sampling import SamplingParams
from .constrained import ollama_format_grammar
from .engine import Ending, Event, Failure
from .images import IMAGES, MEDIA_MARKER, decoded
from .protocol import BadRequest, Refused, Sampling, flag, number, parse_messages, stop_strings, whole
from .request import InnerRequest, Server, request_job
from .tools import parse_tools

log = logging.getLogger("dflash.serve")

API_VERSION = "0.12.0"  # the Ollama release whose API these routes follow (clients gate features on it)
OPTIONS = {"num_predict", "temperature", "top_p", "top_k", "seed", "stop"}
REFUSED = {"suffix": "'suffix'"}
REFUSED |= {"context": "'context' token lists"}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Ollama's error body: {"error": sentence}."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def refusal(exc: Refused) -> Response:
    """A refusal in Ollama's error shape."""
    return error_response(exc.status, str(exc), exc.headers())


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def parse_options(body: dict) -> Sampling:
    """stream (true unless false) and options.num_predict/temperature/top_p/top_k/seed/stop, with Ollama's defaults;
    other options are ignored with a debug log, and what cannot be honoured is refused by name."""
    for name, what in REFUSED.items():
        if body.get(name) not in (None, [], ""):
            raise BadRequest(f"{what} cannot be honoured by dflash serve.", name)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object.", "options")
    if set(options) - OPTIONS:
        log.debug("ignored Ollama options: %s", ", ".join(sorted(set(options) - OPTIONS)))
    predict = whole(options, "num_predict", -2, 2**31 - 1)
    seed = whole(options, "seed", -(2**63), 2**64 - 1)
    top_p = number(options, "top_p", 0.9, 0.0, 1.0) or 1.0  # Ollama reads top_p 0 as no truncation
    top_k = whole(options, "top_k", 0, 2**31 - 1)
    params = SamplingParams(number(options, "temperature", 0.8, 0.0, 2.0), top_p, 40 if top_k is None else top_k)
    return Sampling(
        max_tokens=predict if predict and predict > 0 else None,  # -1 and -2: up to the context
        params=params,
        seed=seed if seed is not None and seed >= 0 else None,
        stop=stop_strings(options.get("stop"), "options.stop"),
        stream=body.get("stream") is None or flag(body, "stream"),
        grammar=ollama_format_grammar(body.get("format")),
    )


def parse_chat(body: dict) -> InnerRequest:
    """An /api/chat body as the one internal request: the messages, options, tools and the think switch."""
    messages, sampling, tools = parse_messages(body), parse_options(body), parse_tools(body)
    for index, (given, message) in enumerate(zip(body["messages"], messages, strict=True)):
        with_images(message, given.get("images"), f"messages[{index}].images")
    think = body.get("think")
    if think is not None and not isinstance(think, bool):
        raise BadRequest("'think' must be true or false.", "think")
    return InnerRequest(sampling, messages, tools=tools, thinking=think)


def with_images(message: dict, images: object, where: str) -> dict:
    """A parsed user message with Ollama's images (a list of base64 strings) before its text, as media markers."""
    if images is None or images == []:
        return message
    if not isinstance(images, list) or message["role"] != "user":
        raise BadRequest("'images' must be a list of base64 strings, in user messages.", where)
    message[IMAGES] = [decoded(image, f"{where}[{index}]") for index, image in enumerate(images)]
    message["content"] = MEDIA_MARKER * len(images) + message["content"]
    return message


class Reply:
    """How /api/chat and /api/generate write a job's answer: one object, or NDJSON lines ending with done: true."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool = False) -> None:
        """chat: /api/chat's answer (else /api/generate's)."""
        self.chat, self.model = chat, model
        self.started = time.monotonic()

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, headers)

    def piece(self, text: str, done: bool = False, calls: list[dict] | None = None, thinking: str = "") -> dict:
        """One line: text (a chat's message, else the response), with its reasoning and tool calls in Ollama's
        shape."""
        body = {"model": self.model, "created_at": _now()}
        if not self.chat:
            return body | {"response": text, "done": done}
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            functions = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls
            ]
            message["tool_calls"] = [{"function": function} for function in functions]
        return body | {"message": message, "done": done}

    def whole(self, parts: Parts, ending: Ending) -> dict:
        return self._last(parts, ending)

    def _last(self, parts: Parts, ending: Ending) -> dict:
        """The last line: done, why, the counts and the durations in nanoseconds."""
        stats = ending.stats
        return self.piece(parts.content, True, parts.calls, parts.reasoning) | {
            "done_reason": ending.finish_reason,
            "total_duration": int((time.monotonic() - self.started) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": ending.prompt_tokens,
            "prompt_eval_duration": int(stats.prefill_s * 1e9),
            "eval_count": stats.new_tokens,
            "eval_duration": int(stats.decode_s * 1e9),
        }

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        """NDJSON lines: each text (a chat's reasoning as thinking; tool calls held back and sent with the last
        line), then the last line."""
        calls: list[dict] = []
        async for event in events:
            if isinstance(event, Parts):
                if event.content or event.reasoning:
                    yield json.dumps(self.piece(event.content, thinking=event.reasoning)) + "\n"
                calls += event.calls
            elif isinstance(event, Failure):
                yield json.dumps({"error": event.message}) + "\n"
            else:
                yield json.dumps(self._last(Parts(calls=calls), event)) + "\n"


DETAILS = {"format": "", "family": "dflash", "families": ["dflash"], "parameter_size": "", "quantization_level": ""}


def routes(server: Server) -> list[Route]:
    """The Ollama endpoints over the server's engine (the model is the one served, whatever name a request gives)."""
    engine, model = server.engine, server.model
    thinks = engine.family != PLAIN or uses_thinking(engine.models.tokenizer.config)
    capabilities = ["completion", "tools"] + (["thinking"] if thinks else [])  # tools: the template's or generic

    async def chat(request: Request, body: dict) -> Response:
        return await server.answer(request, request_job(engine, parse_chat(body)), Reply(model, chat=True))

    async def generate(request: Request, body: dict) -> Response:
        prompt, system, sampling = body.get("prompt") or "", body.get("system") or "", parse_options(body)
        if not isinstance(prompt, str) or not isinstance(system, str):
            raise BadRequest("'prompt' and 'system' must be strings.", "prompt")
        if not prompt:  # Ollama's way to load a model: nothing to generate
            return JSONResponse(Reply(model).piece("", True) | {"done_reason": "load"})
        if flag(body, "raw"):
            if body.get("images"):
                raise BadRequest("'images' need the chat template: send them without raw.", "images")
            asked = InnerRequest(sampling, prompt=prompt)
        else:  # the chat template's, its reply read as it is
            turn = with_images({"role": "user", "content": prompt}, body.get("images"), "images")
            asked = InnerRequest(sampling, [turn], plain=True, system=system)
        return await server.answer(request, request_job(engine, asked), Reply(model))

    async def tags(request: Request, body: None) -> Response:
        card = {"name": model, "model": model, "modified_at": _now(), "size": 0, "digest": "", "details": DETAILS}
        return JSONResponse({"models": [card]})

    async def show(request: Request, body: dict) -> Response:
        info = {"general.architecture": "dflash", "dflash.context_length": engine.models.target.max_context}
        card = {"modelfile": "", "parameters": "", "template": "", "details": DETAILS, "model_info": info}
        return JSONResponse(card | {"capabilities": capabilities, "modified_at": _now()})

    async def version(request: Request, body: None) -> Response:
        return JSONResponse({"version": API_VERSION})

    async def root(request: Request) -> Response:
        return PlainTextResponse("Ollama is running")  # what Ollama answers; front-ends probe it

    return [
        Route("/", root, methods=["GET"]),
        Route("/api/version", server.endpoint(version, refusal), methods=["GET"]),
        Route("/api/tags", server.endpoint(tags, refusal), methods=["GET"]),
        Route("/api/show", server.endpoint(show, refusal), methods=["POST"]),
        Route("/api/chat", server.endpoint(chat, refusal), methods=["POST"]),
        Route("/api/generate", server.endpoint(generate, refusal), methods=["POST"]),
    ]
