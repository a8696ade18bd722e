"""A stand-in for llama-server speaking the few endpoints `dflash bench --peer` uses (GET /health, GET /metrics, POST
/completion with prompt ids), so that the peer path runs without building llama.cpp. Plain, it answers each prompt
with ids derived from the prompt; with --spec-type it answers the same, except its third completion (the second
prompt after the warm-up), whose last id differs, and it counts drafts in /metrics. FAKE_REFUSE=1 makes it refuse
the drafter as a real llama-server refuses a GGUF it cannot load; FAKE_CRASH=1 makes it abort in its first speculative
request, as stock llama-server's draft-dflash does on Gemma 3 (docs/benchmarks.md)."""

from __future__ import annotations

import http.server
import json
import os
import sys


def main() -> None:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    spec = args[args.index("--spec-type") + 1] if "--spec-type" in args else None
    if spec and os.environ.get("FAKE_REFUSE") == "1":
        print("llama_model_load: error loading model: unknown model architecture: 'dflash'", flush=True)
        sys.exit(1)
    state = {"requests": 0, "drafts": 0, "accepted": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self.reply(200, b'{"status":"ok"}')
            elif self.path == "/metrics":
                lines = [
                    f"llamacpp:spec_decode_num_drafts_total {state['drafts']}",
                    f"llamacpp:spec_decode_num_accepted_tokens_total {state['accepted']}",
                ]
                self.reply(200, ("\n".join(lines) + "\n").encode(), "text/plain")
            else:
                self.reply(404, b"{}")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"] += 1
            if spec and os.environ.get("FAKE_CRASH") == "1":
                print("llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr) failed", flush=True)
                print("#2  0x0000558b642980c8 in ggml_abort ()", flush=True)
                os.abort()
            prompt, count = body["prompt"], body["n_predict"]
            ids = [(sum(prompt) + 7 * i) % 40 for i in range(count)]
            timings = {"predicted_n": count, "predicted_ms": 10.0 * count}
            if spec:
                if state["requests"] == 3:
                    ids[-1] = (ids[-1] + 1) % 40
                steps = count // 2
                state["drafts"] += steps
                state["accepted"] += count - 1 - steps
                timings |= {"draft_n": 3 * steps, "draft_n_accepted": count - 1 - steps}
            answer = {"content": "", "tokens": ids, "timings": timings}
            self.reply(200, json.dumps(answer).encode())

        def log_message(self, *_: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
