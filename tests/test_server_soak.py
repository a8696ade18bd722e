"""A soak of `dflash serve tiny` (a live process on a loopback port, with small limits): many clients at once send
whole and streamed requests, disconnect mid-stream, send bad bodies, send slowly, read slowly or stall. Afterwards
every accepted request got a whole answer, every greedy answer equals the solo one, /health counts what was sent,
and the server's memory stopped growing. DFLASH_SOAK_S sets the seconds of load (default 20; more finds slower
leaks)."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

KEY = "soak-key"
SOAK_S = float(os.environ.get("DFLASH_SOAK_S", "20"))
CLIENTS = 12
MAX_BODY = 65536
READ_TIMEOUT_S = 3
RSS_GROWTH_KIB = 16 << 10  # after the warm-up the server's memory stays level: far less than this over the soak
HANG_S = 120  # a request unanswered this long is a failure, not a wait
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPTS = ["def fibonacci(n):", "Explain what a hash map is."]
BAD_BODIES = [  # (body, extra headers, expected status)
    (b"[" * 50_000, {}, 400),
    (b'{"messages": [], "seed": 1' + b"0" * 5000 + b"}", {}, 400),
    (b"{not json", {}, 400),
    (json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), {}, 400),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}).encode(), {}, 400),
    (b" " * (MAX_BODY + 1), {}, 413),
    (b"\x1f\x8b\x08", {"Content-Encoding": "gzip"}, 415),
]


def chat_body(prompt: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def server():
    """`dflash serve tiny` with small limits: (host, port, pid)."""
    args = [sys.executable, "-m", "dflash_local", "serve", "tiny", "--port", "0", "--api-key", KEY]
    args += ["--queue-size", "64", "--max-body", str(MAX_BODY), "--read-timeout", str(READ_TIMEOUT_S)]
    args += ["--max-connections", "64"]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = process.stderr.readline()
        assert line.startswith("serving tiny on http://127.0.0.1:"), line
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
        host, port = line.split()[3].removeprefix("http://").removesuffix("/v1").split(":")
        address = (host, int(port))
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                assert request(address, "GET", "/health")[0] == 200
                break
            except ConnectionError:
                assert time.monotonic() < deadline and process.poll() is None, "the server did not come up"
                time.sleep(0.2)
        yield address, process.pid, log
    finally:
        process.terminate()
        process.wait(timeout=30)


def request(address, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    connection = http.client.HTTPConnection(*address, timeout=HANG_S)
    try:
        connection.request(method, path, body=body, headers=AUTH if headers is None else headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Soak:
    """The clients' shared tally: what was sent and answered, and every departure from what was expected."""

    def __init__(self, address, solo: dict[str, str]) -> None:
        self.address, self.solo = address, solo
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def note(self, kind: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if problem:
                self.problems.append(f"{kind}: {problem}")

    def whole(self, rng: random.Random) -> None:
        prompt = rng.choice(PROMPTS)
        status, body = request(self.address, "POST", "/v1/chat/completions", json.dumps(chat_body(prompt)).encode())
        text = body["choices"][0]["message"]["content"] if status == 200 else None
        self.note("answered", None if text == self.solo[prompt] else f"{status} {body}")

    def stream(self, rng: random.Random, slow_reader: bool = False) -> None:
        prompt = rng.choice(PROMPTS)
        body = chat_body(prompt, stream=True)
        connection = http.client.HTTPConnection(*self.address, timeout=HANG_S)
        try:
            connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=AUTH)
            response = connection.getresponse()
            text, finish, done = "", None, False
            for line in response:
                if slow_reader:
                    time.sleep(0.02)
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    done = True
                    break
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
            whole = done and finish is not None and text == self.solo[prompt]
            self.note("answered", None if whole else f"{response.status} {text!r} {finish} {done}")
        finally:
            connection.close()

    def disconnect(self, rng: random.Random) -> None:
        body = chat_body(rng.choice(PROMPTS), stream=True, max_tokens=3000, ignore_eos=True, temperature=0.7)
        connection = http.client.HTTPConnection(*self.address, timeout=HANG_S)
        try:
            connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=AUTH)
            response = connection.getresponse()
            chunks = 0
            for line in response:
                chunks += line.startswith(b"data: ")
                if chunks == 3:
                    break
            self.note("cancelled", None if chunks == 3 else f"{response.status}, {chunks} chunks")
        finally:
            connection.close()

    def bad_body(self, rng: random.Random) -> None:
        data, headers, expected = rng.choice(BAD_BODIES)
        try:
            status, body = request(self.address, "POST", "/v1/chat/completions", data, AUTH | headers)
        except (ConnectionResetError, BrokenPipeError):  # a 413 closes the connection on a body still being sent
            if expected != 413:
                raise
            status, body = expected, {"error": {"message": "reset while sending a body over the limit"}}
        shaped = set(body) == {"error"} and isinstance(body["error"].get("message"), str)
        self.note("refused", None if status == expected and shaped else f"{status} {body} for {data[:30]!r}")

    def slow_sender(self, rng: random.Random) -> None:
        prompt = rng.choice(PROMPTS)
        data = json.dumps(chat_body(prompt)).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        with socket.create_connection(self.address, timeout=HANG_S) as sock:
            for piece in (head.encode()[:20], head.encode()[20:], data[:10], data[10:30], data[30:]):
                sock.sendall(piece)
                time.sleep(0.1)
            raw = read_to_close(sock)
        status, body = parse(raw)
        text = body["choices"][0]["message"]["content"] if status == 200 else None
        self.note("answered", None if text == self.solo[prompt] else f"{status} {body}")

    def stall(self, rng: random.Random) -> None:
        with socket.create_connection(self.address, timeout=HANG_S) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            status, body = parse(read_to_close(sock))
        self.note("stalled", None if status == 408 else f"{status} {body}")

    def health(self, rng: random.Random) -> None:
        status, body = request(self.address, "GET", "/health", headers={})
        self.note("health", None if status == 200 and body["status"] == "ok" else f"{status} {body}")

    def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        actions = [self.whole, self.stream, self.disconnect, self.bad_body, self.slow_sender, self.stall, self.health]
        weights = [4, 3, 2, 3, 2, 1, 1]
        while time.monotonic() < until:
            action = rng.choices(actions, weights)[0]
            try:
                if action is self.stream and rng.random() < 0.3:
                    self.stream(rng, slow_reader=True)
                else:
                    action(rng)
            except Exception as exc:  # noqa: BLE001 - every failure is tallied, the soak goes on
                self.note("error", f"{action.__name__}: {type(exc).__name__}: {exc}")


def read_to_close(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def parse(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def settled(address) -> dict:
    """/health once the engine is idle and its counts stop changing (cancellations land at the next step)."""
    deadline, last = time.monotonic() + HANG_S, None
    while time.monotonic() < deadline:
        state = request(address, "GET", "/health", headers={})[1]
        if not state["busy"] and state["queued"] == 0 and state == last:
            return state
        last = state
        time.sleep(0.5)
    raise AssertionError(f"the server did not settle: {last}")


def test_a_soak_of_mixed_clients_leaves_every_answer_whole_and_the_counts_true(server):
    address, pid, log = server
    solo = {}
    for prompt in PROMPTS:
        status, body = request(address, "POST", "/v1/chat/completions", json.dumps(chat_body(prompt)).encode())
        assert status == 200
        solo[prompt] = body["choices"][0]["message"]["content"]
    soak = Soak(address, solo)

    def run(seconds: float) -> None:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=soak.client, args=(seed, until)) for seed in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(0.0, until - time.monotonic()) + HANG_S)
            assert not thread.is_alive(), "a client hung past its time and the hang allowance"

    run(min(10.0, SOAK_S / 4))  # warm-up: allocator pools and caches reach their working size
    warm = rss_kib(pid)
    run(SOAK_S)
    grown = rss_kib(pid) - warm

    print(
        f"soak {SOAK_S:g} s, {CLIENTS} clients: {dict(soak.counts)}; RSS {warm} KiB after warm-up, then {grown:+} KiB"
    )
    assert soak.problems == [], soak.problems[:10]
    assert soak.counts["answered"] > 0 and soak.counts["cancelled"] > 0 and soak.counts["refused"] > 0
    state = settled(address)
    expected = {"served": soak.counts["answered"] + len(PROMPTS), "cancelled": soak.counts["cancelled"], "failed": 0}
    assert {key: state[key] for key in expected} == expected, (state, soak.counts)
    assert grown < RSS_GROWTH_KIB, (warm, grown)
    assert not [line for line in log if "Traceback" in line], "".join(log)
