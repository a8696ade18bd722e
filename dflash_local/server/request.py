"""The one inside shape of a request, whichever of the six endpoints brought it (OpenAI's chat completions,
completions and Responses, Anthropic's Messages, Ollama's /api/chat and /api/generate): chat messages as templates
take them or a raw prompt, the function tools, the sampling and the thinking switch; the one job that renders it and
reads its reply into parts, which each API writes in its own shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..chat_template import takes_tools
from ..decode import Stats
from ..generation import LoadedModels
from ..reply.channels import PLAIN, Parts
from .engine import Engine, Job
from .protocol import Sampling
from .tools import conversation

SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class InnerRequest:
    """A request inside, from any of the six endpoints: chat messages in OpenAI's shape (tool calls' arguments as
    objects) or a raw prompt, with its checked sampling, function tools and thinking switch."""

    sampling: Sampling  # with any grammar
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # text or token ids, encoded as it is (no template)
    tools: list[dict] | None = None  # OpenAI function tools (None: none)
    thinking: bool | None = None  # None: the server's default
    plain: bool = False  # the reply read as it is, not as the model's family writes it (a raw prompt's always is)


def request_job(engine: Engine, request: InnerRequest, count_only: bool = False) -> Job:
    """The job that renders the request (a raw prompt as it is, messages through the chat template and its tools)
    and reads its reply (count_only: only counts the prompt's tokens)."""

    def render(models: LoadedModels) -> list[int]:
        prompt = request.prompt
        if prompt is not None:
            return models.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        enable = engine.thinking if request.thinking is None else request.thinking
        turns, shown = conversation(request.messages or [], request.tools, takes_tools(models.tokenizer.config))
        return models.tokenizer.encode_chat(turns, True, enable, shown)

    family = PLAIN if request.plain or request.prompt is not None else engine.family
    loop = asyncio.get_running_loop()
    return Job(render, request.sampling, loop, family=family, tools=request.tools, count_only=count_only)


def one_system(messages: list[dict[str, Any]], system: str = "") -> list[dict[str, Any]]:
    """The messages with `system` and every system or developer turn, wherever it stands, joined into one system
    message at the start (most templates take a system message only there)."""
    texts = [system] if system else []
    texts += [m["content"] for m in messages if m["role"] in SYSTEM_ROLES and m["content"]]
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    return ([{"role": "system", "content": "\n\n".join(texts)}] if texts else []) + rest


def sse(data: dict | str) -> str:
    """One server-sent event's data (JSON unless text)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_event(kind: str, body: dict) -> str:
    """One named server-sent event, its data the body with its type (as Anthropic's and the Responses streams
    write them)."""
    return f"event: {kind}\n" + sse({"type": kind} | body)


def dflash_stats(stats: Stats) -> dict:
    """The decode loop's own numbers, as every API's usage carries them: tau, acceptance lengths, block sizes,
    decode tokens/s, prefilled tokens, and the accepted tokens by draft source."""
    return {
        "tau": stats.tau,
        "acceptance_lengths": stats.acceptance_lengths,
        "block_sizes": stats.block_sizes,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "prefill_tokens": stats.prefill_tokens,
        "tokens_by_source": stats.tokens_by_source,
    }


REASONING, TEXT = "reasoning", "text"
Step = tuple[str, int, str, Any]  # "open", "delta", "close" or "call"; the block's index; its kind; text or call


class Blocks:
    """A streamed reply as numbered blocks, as Anthropic's and OpenAI's Responses streams write them: reasoning and
    text blocks opened, extended and closed as parts come, each tool call a block of its own."""

    def __init__(self) -> None:
        self.index, self.kind, self.text = -1, "", ""

    def add(self, parts: Parts) -> Iterator[Step]:
        """The steps for one part of the reply."""
        for kind, text in ((REASONING, parts.reasoning), (TEXT, parts.content)):
            if text:
                if self.kind != kind:
                    yield from self.close()
                    self.index, self.kind, self.text = self.index + 1, kind, ""
                    yield ("open", self.index, kind, "")
                self.text += text
                yield ("delta", self.index, kind, text)
        for call in parts.calls:
            yield from self.close()
            self.index += 1
            yield ("call", self.index, "call", call)

    def close(self) -> Iterator[Step]:
        """Close the open block, if any (its whole text with it)."""
        if self.kind:
            yield ("close", self.index, self.kind, self.text)
        self.kind, self.text = "", ""
