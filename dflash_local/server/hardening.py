"""What a client may hold, bounded: body bytes and seconds, header seconds and bytes, open connections; bodies read as
JSON with one sentence for each way they can be unusable; the listening socket and uvicorn's connection protocol.

uvicorn's settings bound what they can (the header bytes h11 buffers, the idle keep-alive time); what no setting
offers (a deadline for a request's headers, a connection cap answered in the OpenAI shape, malformed HTTP answered in
it, a lingering close) overrides H11Protocol's methods: tests/test_server_internals.py checks each internal it uses."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import sys
from dataclasses import dataclass

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp
from uvicorn import Config
from uvicorn import Server as Uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from ..defaults import MAX_BODY, MAX_CONNECTIONS, READ_TIMEOUT_S
from ..errors import DFlashError
from .protocol import BadRequest, Refused, error_response

RETRY_AFTER_S = 5
MAX_HEADER_BYTES = 16 * 2**10  # of an unfinished request head (uvicorn's h11_max_incomplete_event_size)


@dataclass(frozen=True)
class Limits:
    """What one client may hold: body bytes, seconds to send its headers and then its body, open connections."""

    max_body: int = MAX_BODY
    read_timeout: float = READ_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


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


class LingeringClose:
    """The connection's transport, except that closing it while the client still sends its body (a 413, a 408)
    first sends the answer and EOF, then reads and drops the rest for up to `linger_s`: closing a socket with unread
    data resets it, and a client that sends its whole body before reading would see the reset, not the answer."""

    def __init__(self, transport: asyncio.Transport, connection: BoundedH11, linger_s: float) -> None:
        self.transport, self.connection, self.linger_s = transport, connection, linger_s
        self.lingering = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        still_sending = self.connection.conn.their_state is h11.SEND_BODY
        if self.lingering or not still_sending or self.transport.is_closing() or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.lingering = True
        self.transport.write_eof()
        self.transport.resume_reading()
        self.connection.loop.call_later(self.linger_s, self.transport.close)


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection with a deadline for each request's headers, a cap on open connections, a lingering
    close, and the errors it answers itself (malformed HTTP, late headers, too many connections) in the OpenAI shape."""

    limits = Limits()
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = LingeringClose(transport, self, self.limits.read_timeout)  # type: ignore[assignment]
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections(self.limits.max_connections)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the rest of a refused body: read and dropped
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
        self._answer(400, f"The request is not valid HTTP/1.1 (or its headers are over {MAX_HEADER_BYTES >> 10} KiB).")
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
    return error_response(503, message, headers=headers)


def uvicorn_server(app: ASGIApp, limits: Limits = Limits()) -> Uvicorn:
    """uvicorn over app with the limits' connection protocol (warnings and errors logged, no access log)."""
    protocol = type("BoundedH11", (BoundedH11,), {"limits": limits})
    config = Config(
        app, http=protocol, h11_max_incomplete_event_size=MAX_HEADER_BYTES, log_level="warning", access_log=False
    )
    return Uvicorn(config)


def run_server(app: ASGIApp, sock: socket.socket, limits: Limits = Limits()) -> None:
    """Serve app on the socket until Ctrl-C."""
    uvicorn_server(app, limits).run(sockets=[sock])
