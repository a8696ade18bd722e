"""Streamed text read as it comes: the one rule for holding back a tail that may begin a marker, and the `<think>`
reasoning split (Qwen3, Qwen3.5/3.6, DeepSeek-style) that `dflash chat` and `dflash serve` share."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINKING, ANSWER, TAG = "thinking", "answer", "tag"

Piece = tuple[str, str]  # streamed text and its kind: THINKING, ANSWER or TAG (a <think> or </think> itself)


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text may begin one of markers (held back until more text comes); only as
    many as text has are tried, so a long marker costs no more than the text it holds back."""
    sizes = ((m, range(1, min(len(m), len(text) + 1))) for m in markers)
    return max((n for m, ns in sizes for n in ns if text.endswith(m[:n])), default=0)


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open <think> (templates whose generation prompt opens it)."""
    return prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE)


class ThinkSplit:
    """Splits streamed text into thinking (between <think> and </think>), answer and the tags themselves, holding back
    a tail that may begin a tag; `inside`: the prompt opened the thinking already."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self.thought = inside  # whether any thinking came (its answer then begins after the newlines that follow)
        self.pending = ""

    def add(self, delta: str, last: bool = False) -> list[Piece]:
        """The pieces of held text + delta that are sure to lie outside a partial tag (last: all of them)."""
        text, self.pending, pieces = self.pending + delta, "", []
        while True:
            tag = THINK_CLOSE if self.inside else THINK_OPEN
            at = text.find(tag)
            if at < 0:
                keep = 0 if last else held(text, (tag,))
                self.pending = text[len(text) - keep :]
                _add(pieces, text[: len(text) - keep], THINKING if self.inside else ANSWER)
                return pieces
            _add(pieces, text[:at], THINKING if self.inside else ANSWER)
            pieces.append((tag, TAG))
            self.inside, self.thought, text = not self.inside, True, text[at + len(tag) :]


def _add(pieces: list[Piece], text: str, kind: str) -> None:
    if text:
        pieces.append((text, kind))
