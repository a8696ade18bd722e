"""One request's exchange with the engine, for any API: the key check, the JSON body, the job queued, its events
collected into one answer or streamed, and a client that goes away cancelling its job."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..reply.channels import Parts, collected
from .engine import Ending, Engine, Event, Failure, Job
from .hardening import RETRY_AFTER_S, Limits, read_json
from .protocol import Refused

BUSY = "The server is busy: the request queue is full (--max-queue); retry later."
NO_KEY = "Missing or wrong API key: send it as Authorization: Bearer KEY (or x-api-key: KEY)."


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
