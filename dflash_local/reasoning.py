"""Streamed text's vocabulary: the one rule for holding back a tail that may begin a marker, the `<think>` tags
(Qwen3, Qwen3.5/3.6, DeepSeek-style) and the kinds of a reply's pieces."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINKING, ANSWER, TAG = "thinking", "answer", "tag"

Piece = tuple[str, str]  # streamed text and its kind: THINKING, ANSWER or TAG (markup: a tag, a marker, its newlines)


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text may begin one of markers (held back until more text comes); only as
    many as text has are tried, so a long marker costs no more than the text it holds back."""
    sizes = ((m, range(1, min(len(m), len(text) + 1))) for m in markers)
    return max((n for m, ns in sizes for n in ns if text.endswith(m[:n])), default=0)


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open <think> (templates whose generation prompt opens it)."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)
