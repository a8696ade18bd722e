"""A chat reply read the way its model family writes it: reasoning apart from the answer (`<think>` blocks, harmony's
analysis channel, Gemma 4's thought channel), and the family's own tool calls (gpt-oss's harmony messages, Gemma 4's
`<|tool_call>` blocks), text by text as TextStream feeds it. Which family is chosen once per model, from the markers
of its chat template; the answer then goes through tool_calls.ToolText, which reads the Hermes-style `<tool_call>`
JSON that every family may write (a forced call's grammar writes it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..chat_template import template_source
from ..reasoning import ANSWER, TAG, THINK_CLOSE, THINK_OPEN, THINKING, Piece
from .tool_calls import ToolText, make_call, tool_names

HARMONY, GEMMA4, THINK, PLAIN = "harmony", "gemma4", "think", "plain"


def reply_family(tokenizer_config: dict[str, Any]) -> str:
    """The family a chat template writes replies in: harmony (gpt-oss), gemma4, think (`<think>` reasoning: Qwen3,
    Qwen3.5/3.6, DeepSeek-style), or plain (the rest)."""
    source = template_source(tokenizer_config) or ""
    if "<|channel|>" in source and "<|message|>" in source:
        return HARMONY
    if "<|tool_call>" in source and "<|channel>" in source:
        return GEMMA4
    if THINK_OPEN in source and THINK_CLOSE in source:
        return THINK
    return PLAIN


@dataclass
class Parts:
    """What one piece of a reply adds: its text in order, each piece THINKING, ANSWER or TAG (markup, which chat shows
    dimmed and the APIs leave out), and tool calls read whole."""

    pieces: list[Piece] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, text: str, kind: str = ANSWER) -> Parts:
        """Parts of one text of one kind."""
        parts = cls()
        parts.add(text, kind)
        return parts

    def add(self, text: str, kind: str) -> None:
        """Append text of kind (nothing for no text)."""
        if text:
            self.pieces.append((text, kind))

    @property
    def reasoning(self) -> str:
        return "".join(text for text, kind in self.pieces if kind == THINKING)

    @property
    def content(self) -> str:
        return "".join(text for text, kind in self.pieces if kind == ANSWER)

    def __bool__(self) -> bool:
        return bool(self.pieces or self.calls)

    def __iadd__(self, other: Parts) -> Parts:
        self.pieces += other.pieces
        self.calls += other.calls
        return self


class Harmony:
    """gpt-oss's harmony messages: `[<|start|>assistant]<|channel|>C [to=functions.NAME] [<|constrain|>json]
    <|message|>BODY`, each ended by <|end|>, <|call|>, <|return|> or the next <|start|>. Channel analysis is
    reasoning, a message to functions.NAME a call of NAME with BODY its JSON arguments, the rest the answer. A reply
    that does not begin with a header is plain text; a call that does not parse comes back as its text."""

    HEADS = ("<|channel|>", "<|start|>")
    ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    MARKERS = ENDS + ("<|channel|>", "<|message|>")

    def __init__(self, names: set[str]) -> None:
        self.names, self.text, self.at = names, "", 0
        self.mode = "start"  # start, header, body or plain
        self.header, self.recipient, self.body, self.reasoning = "", None, "", False

    def add(self, delta: str, last: bool = False) -> Parts:
        """Read delta; return what is known now (last: the reply ended, nothing is held back)."""
        self.text += delta
        out = Parts()
        while True:
            rest = self.text[self.at :]
            if self.mode == "start":
                lead = rest.lstrip()
                if not lead and not last:
                    return out  # not yet known whether a header begins
                self.mode = "header" if lead.startswith(self.HEADS) else "plain"
            elif self.mode == "plain":
                self.at = len(self.text)
                out.add(rest, ANSWER)
                return out
            elif self.mode == "header":
                at = rest.find("<|message|>")
                if at < 0:
                    if last:  # a header never finished: its text
                        out.add(rest, ANSWER)
                        self.at = len(self.text)
                    return out
                self._open(rest[:at])
                self.at += at + len("<|message|>")
                out.add(rest[: at + len("<|message|>")] if self.recipient is None else "", TAG)  # a call's: its own
            else:
                ends = [(at, m) for m in self.ENDS if (at := rest.find(m)) >= 0]
                if ends:
                    at, marker = min(ends)
                    out += self._body(rest[:at], done=True)
                    out.add(marker, TAG)
                    self.at += at + len(marker)
                    self.mode = "header"
                    continue
                out += self._body(rest, done=last)
                self.at = len(self.text)
                return out

    def _open(self, header: str) -> None:
        """Start a message with this header."""
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"\bto=([^\s<]+)", header)
        self.header, self.body, self.mode = header, "", "body"
        self.recipient = recipient.group(1) if recipient else None
        self.reasoning = self.recipient is None and channel is not None and channel.group(1) == "analysis"

    def _body(self, text: str, done: bool) -> Parts:
        """Body text of the open message (done: its last)."""
        if self.recipient is None:
            return Parts.of(text, THINKING if self.reasoning else ANSWER)
        self.body += text
        if not done:
            return Parts()
        name = self.recipient.removeprefix("functions.") if self.recipient.startswith("functions.") else None
        call = make_call(name, self.body.strip(), self.names)
        return Parts(calls=[call]) if call else Parts.of(f"{self.header}<|message|>{self.body}")


GEMMA_STRING = '<|"|>'


class Gemma4:
    """Gemma 4's replies: `<|channel>thought\n...<channel|>` is reasoning, `<|tool_call>call:NAME{key:value,...}
    <tool_call|>` a call (strings quoted by <|"|>, keys bare), the rest the answer; a call that does not parse comes
    back as its text."""

    CLOSES = {"<|channel>": "<channel|>", "<|tool_call>": "<tool_call|>"}
    STRAY = ("<channel|>", "<|tool_response>")  # dropped where they stand alone
    LABEL = "<|channel>thought\n"  # a marker too: TextStream holds back a part of it, so the label arrives whole
    MARKERS = (*CLOSES, *CLOSES.values(), "<|tool_response>", LABEL)

    def __init__(self, names: set[str]) -> None:
        self.names, self.text, self.at = names, "", 0
        self.inside = ""  # the open block

    def add(self, delta: str, last: bool = False) -> Parts:
        """Read delta; return what is known now (last: the reply ended, nothing is held back)."""
        self.text += delta
        out = Parts()
        while True:
            rest = self.text[self.at :]
            if not self.inside:
                found = [(at, m) for m in (*self.CLOSES, *self.STRAY) if (at := rest.find(m)) >= 0]
                if not found:
                    out.add(rest, ANSWER)
                    self.at = len(self.text)
                    return out
                at, marker = min(found)
                out.add(rest[:at], ANSWER)
                self.at += at + len(marker)
                self.inside = marker if marker in self.CLOSES else ""
                if marker == "<|channel>":  # `thought` and its newline
                    marker += re.match(r"(?:thought)?\n?", self.text[self.at :]).group(0)  # type: ignore[union-attr]
                    self.at += len(marker) - len("<|channel>")
                out.add(marker if marker != "<|tool_call>" else "", TAG)  # a call's: its own
                continue
            close = self.CLOSES[self.inside]
            at = rest.find(close)
            if self.inside == "<|channel>":
                out.add(rest[: at if at >= 0 else len(rest)], THINKING)
                if at < 0:
                    self.at = len(self.text)
                    return out
                out.add(close, TAG)
                self.at += at + len(close)
            else:
                if at < 0 and not last:
                    return out
                end = at + len(close) if at >= 0 else len(rest)  # a call cut off at the end: its text
                call = _gemma_call(rest[:at], self.names) if at >= 0 else None
                out += Parts(calls=[call]) if call else Parts.of(self.inside + rest[:end])
                self.at += end
            self.inside = ""


def _gemma_call(body: str, names: set[str]) -> dict | None:
    """One OpenAI tool call from a Gemma 4 call body `call:NAME{...}`, or None."""
    found = re.fullmatch(r"\s*call:([A-Za-z0-9_.-]{1,64})(\{.*\})\s*", body, re.DOTALL)
    if not found:
        return None
    try:
        arguments, end = _gemma_value(found.group(2), 0)
    except (ValueError, IndexError):
        return None
    if end != len(found.group(2)) or not isinstance(arguments, dict):
        return None
    return make_call(found.group(1), arguments, names)


def _gemma_value(text: str, at: int) -> tuple[Any, int]:
    """The Gemma 4 value at text[at:] (a <|"|> string, {bare_key:value}, [values], a number, true, false, null)
    and where it ends; ValueError where there is none."""
    at = _skip(text, at)
    if text.startswith(GEMMA_STRING, at):
        end = text.index(GEMMA_STRING, at + len(GEMMA_STRING))
        return text[at + len(GEMMA_STRING) : end], end + len(GEMMA_STRING)
    if text[at] in "{[":
        close, items, keyed = ("}" if text[at] == "{" else "]"), [], text[at] == "{"
        at = _skip(text, at + 1)
        while text[at] != close:
            key = None
            if keyed:
                if text.startswith(GEMMA_STRING, at):
                    key, at = _gemma_value(text, at)
                else:
                    colon = text.index(":", at)
                    key, at = text[at:colon].strip(), colon
                if not key or not isinstance(key, str) or re.search(r"[,{}\[\]]", key) or text[_skip(text, at)] != ":":
                    raise ValueError("a key without a value")
                at = _skip(text, at) + 1
            value, at = _gemma_value(text, at)
            items.append((key, value))
            at = _skip(text, at)
            if text[at] == ",":
                at = _skip(text, at + 1)
            elif text[at] != close:
                raise ValueError("no separator")
        return (dict(items) if keyed else [v for _, v in items]), at + 1
    found = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null").match(text, at)
    if not found:
        raise ValueError("no value")
    return json.loads(found.group(0)), found.end()


def _skip(text: str, at: int) -> int:
    """The first position at or after at that is not whitespace."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class Think:
    """`<think>...</think>` is reasoning, the rest the answer (`inside`: the prompt opened the thinking); the tags and
    the newlines that begin each part (templates write them after the tags) are markup."""

    MARKERS = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, inside: bool) -> None:
        self.inside, self.strip = inside, True

    def add(self, delta: str, last: bool = False) -> Parts:
        """Read delta; return its pieces (TextStream holds back a tail that may begin a tag, so tags arrive whole)."""
        out = Parts()
        while True:
            tag = THINK_CLOSE if self.inside else THINK_OPEN
            at = delta.find(tag)
            text = delta if at < 0 else delta[:at]
            if self.strip:
                body = text.lstrip("\n")
                out.add(text[: len(text) - len(body)], TAG)
                text, self.strip = body, not body
            out.add(text, THINKING if self.inside else ANSWER)
            if at < 0:
                return out
            out.add(tag, TAG)
            self.inside, self.strip, delta = not self.inside, True, delta[at + len(tag) :]


class Plain:
    """A family that writes its reply as it is: all of it the answer."""

    MARKERS: tuple[str, ...] = ()

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def add(self, delta: str, last: bool = False) -> Parts:
        return Parts.of(delta)


FAMILIES = {HARMONY: Harmony, GEMMA4: Gemma4, PLAIN: Plain}


class ReplyReader:
    """One chat reply, streamed: the family's reading of it, then (with tools) Hermes-style calls in its answer;
    `markers`: the texts whose beginning TextStream holds back."""

    def __init__(self, family: str, tools: list[dict] | None, inside: bool = False) -> None:
        """inside: the prompt opened a <think> (the think family's reply begins in its reasoning)."""
        names = tool_names(tools or [])
        self.family = Think(inside) if family == THINK else FAMILIES[family](names)
        self.tools = ToolText(tools) if tools else None
        self.markers: tuple[str, ...] = self.family.MARKERS + (ToolText.MARKERS if tools else ())

    def add(self, delta: str) -> Parts:
        """Read delta; return the reasoning and answer text that can be sent now, and the family's calls read."""
        return self._answer(self.family.add(delta))

    def finish(self) -> Parts:
        """The rest, at the end of the reply: everything held back, and all calls not yet returned."""
        out = self._answer(self.family.add("", last=True))
        if self.tools is not None:
            rest, calls = self.tools.finish()
            out += Parts.of(rest)
            out.calls += calls
        return out

    def _answer(self, parts: Parts) -> Parts:
        if self.tools is not None:
            pieces = [(self.tools.add(text) if kind == ANSWER else text, kind) for text, kind in parts.pieces]
            parts.pieces = [(text, kind) for text, kind in pieces if text]
        return parts


def collected(parts: Parts) -> Parts:
    """A whole reply from its streamed parts: its reasoning, its answer (stripped where calls came with it), its
    calls."""
    out = Parts.of(parts.reasoning, THINKING)
    out.add(parts.content.strip() if parts.calls else parts.content, ANSWER)
    out.calls = parts.calls
    return out
