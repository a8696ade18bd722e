"""`dflash serve` against hostile and careless clients: every body it cannot use is a 400, reads are bounded (body
size, header and body time, open connections), features it cannot honour are refused by name, and every non-2xx
answer has OpenAI's error shape. Each server runs in-process on a loopback port (the real app and protocol), over
one engine of the bundled pair."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from one_error import assert_one_error
from typer.testing import CliRunner

from dflash_local.cli import app
from dflash_local.generation import load_models
from dflash_local.reply.text_stream import TextStream
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.server.app import create_app
from dflash_local.server.engine import Engine
from dflash_local.server.hardening import Limits, listen, uvicorn_server
from dflash_local.server.protocol import BadRequest, parse_sampling

KEY = "test-key"
TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
RAW_AUTH = f"Host: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
CHAT = {"messages": [{"role": "user", "content": "def fibonacci(n):"}], "max_tokens": 2, "temperature": 0}
HANG_S = 30  # a socket read that waits this long means the server never answered: the test fails, it never waits more

Address = tuple[str, int]


@pytest.fixture(scope="module")
def engine() -> Engine:
    models = load_models(TINY / "target", TINY / "drafter", LoadSpec(RuntimeConfig(device="cpu")), auto_block=False)
    return Engine(models, None, None, size=8)


@contextmanager
def serving(engine: Engine, limits: Limits = Limits()) -> Iterator[Address]:
    """The server `dflash serve --api-key KEY` runs, with these limits, on a free loopback port."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn_server(create_app(engine, "tiny", KEY, limits), limits)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(HANG_S)


@pytest.fixture(scope="module")
def address(engine) -> Iterator[Address]:
    with serving(engine) as address:
        yield address


def ask(address: Address, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body as JSON) of one request."""
    connection = http.client.HTTPConnection(*address, timeout=HANG_S)
    try:
        connection.request(method, path, body=body, headers=AUTH if headers is None else headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def exchange(address: Address, data: bytes) -> bytes:
    """Send raw bytes, then read until the server closes the connection (a reset after its answer counts as closed)."""
    with socket.create_connection(address, timeout=HANG_S) as sock:
        sock.sendall(data)
        return read_to_close(sock)


def read_to_close(sock: socket.socket) -> bytes:
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def parsed(raw: bytes) -> tuple[int, dict]:
    """Status and JSON body of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def assert_openai_error(body: dict, message_start: str = "", param: str | None = None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"].startswith(message_start), body
    assert body["error"]["param"] == param


def with_field(text: str) -> bytes:
    """CHAT with one more field, written as raw JSON text."""
    return json.dumps(CHAT).encode()[:-1] + b', "x": ' + text.encode() + b"}"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"[" * 100_000, "The request body nests arrays or objects too deeply."),
        (with_field("[" * 5000 + "]" * 5000), "The request body nests arrays or objects too deeply."),
        (with_field("1" + "0" * 5000), "The request body has an integer of more than 4300 digits."),
        (with_field("NaN"), "NaN is not a JSON number."),
        (with_field("-Infinity"), "-Infinity is not a JSON number."),
        (json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), "The request body has a"),
        (json.dumps(CHAT).replace("fibonacci", "fibonacc\u00ef").encode("latin-1"), "The request body is not UTF-8"),
        (b"{not json", "The request body is not valid JSON."),
        (b"[]", "The request body must be a JSON object."),
    ],
    ids=["deep", "deep-field", "5001-digits", "nan", "infinity", "surrogate", "latin-1", "syntax", "array"],
)
def test_every_unusable_body_is_a_400_in_the_openai_shape(engine, address, body, message):
    failed = engine.counts["failed"]
    status, headers, answer = ask(address, "POST", "/v1/chat/completions", body)
    assert (status, headers["content-type"]) == (400, "application/json")
    assert_openai_error(answer, message)
    assert engine.counts["failed"] == failed  # refused before the engine, not failed in it


def test_json_in_utf16_and_escaped_non_ascii_text_are_answered(address):
    for body in (
        json.dumps(CHAT).encode("utf-16"),
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "ï"}]}),
    ):
        status, _, answer = ask(address, "POST", "/v1/chat/completions", body)
        assert status == 200 and answer["object"] == "chat.completion"


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("n", 2),
        ("best_of", 3),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("echo", True),
        ("suffix", "return"),
    ],
)
def test_a_feature_the_server_cannot_honour_is_a_400_naming_the_field(field, value):
    with pytest.raises(BadRequest) as caught:
        parse_sampling({field: value})
    assert caught.value.param == field


def test_refused_features_over_http_and_their_harmless_forms(address):
    status, _, body = ask(address, "POST", "/v1/chat/completions", json.dumps({**CHAT, "tool_choice": "required"}))
    assert status == 400
    assert_openai_error(body, "A required or named tool_choice needs 'tools'", "tool_choice")
    harmless = {"tools": [], "tool_choice": "auto", "response_format": {"type": "text"}, "n": 1, "logprobs": False}
    status, _, body = ask(address, "POST", "/v1/chat/completions", json.dumps(CHAT | harmless).encode())
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(address, scheme):
    status, _, body = ask(address, "GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert status == 200 and body["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("value", ["Basic test-key", "Bearer wrong", "test-key", "Bearer", "", "Bearer test-key2"])
def test_a_wrong_authorization_is_a_401(address, value):
    status, _, body = ask(address, "GET", "/v1/models", headers={"Authorization": value})
    assert status == 401
    assert_openai_error(body, "Missing or wrong API key")


@pytest.mark.parametrize(
    "method, path, status, message",
    [
        ("GET", "/v1/nothing", 404, "Invalid URL (GET /v1/nothing)"),
        ("POST", "/v1/chat/completions/", 404, "Invalid URL (POST /v1/chat/completions/)"),
        ("GET", "/v1/models/", 404, "Invalid URL (GET /v1/models/)"),
        ("GET", "/health/", 404, "Invalid URL (GET /health/)"),
        ("GET", "/v1/chat/completions", 405, "GET /v1/chat/completions is not allowed: use POST."),
        ("DELETE", "/v1/models", 405, "DELETE /v1/models is not allowed: use "),  # GET, HEAD in any order
        ("GET", "/v1/messages/nothing", 404, "Invalid URL (GET /v1/messages/nothing)"),
        ("POST", "/v1/messages/batches", 404, "Invalid URL (POST /v1/messages/batches)"),
        ("GET", "/v1/messages", 405, "GET /v1/messages is not allowed: use POST."),
        ("PUT", "/v1/messages/count_tokens", 405, "PUT /v1/messages/count_tokens is not allowed: use POST."),
        ("GET", "/api/ps", 404, "Invalid URL (GET /api/ps)"),
        ("DELETE", "/api/delete", 404, "Invalid URL (DELETE /api/delete)"),
        ("GET", "/api/chat", 405, "GET /api/chat is not allowed: use POST."),
        ("POST", "/api/tags", 405, "POST /api/tags is not allowed: use "),  # GET, HEAD in any order
    ],
)
def test_no_such_path_or_method_is_answered_in_the_shape_of_the_paths_api_without_redirects(
    address, method, path, status, message
):
    """OpenAI's shape, but Anthropic's under /v1/messages and Ollama's under /api/."""
    got, headers, body = ask(address, method, path, json.dumps(CHAT).encode() if method != "GET" else None)
    assert (got, headers["content-type"]) == (status, "application/json")
    assert "location" not in {name.lower() for name in headers}
    if path.startswith("/api/"):
        assert set(body) == {"error"} and body["error"].startswith(message), body
    elif path.startswith("/v1/messages"):
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == kind and body["error"]["message"].startswith(message), body
    else:
        assert_openai_error(body, message)


def test_a_body_over_the_limit_is_a_413_before_it_is_read(engine):
    limit = 4096
    with serving(engine, Limits(max_body=limit)) as address:
        declared = b"POST /v1/chat/completions HTTP/1.1\r\n" + RAW_AUTH + b"Content-Length: 50000000\r\n\r\n{"
        status, body = parsed(exchange(address, declared))  # 50 MB declared, one byte sent: answered at once
        assert status == 413
        assert_openai_error(body, "The request body is 50000000 bytes, over the 4096-byte limit (--max-body).")
        chunk = b"800\r\n" + b" " * 0x800 + b"\r\n"
        chunked = b"POST /v1/completions HTTP/1.1\r\n" + RAW_AUTH + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 3
        status, body = parsed(exchange(address, chunked))
        assert status == 413
        assert_openai_error(body, "The request body is over the 4096-byte limit (--max-body).")
        whole = json.dumps(CHAT).encode()
        status, _, body = ask(address, "POST", "/v1/chat/completions", whole + b" " * (limit - len(whole)))
        assert status == 200 and body["object"] == "chat.completion"


def test_the_rest_of_a_refused_body_is_read_for_a_bounded_time_then_the_connection_closes(engine):
    with serving(engine, Limits(max_body=4096, read_timeout=1.0)) as address:
        with socket.create_connection(address, timeout=HANG_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\n" + RAW_AUTH + b"Content-Length: 50000000\r\n\r\n")
            status, body = parsed(read_to_close(sock))  # the answer is whole: the server closed its side
            assert status == 413 and body["error"]["message"].startswith("The request body is 50000000 bytes")
            sent, start = 0, time.monotonic()
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                while time.monotonic() - start < HANG_S:  # the body goes on: read and dropped, for a while
                    sent += sock.send(b" " * 65536)
                    time.sleep(0.01)
            assert sent > 65536 and time.monotonic() - start < 10


def test_a_compressed_body_is_a_415(address):
    status, _, body = ask(address, "POST", "/v1/chat/completions", b"\x1f\x8b", AUTH | {"Content-Encoding": "gzip"})
    assert status == 415
    assert_openai_error(body, "Content-Encoding gzip is not supported")


def test_malformed_http_is_a_400_in_the_openai_shape(address):
    status, body = parsed(exchange(address, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400
    assert_openai_error(body, "The request is not valid HTTP/1.1")


def test_headers_that_do_not_arrive_in_time_end_the_connection(engine):
    with serving(engine, Limits(read_timeout=1)) as address:
        half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"
        status, body = parsed(exchange(address, half))
        assert status == 408
        assert_openai_error(body, "The request headers did not arrive within 1 s (--read-timeout).")
        after_an_answer = exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")  # keep-alive
        assert after_an_answer.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in after_an_answer
        with socket.create_connection(address, timeout=HANG_S) as silent:
            assert read_to_close(silent) == b""  # nothing begun: closed without an answer
        with socket.create_connection(address, timeout=HANG_S) as dripping:  # a byte at a time never renews the time
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                    dripping.sendall(bytes([byte]))
                    time.sleep(0.05)
                pytest.fail("a dripping client kept its connection for over 8 minutes")
            except (BrokenPipeError, ConnectionResetError):
                pass
        assert ask(address, "GET", "/health")[0] == 200


def test_a_body_that_does_not_arrive_in_time_is_a_408(engine):
    with serving(engine, Limits(read_timeout=1)) as address:
        stalled = b"POST /v1/chat/completions HTTP/1.1\r\n" + RAW_AUTH + b'Content-Length: 100\r\n\r\n{"messages"'
        status, body = parsed(exchange(address, stalled))
        assert status == 408
        assert_openai_error(body, "The request body did not arrive within 1 s (--read-timeout).")


def test_connections_over_the_cap_get_a_503_and_the_cap_frees_up(engine):
    with serving(engine, Limits(max_connections=3)) as address:
        held = [socket.create_connection(address, timeout=HANG_S) for _ in range(3)]
        for sock in held:
            sock.sendall(b"GET /hea")
        status, body = parsed(exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503
        assert_openai_error(body, "The server has its 3 connections open (--max-connections); retry later.")
        for sock in held:
            sock.close()
        deadline = time.monotonic() + HANG_S
        while (status := ask(address, "GET", "/health")[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the closed connections on its next loop turn
        assert status == 200


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-body", "0", "error: --max-body must be at least 1, got 0."),
        ("--max-connections", "-1", "error: --max-connections must be at least 1, got -1."),
        ("--read-timeout", "0", "error: --read-timeout must be a number of seconds above 0, got 0."),
        ("--read-timeout", "nan", "error: --read-timeout must be a number of seconds above 0, got nan."),
        ("--cache-ram", "-1", "error: --cache-ram must be 0 (off) or more MiB, got -1."),
    ],
)
def test_a_limit_out_of_range_is_one_error_line(flag, value, message):
    assert assert_one_error(CliRunner().invoke(app, ["serve", "tiny", flag, value])) == message


def test_a_bug_is_a_500_in_the_shape_of_the_paths_api():
    class Broken(Engine):
        def submit(self, job) -> bool:
            raise RuntimeError("a bug")

    models = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: "", config={}), stop_ids=frozenset())
    with serving(Broken(models, None, None, size=1)) as address:
        status, _, body = ask(address, "POST", "/v1/chat/completions", json.dumps(CHAT).encode())
        _, _, anthropic = ask(address, "POST", "/v1/messages", json.dumps(CHAT).encode())
        _, _, ollama = ask(address, "POST", "/api/chat", json.dumps(CHAT).encode())
    assert status == 500 and body["error"]["type"] == "server_error"
    assert_openai_error(body, "The server failed (RuntimeError: a bug).")
    failed = {"type": "api_error", "message": "The server failed (RuntimeError: a bug)."}
    assert anthropic == {"type": "error", "error": failed}
    assert ollama == {"error": "The server failed (RuntimeError: a bug)."}


def test_a_long_stop_string_is_no_slower_than_the_text_it_holds_back():
    class Counted(str):
        slices = 0

        def __getitem__(self, key):
            Counted.slices += 1
            return str.__getitem__(self, key)

    reply = TextStream(None, frozenset(), (Counted("x" * 100_000),))  # text in: no tokenizer
    assert [reply.add_text(delta).content for delta in ("Hello", " world", " x", "x", "y")] == [
        *("Hello", " world", " ", "", "xxy")
    ]
    assert Counted.slices < 100  # was one slice per character of the stop string, at every step
