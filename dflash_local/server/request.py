"""The one inside shape of a request, whichever of the six endpoints brought it (OpenAI's chat completions,
completions and Responses, Anthropic's Messages, Ollama's /api/chat and /api/generate), and its exchange with the
engine: the key check and the JSON body, the one job that renders it, queued, and its events collected into one answer
or streamed in the API's shape (a client that goes away cancels its job)."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import InitVar, dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat_template import render_chat, takes_tools
from ..decode import Stats
from ..generation import LoadedModels
from ..reply.channels import PLAIN, Parts, collected
from .engine import Ending, Engine, Event, Failure, Job
from .hardening import RETRY_AFTER_S, Limits, read_json
from .images import IMAGES, Image
from .protocol import Refused, Sampling
from .tools import conversation

SYSTEM_ROLES = ("system", "developer")
BUSY = "The server is busy: the request queue is full (--max-queue); retry later."
NO_KEY = "Missing or wrong API key: send it as Authorization: Bearer KEY (or x-api-key: KEY)."


@dataclass(frozen=True)
class InnerRequest:
    """A request inside, from any of the six endpoints: chat messages in OpenAI's shape (tool calls' arguments as
    objects; every system turn joined into one at the start) or a raw prompt, with its checked sampling, function
    tools and thinking switch."""

    sampling: Sampling  # with any grammar
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # text or token ids, encoded as it is (no template)
    tools: list[dict] | None = None  # OpenAI function tools (None: none)
    thinking: bool | None = None  # None: the server's default
    plain: bool = False  # the reply read as it is, not as the model's family writes it (a raw prompt's always is)
    system: InitVar[str] = ""  # the API's own system text (Anthropic's system, Responses' instructions, Ollama's)
    images: tuple[Image, ...] = ()  # the user turns' images in order, one media marker each in their text

    def __post_init__(self, system: str) -> None:
        """The messages' system turns, whichever API sent them, put the one way (one_system); their images taken
        out of them, in order."""
        if self.messages is not None:
            messages = one_system(self.messages, system)
            images = tuple(image for message in messages for image in message.pop(IMAGES, ()))
            object.__setattr__(self, "messages", messages)
            object.__setattr__(self, "images", images)


def request_job(engine: Engine, request: InnerRequest, count_only: bool = False) -> Job:
    """The job that renders the request (a raw prompt as it is, messages through the chat template and its tools)
    and reads its reply (count_only: only counts the prompt's tokens)."""

    def render(models: LoadedModels) -> list[int] | str:
        prompt = request.prompt
        if prompt is not None:
            return models.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        enable = engine.thinking if request.thinking is None else request.thinking
        config = models.tokenizer.config
        turns, shown = conversation(request.messages or [], request.tools, takes_tools(config))
        if request.images:  # the text, its markers where the images go (the engine's projector splits it)
            return render_chat(config, turns, True, enable, shown)
        return models.tokenizer.encode_chat(turns, True, enable, shown)

    family = PLAIN if request.plain or request.prompt is not None else engine.family
    loop = asyncio.get_running_loop()
    tools, images = request.tools, request.images
    return Job(render, request.sampling, loop, family=family, tools=tools, count_only=count_only, images=images)


def one_system(messages: list[dict[str, Any]], system: str = "") -> list[dict[str, Any]]:
    """The messages with `system` and every system or developer turn, wherever it stands, joined into one system
    message at the start (most templates take a system message only there)."""
    texts = [system] if system else []
    texts += [m["content"] for m in messages if m["role"] in SYSTEM_ROLES and m["content"]]
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    return ([{"role": "system", "content": "\n\n".join(texts)}] if texts else []) + rest


class Reply(Protocol):
    """How an API writes a job's answer: an error, the whole answer, or a stream of lines."""

    media_type: str

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response: ...

    def whole(self, parts: Parts, ending: Ending) -> dict: ...

    def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]: ...


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(job: Job, disconnect: asyncio.Future) -> Event | None:
    """The job's next event, or None (and the job cancelled) if the client disconnects first."""
    event = asyncio.ensure_future(job.events.get())
    await asyncio.wait({event, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if event.done():
        return event.result()
    event.cancel()
    job.cancelled.set()
    return None


async def _events(job: Job, first: Event) -> AsyncIterator[Event]:
    """first, then the job's events up to its Ending or Failure; leaving early (the client went away) cancels it."""
    try:
        event = first
        yield event
        while isinstance(event, Parts):
            event = await job.events.get()
            yield event
    finally:
        job.cancelled.set()  # no effect once the job is done


class Server:
    """The app's state: the engine, the model's name, the optional API key and the limits."""

    def __init__(self, engine: Engine, model: str, api_key: str | None, limits: Limits) -> None:
        self.engine, self.model, self.api_key, self.limits = engine, model, api_key, limits

    def authorized(self, request: Request) -> bool:
        """Authorization: Bearer KEY (the scheme in any case) or x-api-key: KEY (Anthropic's), compared in constant
        time."""
        if self.api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        return bool(given) and hmac.compare_digest(given.encode(), self.api_key.encode())

    def endpoint(
        self,
        handler: Callable[[Request, dict | None], Awaitable[Response]],
        refusal: Callable[[Refused], Response] = Refused.response,
    ) -> Callable[[Request], Awaitable[Response]]:
        """Check the API key, read a POST's JSON body, and turn a refusal into its error response."""

        async def endpoint(request: Request) -> Response:
            try:
                if not self.authorized(request):
                    raise Refused(401, NO_KEY, code="invalid_api_key")
                body = await read_json(request, self.limits) if request.method == "POST" else None
                return await handler(request, body)
            except Refused as exc:
                return refusal(exc)

        return endpoint

    async def answer(self, request: Request, job: Job, reply: Reply) -> Response:
        """Queue the job, wait for its first event, then stream or collect the rest."""
        if not self.engine.submit(job):
            return reply.error(429, BUSY, headers={"Retry-After": str(RETRY_AFTER_S)})
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            event = await _next_event(job, disconnect)
            if isinstance(event, Parts) and job.sampling.stream:
                return StreamingResponse(reply.stream(_events(job, event)), media_type=reply.media_type)
            parts = Parts()
            while isinstance(event, Parts):
                parts += event
                event = await _next_event(job, disconnect)
            if event is None:
                return Response(status_code=499)  # the client closed the request (nginx's code); it never sees this
            if isinstance(event, Failure):
                return reply.error(event.status, event.message)
            return JSONResponse(reply.whole(collected(parts), event))
        finally:
            disconnect.cancel()


def sse(data: dict | str) -> str:
    """One server-sent event's data (JSON unless text)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_event(kind: str, body: dict) -> str:
    """One named server-sent event, its data the body with its type (as Anthropic's and the Responses streams
    write them)."""
    return f"event: {kind}\n" + sse({"type": kind} | body)


def dflash_stats(stats: Stats) -> dict:
    """The decode loop's own numbers, as every API's usage carries them: tau, acceptance lengths, block sizes,
    decode tokens/s, prefilled tokens, and the accepted tokens by draft source."""
    return {
        "tau": stats.tau,
        "acceptance_lengths": stats.acceptance_lengths,
        "block_sizes": stats.block_sizes,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "prefill_tokens": stats.prefill_tokens,
        "tokens_by_source": stats.tokens_by_source,
    }


REASONING, TEXT = "reasoning", "text"
Step = tuple[str, int, str, Any]  # "open", "delta", "close" or "call"; the block's index; its kind; text or call


class Blocks:
    """A streamed reply as numbered blocks, as Anthropic's and OpenAI's Responses streams write them: reasoning and
    text blocks opened, extended and closed as parts come, each tool call a block of its own."""

    def __init__(self) -> None:
        self.index, self.kind, self.text = -1, "", ""

    def add(self, parts: Parts) -> Iterator[Step]:
        """The steps for one part of the reply."""
        for kind, text in ((REASONING, parts.reasoning), (TEXT, parts.content)):
            if text:
                if self.kind != kind:
                    yield from self.close()
                    self.index, self.kind, self.text = self.index + 1, kind, ""
                    yield ("open", self.index, kind, "")
                self.text += text
                yield ("delta", self.index, kind, text)
        for call in parts.calls:
            yield from self.close()
            self.index += 1
            yield ("call", self.index, "call", call)

    def close(self) -> Iterator[Step]:
        """Close the open block, if any (its whole text with it)."""
        if self.kind:
            yield ("close", self.index, self.kind, self.text)
        self.kind, self.text = "", ""
