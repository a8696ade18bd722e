"""Conversation A, then B, then A with one more turn against a running `dflash serve`: each request's wall time,
prompt and cached tokens (docs/serve.md's prompt-cache measurement). Prompts are heldout texts joined to about
--chars characters each (Gemma 3's tokenizer: about 4 per token):

    .venv/bin/dflash serve gemma3-270m --chat-template chatml --threads 1 --port 8731 &
    .venv/bin/python -m benchmarks.prompt_cache_aba --url http://127.0.0.1:8731
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "models" / "gemma3-270m" / "heldout_prompts.jsonl"


def texts(chars: int) -> tuple[str, str]:
    """Two unrelated long texts: heldout prompts joined, the even ones for A, the odd ones for B."""
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    a, b = "\n\n".join(prompts[0::2]), "\n\n".join(prompts[1::2])
    return a[:chars], b[:chars]


def ask(url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict, str]:
    """One greedy chat request: wall seconds, usage and the answer's text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as reply:
        answer = json.load(reply)
    return time.perf_counter() - began, answer["usage"], answer["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8731")
    parser.add_argument("--chars", type=int, default=6000)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    a_text, b_text = texts(args.chars)
    a = [{"role": "user", "content": f"Summarize this:\n\n{a_text}"}]
    b = [{"role": "user", "content": f"Summarize this:\n\n{b_text}"}]
    first = ask(args.url, a, args.max_tokens)
    second = ask(args.url, b, args.max_tokens)
    a2 = a + [{"role": "assistant", "content": first[2]}, {"role": "user", "content": "Now in one sentence."}]
    third = ask(args.url, a2, args.max_tokens)
    for name, (seconds, usage, _) in zip(("A", "B", "A again"), (first, second, third), strict=True):
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        print(f"{name:8} {seconds:7.2f} s  prompt {usage['prompt_tokens']:5}  cached {cached:5}")


if __name__ == "__main__":
    main()
