"""A loopback stand-in for the Hugging Face Hub: the endpoints huggingface_hub calls to list and download files."""

from __future__ import annotations

import hashlib
import json
import re
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


@dataclass
class FakeHub:
    """Serves model and dataset repos {owner/name: {filename: bytes}} on 127.0.0.1; gated ones need a token."""

    repos: dict[str, dict[str, bytes]]
    gated: set[str] = field(default_factory=set)
    token: str = "hf_test_token"
    delay_per_chunk: float = 0.0
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self) -> list[Request]:
        """File GETs (not API calls, not HEADs)."""
        return [r for r in self.log if r.method == "GET" and "/resolve/" in r.path]

    def _serve(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.log.append(Request(handler.command, path, handler.headers.get("Range")))
        api = re.fullmatch(r"/api/(?:models|datasets)/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        resolve = re.fullmatch(r"/(?:datasets/)?([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo not in self.repos:
            return _reply(handler, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}')
        if repo in self.gated and handler.headers.get("Authorization") != f"Bearer {self.token}":
            headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted."}
            return _reply(handler, 401, headers, b'{"error": "gated"}')
        files = self.repos[repo]
        if api:
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": [_sibling(n, d) for n, d in files.items()]}
            return _reply(handler, 200, {"Content-Type": "application/json"}, json.dumps(info).encode())
        name = resolve.group(2)
        if name not in files:
            return _reply(handler, 404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "Entry not found"}')
        self._send_file(handler, files[name], _etag(name, files[name]), body)

    def _send_file(self, handler: BaseHTTPRequestHandler, data: bytes, etag: str, body: bool) -> None:
        start = 0
        requested = handler.headers.get("Range")
        if requested and (match := re.fullmatch(r"bytes=(\d+)-", requested)):
            start = int(match.group(1))
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{etag}"')
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if not body:
            return
        try:
            for offset in range(start, len(data), CHUNK):
                handler.wfile.write(data[offset : offset + CHUNK])
                handler.wfile.flush()
                if self.delay_per_chunk:
                    time.sleep(self.delay_per_chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass


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
