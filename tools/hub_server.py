"""A loopback stand-in for the Hugging Face Hub: the endpoints huggingface_hub calls to list and download files.

The tests and tools/check_user_install.py serve from it (standard library only). Tests can script the faults of a
real network (`Fault`: error answers, dropped connections, stalls, corrupted bytes) and send LFS files through a
second server on another port, the way the Hub redirects them to its CDN.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf")
CHUNK = 64 * 1024


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None = None
    host: str = "hub"  # "hub", or "cdn" for the server LFS files are redirected to


@dataclass
class Fault:
    """A misbehaviour for the next `times` requests whose method and path match (path: a regex, searched)."""

    kind: str  # "status": answer `status`; "drop": send `after` body bytes, then cut the connection;
    # "stall": send `after` body bytes, then go silent for `seconds`; "corrupt": flip one byte of the body
    path: str
    method: str = "GET"
    times: int = 1
    status: int = 503
    after: int = 0
    seconds: float = 4.0


@dataclass
class FakeHub:
    """Serves model and dataset repos {owner/name: {filename: bytes}} on 127.0.0.1; gated ones need a token."""

    repos: dict[str, dict[str, bytes]]
    gated: set[str] = field(default_factory=set)
    token: str = "hf_test_token"
    delay_per_chunk: float = 0.0
    log: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    cdn: bool = False  # True: LFS files answer 302 to the CDN server (another port), as the real Hub does
    xet: bool = False  # True: LFS files' answers name their Xet hash and token route, as for a repo kept in Xet

    def __post_init__(self) -> None:
        self.server = _server(self, "hub")
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.cdn_server = _server(self, "cdn")
        self.cdn_url = f"http://127.0.0.1:{self.cdn_server.server_address[1]}"
        self._lock = threading.Lock()

    def __enter__(self) -> FakeHub:
        for server in (self.server, self.cdn_server):
            threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()  # shutdown: 20 ms
        return self

    def __exit__(self, *_: object) -> None:
        for server in (self.server, self.cdn_server):
            server.shutdown()
            server.server_close()

    def downloads(self) -> list[Request]:
        """File GETs, from the Hub or its CDN (not API calls, not HEADs)."""
        return [r for r in self.log if r.method == "GET" and ("/resolve/" in r.path or r.host == "cdn")]

    def _fault(self, method: str, path: str) -> Fault | None:
        """The first scripted fault that applies to this request, used up by one."""
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and re.search(fault.path, path):
                    fault.times -= 1
                    return fault
        return None

    def _serve(self, handler: BaseHTTPRequestHandler, host: str) -> None:
        path = unquote(urlparse(handler.path).path)
        headers = handler.headers
        self.log.append(Request(handler.command, path, headers.get("Range"), headers.get("Authorization"), host))
        fault = self._fault(handler.command, path)
        if fault and fault.kind == "status":
            return _reply(handler, fault.status, {}, b'{"error": "scripted failure"}')
        if host == "cdn":
            found = [d for files in self.repos.values() for n, d in files.items() if f"/cdn/{_etag(n, d)}" == path]
            if not found:
                return _reply(handler, 404, {}, b"no such blob")
            return self._send_file(handler, found[0], path.rsplit("/", 1)[1], fault)
        api = re.fullmatch(r"/api/(?:models|datasets)/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        resolve = re.fullmatch(r"/(?:datasets/)?([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo not in self.repos:
            return _reply(handler, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}')
        if repo in self.gated and headers.get("Authorization") != f"Bearer {self.token}":
            denied = {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted."}
            return _reply(handler, 401, denied, b'{"error": "gated"}')
        files = self.repos[repo]
        if api:
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": [_sibling(n, d) for n, d in files.items()]}
            return _reply(handler, 200, {"Content-Type": "application/json"}, json.dumps(info).encode())
        name = resolve.group(2)
        if name not in files:
            return _reply(handler, 404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "Entry not found"}')
        etag = _etag(name, files[name])
        if self.cdn and name.endswith(LFS_SUFFIXES):
            linked = {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(files[name])), "X-Repo-Commit": COMMIT}
            return _reply(handler, 302, {**linked, "Location": f"{self.cdn_url}/cdn/{etag}?signed=1"}, b"")
        xet = {"X-Xet-Hash": etag, "X-Xet-Refresh-Route": f"{self.url}/api/models/{repo}/xet-read-token/{COMMIT}"}
        self._send_file(handler, files[name], etag, fault, xet if self.xet and name.endswith(LFS_SUFFIXES) else {})

    def _send_file(
        self, handler: BaseHTTPRequestHandler, data: bytes, etag: str, fault: Fault | None, extra: dict | None = None
    ) -> None:
        start = 0
        requested = handler.headers.get("Range")
        if requested and (match := re.fullmatch(r"bytes=(\d+)-", requested)):
            start = int(match.group(1))
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{etag}"')
        handler.send_header("Accept-Ranges", "bytes")
        for key, value in (extra or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if handler.command == "HEAD":
            return
        body = data[start:]
        if fault and fault.kind == "corrupt":
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        cut = fault.after if fault and fault.kind in ("drop", "stall") else len(body)
        try:
            for offset in range(0, cut, CHUNK):
                handler.wfile.write(body[offset : min(offset + CHUNK, cut)])
                handler.wfile.flush()
                if self.delay_per_chunk:
                    time.sleep(self.delay_per_chunk)
            if fault and fault.kind == "stall":
                time.sleep(fault.seconds)
            if fault and fault.kind in ("drop", "stall"):
                handler.connection.shutdown(socket.SHUT_RDWR)
                handler.close_connection = True
        except OSError:  # the client hung up first
            pass


def _server(hub: FakeHub, host: str) -> ThreadingHTTPServer:
    """An HTTP server on a free port of 127.0.0.1 that hands every request to hub, marked with host."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hub._serve(self, host)

        def do_HEAD(self) -> None:
            hub._serve(self, host)

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def _reply(handler: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def _etag(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _sibling(name: str, data: bytes) -> dict:
    entry = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
    if name.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    else:
        entry["blobId"] = _etag(name, data)
    return entry


def repo_of(folder: Path, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """A folder's files as a repo, plus extra files (for example code the pull must not fetch)."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    return files | (extra or {})
