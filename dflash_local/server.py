"""`dflash serve`: an OpenAI-compatible HTTP API over one loaded model (starlette + uvicorn).

The engine decodes one sequence at a time, so requests wait in a bounded queue, in arrival order, for the one worker
thread that renders prompts and runs generations; the event loop only parses, queues and streams. A client that goes
away cancels its generation at the next step (its on_text callback raises), and whatever one request raises becomes
that request's error response, never the server's end. What a client may hold is bounded (Limits: body bytes, seconds
for headers and body, open connections), and every refusal, down to malformed HTTP, has OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import h11
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn import Config
from uvicorn import Server as Uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .decode import Settings
from .errors import DFlashError
from .generation import GenerationRequest, LoadedModels, StopGeneration, run_request
from .sampling import SamplingParams

log = logging.getLogger("dflash.serve")

RETRY_AFTER_S = 5
MAX_STOPS = 4
PATHS = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models and GET /health"


@dataclass(frozen=True)
class Limits:
    """What one client may hold: body bytes, seconds to send its headers and then its body, open connections."""

    max_body: int = 4 * 2**20
    read_timeout: float = 30.0
    max_connections: int = 100


class Refused(Exception):
    """A request answered with an HTTP error in the OpenAI shape before it reaches the engine."""

    def __init__(self, status: int, message: str, param: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.param, self.close = status, param, close

    def response(self) -> JSONResponse:
        headers = {"Connection": "close"} if self.close else None
        return error_response(self.status, str(self), param=self.param, headers=headers)


class BadRequest(Refused):
    """A request the API refuses: HTTP 400 with the OpenAI error shape, naming the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param)


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Sampling:
    """The generation fields of a request, checked: the loop's sampling parameters and what only HTTP has (stop
    strings, streaming, usage); the worker makes them the loop's Settings."""

    max_tokens: int | None = None
    params: SamplingParams = SamplingParams(temperature=1.0)  # OpenAI's default temperature
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number from {low:g} to {high:g}, got {json.dumps(value)}.", name)
    return float(value)


def _whole(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a whole number from {low} to {high}, got {json.dumps(value)}.", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, got {json.dumps(value)}.", name)
    return value


NO_TOOLS = "dflash serve does not call tools"
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "tools": ((None, []), f"'tools' cannot be honoured: {NO_TOOLS}."),
    "functions": ((None, []), f"'functions' cannot be honoured: {NO_TOOLS}."),
    "tool_choice": ((None, "none", "auto"), f"'tool_choice' must be none or auto: {NO_TOOLS}."),
    "function_call": ((None, "none", "auto"), f"'function_call' must be none or auto: {NO_TOOLS}."),
    "response_format": ((None, {"type": "text"}), 'Only response_format {"type": "text"} is supported.'),
    "n": ((None, 1), "Only n = 1 is supported: the engine decodes one sequence at a time."),
    "best_of": ((None, 1), "Only best_of = 1 is supported: the engine decodes one sequence at a time."),
    "logprobs": ((None, False), "'logprobs' is not supported by dflash serve."),
    "top_logprobs": ((None, 0), "'top_logprobs' is not supported by dflash serve."),
    "echo": ((None, False), "'echo' is not supported by dflash serve."),
    "suffix": ((None, ""), "'suffix' is not supported by dflash serve."),
}


def refuse_unsupported(body: dict) -> None:
    """A 400 naming the first field that asks for what this server cannot do, instead of a 200 that ignores it."""
    for name, (allowed, message) in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise BadRequest(message, name)


def parse_sampling(body: dict) -> Sampling:
    """temperature, top_p, max_tokens (or max_completion_tokens), stop, seed, stream, stream_options, ignore_eos."""
    refuse_unsupported(body)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings.", "stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    return Sampling(
        max_tokens=_whole(body, limit, 1, 2**31 - 1),
        params=SamplingParams(_number(body, "temperature", 1.0, 0.0, 2.0), _top_p(body)),
        seed=_whole(body, "seed", 0, 2**64 - 1),
        stop=tuple(stops),
        stream=_flag(body, "stream"),
        include_usage=_flag(options or {}, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
    )


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("'top_p' must be more than 0 and at most 1, got 0.", "top_p")
    return top_p


def _content(message: dict, index: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise BadRequest("Only text content parts are supported.", f"messages[{index}].content")
        return "".join(p["text"] for p in content)
    raise BadRequest("A message's content must be a string or a list of text parts.", f"messages[{index}].content")


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The chat messages as the template takes them: role and content strings."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("Each message must be an object with a 'role' string.", f"messages[{index}]")
        parsed.append({"role": message["role"], "content": _content(message, index)})
    return parsed


def parse_thinking(body: dict) -> bool | None:
    """chat_template_kwargs.enable_thinking (as vLLM and SGLang take it), if the request sets it."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("'enable_thinking' must be true or false.", "chat_template_kwargs.enable_thinking")
    return thinking


def parse_prompt(body: dict) -> str | list[int]:
    """A completions prompt: text, a list of one text, or token ids (a list of integers, or a list of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt")


class StopCutter:
    """Streams generated text while holding back any tail that may begin a stop string; cuts at the first one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit: str | None = None

    def add(self, delta: str) -> str:
        """Append delta; return the text now safe to send (nothing after a stop string is ever sent)."""
        if self.hit is not None:
            return ""
        self.text += delta
        found = [(self.text.find(s, max(0, self.sent - len(s))), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.hit = min(found)
            self.text = self.text[:at]
            return self.flush()
        unsent = len(self.text) - self.sent  # only unsent text can be held back, so a long stop string costs no more
        stops = ((s, range(1, min(len(s), unsent + 1))) for s in self.stops)
        keep = max((n for s, sizes in stops for n in sizes if self.text.endswith(s[:n])), default=0)
        end = max(self.sent, len(self.text) - keep)
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        """The text held back so far (at the end of a generation)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Cancelled(Exception):
    """Raised from on_text when the client has gone away: ends the generation at that step."""


class StopStringReached(StopGeneration):
    """Raised from on_text when the text reached a stop string of the request: ends the generation there."""


class QueueFull(Exception):
    """The bounded request queue has no room."""


@dataclass
class Job:
    """One request's way through the worker: how to get its prompt ids, its sampling, and events back to the loop."""

    prompt: Callable[[LoadedModels], list[int]]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value: object) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Engine:
    """The one worker thread and its bounded, first-come-first-served queue of jobs."""

    def __init__(
        self,
        models: LoadedModels,
        block_size: int | None,
        max_new_tokens: int | None,
        size: int,
        thinking: bool | None = None,
    ) -> None:
        if models.tokenizer is None:
            raise DFlashError("The model has no tokenizer (tokenizer.json), so it cannot be served.")
        self.models = models
        self.block_size = block_size
        self.max_new_tokens = max_new_tokens
        self.thinking = thinking  # the drafter's thinking mode: what chat templates render unless a request says
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=size)
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.busy = False
        self.eos_texts = tuple(t for t in (models.tokenizer.decode([i]) for i in sorted(models.stop_ids)) if t)
        threading.Thread(target=self._work, name="dflash-generation", daemon=True).start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                continue
            self.busy = True
            try:
                self._serve(job)
            finally:
                self.busy = False

    def _serve(self, job: Job) -> None:
        """Render, generate and report one job; every exception ends as this job's error event."""
        started, sampling = False, job.sampling
        stops = sampling.stop + (() if sampling.ignore_eos else self.eos_texts)
        cutter = StopCutter(stops)

        def on_text(delta: str) -> None:
            nonlocal started
            if job.cancelled.is_set():
                raise Cancelled
            text = cutter.add(delta)
            if text or not started:
                job.emit("text", text)
            started = True
            if cutter.hit in sampling.stop:
                raise StopStringReached

        try:
            ids = job.prompt(self.models)
            room = self.models.target.max_context - len(ids)
            settings = Settings(
                max_new_tokens=sampling.max_tokens or self.max_new_tokens or max(room, 1),
                sampling=sampling.params,
                block_size=self.block_size,
                draft=self.models.drafter is not None,
                stop_ids=self.models.stops(sampling.ignore_eos),
                seed=sampling.seed,
            )
            result = run_request(self.models, GenerationRequest(ids, settings), on_text)
            job.emit("text", cutter.flush())
            job.emit("done", self._ending(ids, result, cutter))
            self.counts["served"] += 1
        except Cancelled:
            self.counts["cancelled"] += 1
        except DFlashError as exc:
            self.counts["failed"] += 1
            job.emit("error", (500 if started else 400, str(exc)))
        except Exception as exc:  # one request's failure is its own error response, never the server's end
            self.counts["failed"] += 1
            log.exception("generation failed")
            job.emit("error", (500, f"The generation failed ({type(exc).__name__}: {exc})."))

    def _ending(self, ids: list[int], result: dict, cutter: StopCutter) -> dict:
        """finish_reason and usage (a generation cut at a stop string counts the tokens it made up to that step)."""
        finish = "stop" if cutter.hit is not None or result["finish_reason"] == "stop" else "length"
        return {"finish_reason": finish, "usage": _usage(len(ids), result["new_tokens"], result)}


def _usage(prompt_tokens: int, completion_tokens: int, result: dict) -> dict:
    """OpenAI usage plus a `dflash` object: tau, acceptance lengths, block sizes, decode tokens/s, prefilled tokens."""
    keys = ("tau", "acceptance_lengths", "block_sizes", "decode_tokens_per_s", "prefill_tokens")
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "dflash": {key: result[key] for key in keys},
    }


class Shape:
    """How one endpoint writes its answers: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return body if usage is None else body | {"usage": usage}

    def whole(self, text: str, finish: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return self._object("chat.completion", [choice], usage)
        return self._object("text_completion", [{"index": 0, "text": text, "finish_reason": finish}], usage)

    def chunk(self, text: str | None, finish: str | None = None, usage: dict | None = None) -> dict:
        """A stream chunk: text (None: the opening role chunk of a chat), a finish reason, or (no choices) usage."""
        if usage is not None:
            return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage)
        if not self.chat:
            return self._object("text_completion", [{"index": 0, "text": text or "", "finish_reason": finish}])
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish}])


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _next_event(job: Job, disconnect: asyncio.Future) -> tuple[str, object] | None:
    """The job's next event, or None (and the job cancelled) if the client disconnects first."""
    event = asyncio.ensure_future(job.events.get())
    await asyncio.wait({event, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if event.done():
        return event.result()
    event.cancel()
    job.cancelled.set()
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The app's state: the engine, the model's name and the optional API key."""

    def __init__(self, engine: Engine, model: str, api_key: str | None, limits: Limits) -> None:
        self.engine, self.model, self.api_key, self.limits = engine, model, api_key, limits

    def authorized(self, request: Request) -> bool:
        """Authorization: Bearer KEY (the scheme in any case), the key compared in constant time."""
        if self.api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())

    async def answer(self, request: Request, job: Job, shape: Shape) -> Response:
        """Queue the job, wait for its first text, then stream or collect the rest."""
        try:
            self.engine.submit(job)
        except QueueFull:
            message = "The server is busy: the request queue is full; retry later."
            return error_response(503, message, "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            event = await _next_event(job, disconnect)
            if event is None or event[0] == "error":
                return _failure(event)
            if job.sampling.stream:
                return StreamingResponse(_stream(job, shape, event[1]), media_type="text/event-stream")
            texts = [event[1]]
            while (event := await _next_event(job, disconnect)) is not None and event[0] == "text":
                texts.append(event[1])
            if event is None or event[0] == "error":
                return _failure(event)
            return JSONResponse(shape.whole("".join(texts), event[1]["finish_reason"], event[1]["usage"]))
        finally:
            disconnect.cancel()


def _failure(event: tuple[str, object] | None) -> Response:
    if event is None:
        return Response(status_code=499)  # the client closed the request (nginx's code); it never sees this
    status, message = event[1]
    return error_response(status, message, "invalid_request_error" if status == 400 else "server_error")


async def _stream(job: Job, shape: Shape, first: str) -> AsyncIterator[str]:
    """SSE chunks until the job ends; leaving early (the client went away) cancels the job."""
    try:
        if shape.chat:
            yield _sse(shape.chunk(None))
        if first:
            yield _sse(shape.chunk(first))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                if value:
                    yield _sse(shape.chunk(value))
                continue
            if kind == "error":
                yield _sse({"error": {"message": value[1], "type": "server_error", "param": None, "code": None}})
            else:
                yield _sse(shape.chunk("", value["finish_reason"]))
                if job.sampling.include_usage:
                    yield _sse(shape.chunk(None, usage=value["usage"]))
            break
        yield _sse("[DONE]")
    finally:
        job.cancelled.set()  # no effect once the job is done


async def _read(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as its declared or received size passes limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        message = f"The request body is {int(declared)} bytes, over the {limit}-byte limit (--max-body)."
        raise Refused(413, message, close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"The request body is over the {limit}-byte limit (--max-body).", close=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> None:
    raise BadRequest(f"{name} is not a JSON number.")


async def read_json(request: Request, limits: Limits) -> dict:
    """The body as a JSON object, or a Refused error that says why not (encoding, size, time, syntax, depth, limits)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise Refused(415, f"Content-Encoding {encoding} is not supported: send the body uncompressed.", close=True)
    try:
        raw = await asyncio.wait_for(_read(request, limits.max_body), limits.read_timeout)
    except TimeoutError:
        message = f"The request body did not arrive within {limits.read_timeout:g} s (--read-timeout)."
        raise Refused(408, message, close=True) from None
    except ClientDisconnect:
        raise Refused(400, "The client went away before its body was whole.", close=True) from None
    try:
        body = json.loads(raw, parse_constant=_no_constant)
        json.dumps(body, ensure_ascii=False).encode()  # every string must be text: no lone UTF-16 surrogate
    except json.JSONDecodeError:
        raise BadRequest("The request body is not valid JSON.") from None
    except UnicodeDecodeError:
        raise BadRequest("The request body is not UTF-8 (nor UTF-16 or UTF-32) text.") from None
    except UnicodeEncodeError:
        raise BadRequest("The request body has a string with a lone UTF-16 surrogate (\\ud800-\\udfff).") from None
    except RecursionError:
        raise BadRequest("The request body nests arrays or objects too deeply.") from None
    except ValueError:  # Python's int-string limit
        digits = sys.get_int_max_str_digits()
        raise BadRequest(f"The request body has an integer of more than {digits} digits.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _endpoint(server: Server, handler: Callable[[Request, dict], Awaitable[Response]]):
    """Check the API key, read the JSON body, and turn a refusal into its error response."""

    async def endpoint(request: Request) -> Response:
        if not server.authorized(request):
            message = "Missing or wrong API key: send it as Authorization: Bearer KEY."
            return error_response(401, message, code="invalid_api_key")
        try:
            body = await read_json(request, server.limits) if request.method == "POST" else None
            return await handler(request, body)
        except Refused as exc:
            return exc.response()

    return endpoint


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such path, wrong method) in the OpenAI shape."""
    where = f"{request.method} {request.url.path}"
    messages = {
        404: f"Invalid URL ({where}): this server answers {PATHS}.",
        405: f"{where} is not allowed: use {(exc.headers or {}).get('Allow', '')}.",
    }
    return error_response(exc.status_code, messages.get(exc.status_code, exc.detail), headers=exc.headers)


def _server_error(request: Request, exc: Exception) -> Response:
    """A bug's answer: a 500 in the OpenAI shape (uvicorn logs the traceback)."""
    return error_response(500, f"The server failed ({type(exc).__name__}: {exc}).", "server_error")


def create_app(engine: Engine, model: str, api_key: str | None = None, limits: Limits = Limits()) -> Starlette:
    """The Starlette app: /v1/chat/completions, /v1/completions, /v1/models and /health."""
    server = Server(engine, model, api_key, limits)

    async def chat(request: Request, body: dict) -> Response:
        messages, sampling, thinking = parse_messages(body), parse_sampling(body), parse_thinking(body)

        def render(models: LoadedModels) -> list[int]:
            enable = engine.thinking if thinking is None else thinking
            return models.tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=enable)

        return await server.answer(request, Job(render, sampling, asyncio.get_running_loop()), Shape(True, model))

    async def completions(request: Request, body: dict) -> Response:
        prompt, sampling = parse_prompt(body), parse_sampling(body)

        def encode(models: LoadedModels) -> list[int]:
            return models.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        return await server.answer(request, Job(encode, sampling, asyncio.get_running_loop()), Shape(False, model))

    async def models(request: Request, body: None) -> Response:
        card = {"id": model, "object": "model", "created": 0, "owned_by": "dflash-local"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        state = {"status": "ok", "model": model, "busy": engine.busy, "queued": engine.jobs.qsize()}
        return JSONResponse(state | engine.counts)

    routes = [
        Route("/v1/chat/completions", _endpoint(server, chat), methods=["POST"]),
        Route("/v1/completions", _endpoint(server, completions), methods=["POST"]),
        Route("/v1/models", _endpoint(server, models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.router.redirect_slashes = False  # /v1/models/ is a 404, not a redirect
    return app


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server listens beyond this machine without an API key."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"warning: listening on {host} without --api-key: anyone who can reach this machine can use the model; "
        "set --api-key (or DFLASH_API_KEY) to require it."
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or one sentence saying why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise DFlashError(f"Cannot listen on {host} ({exc.strerror}).") from None
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise DFlashError(f"Cannot listen on {host}:{port} ({os.strerror(exc.errno)}).") from None


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection with a deadline for each request's headers, a cap on open connections, and the
    errors it answers itself (malformed HTTP, late headers, too many connections) in the OpenAI shape."""

    limits = Limits()
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections(self.limits.max_connections)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.deadline is not None:
            self.deadline.cancel()  # the request's headers are whole
            self.deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.limits.read_timeout, self._headers_late)

    def _headers_late(self) -> None:
        """Close a connection whose request headers did not arrive in time (with a 408 if it began one)."""
        self.deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            timeout = self.limits.read_timeout
            self._answer(408, f"The request headers did not arrive within {timeout:g} s (--read-timeout).")
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._answer(400, "The request is not valid HTTP/1.1 (or its headers are over 16 KiB).")
        self.transport.close()

    def _answer(self, status: int, message: str) -> None:
        """An error response written before (or instead of) the app, then the connection closes."""
        response = error_response(status, message, headers={"Connection": "close"})
        try:
            for event in (
                h11.Response(status_code=status, headers=response.raw_headers, reason=STATUS_PHRASES[status]),
                h11.Data(data=response.body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had begun already: only closing is left
            pass


def _too_many_connections(cap: int) -> JSONResponse:
    """The app every request of a connection over the cap gets: 503, Retry-After, and the connection closed."""
    message = f"The server has its {cap} connections open (--max-connections); retry later."
    headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
    return error_response(503, message, "server_error", headers=headers)


def uvicorn_server(app: Starlette, limits: Limits = Limits()) -> Uvicorn:
    """uvicorn over app with the limits' connection protocol (warnings and errors logged, no access log)."""
    protocol = type("BoundedH11", (BoundedH11,), {"limits": limits})
    return Uvicorn(Config(app, http=protocol, log_level="warning", access_log=False))


def run_server(app: Starlette, sock: socket.socket, limits: Limits = Limits()) -> None:
    """Serve app on the socket until Ctrl-C."""
    uvicorn_server(app, limits).run(sockets=[sock])
