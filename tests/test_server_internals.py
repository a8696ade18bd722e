"""The uvicorn and h11 internals server/hardening.py still relies on (no setting offers what it does with them), each
checked by name and by what it does, in-process over a fake transport: an upgrade that changes one fails here, by
name, before the hostile-client tests fail in ways that are hard to read."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Iterator

import h11
import pytest
from uvicorn import Server as Uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from dflash_local.server import hardening
from dflash_local.server.hardening import BoundedH11, Limits, uvicorn_server

OVERRIDDEN = ("connection_made", "data_received", "on_response_complete", "connection_lost", "send_400_response")


class Transport(asyncio.Transport):
    """What uvicorn's protocol writes, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = b"", False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: dict, receive: object, send: object) -> None:
    raise AssertionError("no request in these tests reaches the app")


def connect(server: Uvicorn, loop: asyncio.AbstractEventLoop) -> tuple[BoundedH11, Transport]:
    """The server's connection protocol, made for one fake connection."""
    protocol = server.config.http_protocol_class(server.config, server.server_state, {}, _loop=loop)
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.fixture()
def connection() -> Iterator[tuple[BoundedH11, Transport]]:
    """One connection to the protocol `dflash serve` runs."""
    server = uvicorn_server(_app)
    server.config.load()
    loop = asyncio.new_event_loop()
    protocol, transport = connect(server, loop)
    yield protocol, transport
    protocol.connection_lost(None)
    loop.close()


def answer(transport: Transport) -> tuple[int, dict]:
    """The status and JSON body of what the protocol wrote."""
    head, _, body = transport.written.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_the_overridden_methods_keep_their_names_and_parameters():
    for name in OVERRIDDEN:
        theirs, ours = inspect.signature(getattr(H11Protocol, name)), inspect.signature(getattr(BoundedH11, name))
        assert list(theirs.parameters) == list(ours.parameters), name
    assert {400, 408, 503} <= set(STATUS_PHRASES)


def test_the_connection_state_it_reads(connection):
    protocol, transport = connection
    assert isinstance(protocol.conn, h11.Connection) and protocol in protocol.connections
    assert isinstance(protocol.loop, asyncio.AbstractEventLoop) and protocol.transport.connection is protocol
    protocol.data_received(b"GET /v1/models HTTP/1.1\r\nHo")
    assert protocol.conn.their_state is h11.IDLE and protocol.conn.trailing_data == (
        b"GET /v1/models HTTP/1.1\r\nHo",
        False,
    )
    assert protocol.deadline is not None  # the headers are not whole: their deadline runs
    protocol._headers_late()
    assert answer(transport)[0] == 408 and transport.closed


def test_malformed_http_reaches_send_400_response(connection):
    protocol, transport = connection
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = answer(transport)
    assert status == 400 and body["error"]["message"].startswith("The request is not valid HTTP/1.1")
    assert transport.closed


def test_the_header_bound_is_uvicorns_setting(monkeypatch):
    monkeypatch.setattr(hardening, "MAX_HEADER_BYTES", 2**10)  # what uvicorn_server passes as the setting
    server = uvicorn_server(_app)
    server.config.load()
    loop = asyncio.new_event_loop()
    protocol, transport = connect(server, loop)
    protocol.data_received(b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 2**11)
    status, body = answer(transport)
    assert status == 400 and "over 1 KiB" in body["error"]["message"]
    protocol.connection_lost(None)
    loop.close()


def test_a_connection_over_the_cap_answers_503():
    """The cap counts uvicorn's shared set of open connections, and swaps the connection's app for the refusal."""
    server = uvicorn_server(_app, Limits(max_connections=1))
    server.config.load()
    loop = asyncio.new_event_loop()
    made = [connect(server, loop)[0] for _ in range(2)]
    assert len(server.server_state.connections) == 2
    assert made[0].app is server.config.loaded_app and made[1].app is not server.config.loaded_app
    for protocol in made:
        protocol.connection_lost(None)
    loop.close()
