"""A coding agent's session replayed against dflash serve and llama-server on the same GGUF, one engine after the other.

record: a loopback proxy in front of a server; point Claude Code or Codex at it and every POST it forwards (path and
JSON body) is appended to a session file, in order:

    .venv/bin/python -m benchmarks.agent_session record --upstream http://127.0.0.1:8000 --port 8100 session.jsonl

compose: a session of alternating conversations from captured first requests (one file per agent run, its first
POST taken): each conversation's next request is its previous one with a tool call to the agent's first tool and a
tool result (the text of --tool-result) appended, in the API's own shape; the conversations take turns:

    .venv/bin/python -m benchmarks.agent_session compose claude.jsonl codex.jsonl --turns 3 -o session.jsonl

replay: starts the engines (dflash serve, and llama-server) on MODEL.gguf with one thread each, sends the session's
requests in order, each to every engine in turn, streamed, at temperature 0 with at most --max-tokens new tokens,
and prints each request's time to first token, its prompt and cached-prompt tokens as the engine reports them, and
each engine's total time; --plain adds `dflash serve --no-draft`, whose texts dflash's must equal:

    .venv/bin/python -m benchmarks.agent_session replay session.jsonl MODEL.gguf --llama-server PATH \
        --chat-template chatml --context 32768 [--plain] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from dflash_local.peer import free_port

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}
KEY = "agent-session"
BILLING = "x-anthropic-billing-header:"  # Claude Code's per-request system block


def record(args: argparse.Namespace) -> None:
    """Forward every request to --upstream, appending each POST's path and body to the session file."""
    upstream = urlsplit(args.upstream)
    lock = threading.Lock()

    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self, body: bytes | None) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=3600)
            connection.request(self.command, self.path, body=body, headers=headers)
            answer = connection.getresponse()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            connection.close()

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.forward(None)

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock, args.session.open("a") as out:
                out.write(json.dumps({"path": self.path.split("?")[0], "body": json.loads(body)}) + "\n")
            self.forward(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Proxy)
    print(f"recording to {args.session}: point the agent at http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


def follow_up(request: dict, turn: int, result: str) -> dict:
    """The request's conversation one tool round later: the model called the first tool, the agent answered."""
    body, call = json.loads(json.dumps(request["body"])), f"call_{turn}"
    tool = (body.get("tools") or [{}])[0]
    name = tool.get("name") or (tool.get("function") or {}).get("name") or "tool"
    if request["path"].endswith("/messages"):
        body["messages"] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call, "name": name, "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": result}]},
        ]
    elif request["path"].endswith("/responses"):
        body["input"] += [
            {"type": "function_call", "call_id": call, "name": name, "arguments": "{}"},
            {"type": "function_call_output", "call_id": call, "output": result},
        ]
    else:
        calls = [{"id": call, "type": "function", "function": {"name": name, "arguments": "{}"}}]
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call, "content": result},
        ]
    return {"path": request["path"], "body": body}


def text_of_content(content: object) -> str:
    """A message's content as text: strings as they are, blocks' texts joined, tool calls and results as JSON."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, dict):
        content = [content]
    texts = []
    for block in content:
        kind = block.get("type", "")
        if kind in ("tool_use", "function_call"):
            texts.append(json.dumps({"call": block.get("name"), "input": block.get("input") or block.get("arguments")}))
        elif kind in ("tool_result", "function_call_output"):
            texts.append(text_of_content(block.get("content", block.get("output"))))
        elif block.get("text") is not None:
            texts.append(block["text"])
    return "\n".join(texts)


def turns_of(request: dict) -> list[tuple[str, str]]:
    """The request's conversation as (role, text) turns, the system text and tools first, in any of the APIs."""
    body = request["body"]
    system = body.get("system") or body.get("instructions") or ""
    blocks = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
    blocks = [b for b in blocks if b and not b.startswith(BILLING)]  # as serve's Messages route drops it
    if body.get("tools"):
        blocks.append("Tools:\n" + json.dumps(body["tools"]))
    turns = [("system", "\n\n".join(blocks))] if blocks else []
    items = body.get("messages") or body.get("input") or []
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        role = item.get("role") or ("assistant" if item.get("type") == "function_call" else "tool")
        text = text_of_content(item.get("content") if "content" in item else item)
        calls = [
            json.dumps({"call": c["function"]["name"], "input": c["function"]["arguments"]})
            for c in item.get("tool_calls") or []
        ]
        turns.append((role, "\n".join([text, *calls]).strip()))
    return turns


def as_text(request: dict) -> dict:
    """The request as one ChatML text completion, so that every engine prefills the same tokens whatever its chat
    templates and tool prompts do with the API's fields."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns_of(request))
    return {"path": "/v1/completions", "body": {"model": "agent", "prompt": text + "<|im_start|>assistant\n"}}


def compose(args: argparse.Namespace) -> None:
    """Writes the session: turn by turn, each conversation's next request (with --as-text, as a text completion)."""
    conversations = [json.loads(path.read_text().splitlines()[0]) for path in args.captured]
    result = args.tool_result.read_text()
    session = []
    for turn in range(args.turns):
        for index, request in enumerate(conversations):
            if turn:
                conversations[index] = request = follow_up(request, turn, result)
            session.append(as_text(request) if args.as_text else request)
    args.out.write_text("".join(json.dumps(request) + "\n" for request in session))
    print(f"{args.out}: {len(session)} requests")


def engine_command(engine: str, args: argparse.Namespace, port: int) -> list[str]:
    """The command line that serves MODEL on port with one thread and the given context."""
    threads, context = str(args.threads), str(args.context)
    if engine == "llama-server":
        command = [args.llama_server, "-m", args.model, "--port", str(port), "-t", threads, "-tb", threads]
        # --no-repack: stock llama-server's default weight repacking segfaults while loading on this machine's CPU
        # (its AMX buffer); dflash's libllama does not repack either, so both run the same weight layout
        command += ["-c", context, "-np", "1", "--no-webui", "--no-repack", "--api-key", KEY]
        return command + (["--chat-template", args.chat_template] if args.chat_template else ["--jinja"])
    command = [sys.executable, "-m", "dflash_local", "serve", args.model, "--port", str(port), "--threads", threads]
    command += ["--max-context", context, "--api-key", KEY]
    command += ["--chat-template", args.chat_template] if args.chat_template else []
    command += ["--drafter", args.drafter] if args.drafter else []
    return command + (["--no-draft"] if engine == "dflash-plain" else [])


def wait_ready(port: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server was not ready in time")


def prepared(request: dict, max_tokens: int) -> dict:
    """The recorded body, streamed, greedy, its answer at most max_tokens long."""
    body = dict(request["body"]) | {"stream": True, "temperature": 0}
    body.pop("top_p", None)
    body.pop("top_k", None)
    if request["path"].endswith("/responses"):
        body["max_output_tokens"] = min(body.get("max_output_tokens") or max_tokens, max_tokens)
    elif request["path"].startswith("/api/"):
        body["options"] = dict(body.get("options") or {}) | {"temperature": 0, "num_predict": max_tokens}
    else:
        body["max_tokens"] = min(body.get("max_tokens") or max_tokens, max_tokens)
        body.pop("max_completion_tokens", None)
        if not request["path"].endswith("/messages"):  # OpenAI's streams carry usage only when asked
            body["stream_options"] = {"include_usage": True}
    return body


def text_of(event: dict) -> str:
    """The generated text (or tool-call arguments) one streamed event carries, in any of the four APIs."""
    if "choices" in event:  # OpenAI chat and completions
        choice = (event["choices"] or [{}])[0]
        delta = choice.get("delta") or {}
        calls = "".join((c.get("function") or {}).get("arguments") or "" for c in delta.get("tool_calls") or [])
        reasoning = delta.get("reasoning_content") or ""
        return (choice.get("text") or "") + (delta.get("content") or "") + reasoning + calls
    if event.get("type") == "content_block_delta":  # Anthropic
        delta = event["delta"]
        return delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
    if str(event.get("type", "")).endswith(".delta"):  # Responses
        return event.get("delta") or ""
    if "done" in event:  # Ollama
        return (event.get("message") or {}).get("content") or event.get("response") or ""
    return ""


def usage_of(event: dict, usage: dict) -> None:
    """Updates usage (prompt and cached tokens) from an event that reports them."""
    found = event.get("usage") or (event.get("message") or {}).get("usage") or (event.get("response") or {})
    found = found.get("usage", found) if isinstance(found, dict) else {}
    prompt = found.get("prompt_tokens", found.get("input_tokens", event.get("prompt_eval_count")))
    cached = found.get("cache_read_input_tokens") or (
        found.get("prompt_tokens_details") or found.get("input_tokens_details") or {}
    ).get("cached_tokens")
    if prompt is not None:
        usage["prompt"] = prompt + (found.get("cache_read_input_tokens") or 0)
    if cached is not None:
        usage["cached"] = cached
    timings = event.get("timings") or {}  # llama-server's own numbers
    if "prompt_n" in timings:
        usage["prompt"], usage["cached"] = timings["prompt_n"] + timings.get("cache_n", 0), timings.get("cache_n", 0)


def send(port: int, request: dict, max_tokens: int) -> dict:
    """One streamed request: time to first generated text, total time, the text, the usage reported."""
    body = json.dumps(prepared(request, max_tokens)).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    headers["anthropic-version"] = "2023-06-01"
    start = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    connection.request("POST", request["path"], body=body, headers=headers)
    answer = connection.getresponse()
    first, pieces, usage = None, [], {}
    for raw in answer:
        line = raw.decode().strip()
        line = line[5:].strip() if line.startswith("data:") else line
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if piece := text_of(event):
            first = first or time.monotonic() - start
            pieces.append(piece)
        usage_of(event, usage)
    total = time.monotonic() - start
    return {"status": answer.status, "ttft": first, "seconds": total, "text": "".join(pieces), **usage}


def start(engine: str, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """The engine serving MODEL on a free port, its log in --log-dir, once it answers /health."""
    port = free_port()
    log = (args.log_dir / f"{engine}.log").open("w")
    process = subprocess.Popen(engine_command(engine, args, port), stdout=log, stderr=subprocess.STDOUT)
    wait_ready(port, process)
    return process, port


def replay_all(engines: list[str], args: argparse.Namespace, requests: list[dict]) -> list[dict]:
    """Every engine serving at once (one process each, so each keeps its own cache), each request sent to each
    engine in turn (the first engine rotating), so that other load on the machine falls on all of them alike."""
    servers = []
    try:
        for engine in engines:
            servers.append(start(engine, args))
        runs = [{"engine": engine, "requests": []} for engine in engines]
        for index, request in enumerate(requests):
            order = [(index + k) % len(engines) for k in range(len(engines))]
            for which in order:
                runs[which]["requests"].append(send(servers[which][1], request, args.max_tokens))
                took = runs[which]["requests"][-1]["seconds"]
                print(f"  {engines[which]} {index + 1}/{len(requests)}: {took:.1f} s", file=sys.stderr)
        for run in runs:
            run["total"] = sum(one["seconds"] for one in run["requests"])
        return runs
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=60)


def table(runs: list[dict], requests: list[dict]) -> str:
    """One row per request (its path, then each engine's prompt/cached tokens and time to first token)."""
    head = "| # | path | " + " | ".join(f"{r['engine']}: prompt (cached), TTFT s" for r in runs) + " |"
    lines = [head, "|" + "---|" * (2 + len(runs))]
    for index, request in enumerate(requests):
        cells = []
        for run in runs:
            one = run["requests"][index]
            ttft = f"{one['ttft']:.2f}" if one["ttft"] is not None else f"- ({one['seconds']:.2f} total)"
            cells.append(f"{one.get('prompt', '?')} ({one.get('cached', '?')}), {ttft}")
        lines.append(f"| {index + 1} | {request['path']} | " + " | ".join(cells) + " |")
    lines.append("| | total s | " + " | ".join(f"{run['total']:.1f}" for run in runs) + " |")
    return "\n".join(lines)


def replay(args: argparse.Namespace) -> None:
    requests = [json.loads(line) for line in args.session.read_text().splitlines() if line.strip()]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    engines = ["dflash"] + (["dflash-plain"] if args.plain else []) + (["llama-server"] if args.llama_server else [])
    runs = replay_all(engines, args, requests)
    print(table(runs, requests))
    if args.plain:
        same = sum(a["text"] == b["text"] for a, b in zip(runs[0]["requests"], runs[1]["requests"], strict=True))
        print(f"dflash's texts equal dflash --no-draft's: {same} of {len(requests)}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("session", type=Path)
    rec.add_argument("--upstream", required=True)
    rec.add_argument("--port", type=int, default=8100)
    com = commands.add_parser("compose")
    com.add_argument("captured", type=Path, nargs="+")
    com.add_argument("--turns", type=int, default=3)
    com.add_argument("--tool-result", type=Path, default=Path(__file__).resolve().parent.parent / "README.md")
    com.add_argument("-o", "--out", type=Path, required=True)
    com.add_argument("--as-text", action="store_true", help="each request as the same ChatML text completion")
    rep = commands.add_parser("replay")
    rep.add_argument("session", type=Path)
    rep.add_argument("model")
    rep.add_argument("--drafter")
    rep.add_argument("--llama-server", help="the llama-server binary (built from the vendored llama.cpp)")
    rep.add_argument("--chat-template", help="chatml for a base model (both engines); default: the GGUF's")
    rep.add_argument("--context", type=int, default=32768)
    rep.add_argument("--threads", type=int, default=1)
    rep.add_argument("--max-tokens", type=int, default=32)
    rep.add_argument("--plain", action="store_true")
    rep.add_argument("--json", type=Path)
    rep.add_argument("--log-dir", type=Path, default=Path("/tmp/agent-session-logs"))
    args = parser.parse_args()
    {"record": record, "compose": compose, "replay": replay}[args.command](args)


if __name__ == "__main__":
    main()
