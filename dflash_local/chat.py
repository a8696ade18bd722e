"""The interactive chat loop: chat template, streaming answers, a live status line, slash commands."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .decode import Settings, Stats, generate
from .errors import DFlashError
from .generation import LoadedModels
from .sampling import SamplingParams
from .tokenizer import Detokenizer

HELP = """commands:
  /help          this text
  /reset         forget the conversation
  /stats         statistics of the last answer and of the session
  /temp X        sampling temperature (0 = greedy, lossless vs the target's greedy output)
  /block N       draft block size (2..the drafter's trained size)
  /draft on|off  speculative decoding on or off (off = plain autoregressive)
  /quit          leave (Ctrl-D works too)"""


@dataclass
class ChatState:
    """The conversation and the knobs the user can turn."""

    settings: Settings
    messages: list[dict[str, str]] = field(default_factory=list)
    last: Stats | None = None
    session_tokens: int = 0
    session_decode_s: float = 0.0


def acceptance_bar(accepted: int, block_size: int) -> str:
    """B cells, the accepted ones filled: the last step at a glance."""
    return "█" * accepted + "·" * max(0, block_size - accepted)


def status_line(stats: Stats, draft: bool) -> str:
    """tokens/s, tau, last step's acceptance, drafter vs target time."""
    parts = [f"{stats.new_tokens} tok", f"{stats.decode_tokens_per_s:.1f} tok/s"]
    if draft and stats.acceptance_lengths:
        parts.append(f"tau {stats.tau:.2f}")
        parts.append(acceptance_bar(stats.acceptance_lengths[-1], stats.block_size))
        parts.append(f"draft {100 * stats.draft_s / max(stats.decode_s, 1e-9):.0f}% / target")
    elif not draft:
        parts.append("no drafting")
    return " · ".join(parts)


class Chat:
    """One chat session over loaded models, writing to a console."""

    def __init__(self, models: LoadedModels, settings: Settings, console: Console) -> None:
        if models.tokenizer is None:
            raise DFlashError("The model has no tokenizer.json, so it cannot chat.")
        self.models = models
        self.console = console
        self.state = ChatState(settings)

    def prompt_ids(self) -> list[int]:
        """The conversation as ids, dropping the oldest turns (and saying so) until it fits."""
        room = self.models.target.max_context - self.state.settings.max_new_tokens
        while True:
            ids = self.models.tokenizer.encode_chat(self.state.messages, add_generation_prompt=True)
            if len(ids) <= room or len(self.state.messages) <= 1:
                break
            self.state.messages = self.state.messages[2:]
            self.console.print("[dim](context full: dropped the oldest turn)[/dim]")
        if len(ids) > room:
            raise DFlashError("This message alone does not fit the context; send a shorter one.")
        return ids

    def answer(self, text: str) -> None:
        """Stream the model's answer to one user message; Ctrl-C stops it early."""
        self.state.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        settings = self.state.settings
        drafter = self.models.drafter if settings.draft else None
        stats, detok, reply = Stats(), Detokenizer(self.models.tokenizer), ""
        live = Live(console=self.console, auto_refresh=False) if self.console.is_terminal else nullcontext()
        try:
            with live:
                for step in generate(self.models.target, drafter, ids, settings):
                    stats.add(step)
                    reply += detok.add([t for t in step.token_ids if t not in settings.stop_ids])
                    if isinstance(live, Live):
                        status = Text(status_line(stats, settings.draft), style="dim")
                        live.update(Group(Text(reply), status), refresh=True)
        except KeyboardInterrupt:
            self.console.print("[dim](stopped)[/dim]")
        if not isinstance(live, Live):
            self.console.print(reply, markup=False)
            self.console.print(status_line(stats, settings.draft), markup=False)
        self.state.messages.append({"role": "assistant", "content": reply})
        self.state.last = stats
        self.state.session_tokens += stats.new_tokens
        self.state.session_decode_s += stats.decode_s

    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, arg = line.strip().partition(" ")
        arg, state = arg.strip(), self.state
        if name in ("/quit", "/exit", "/bye"):
            return False
        if name == "/help":
            self.console.print(HELP)
        elif name == "/reset":
            state.messages = []
            self.console.print("(conversation cleared)")
        elif name == "/stats":
            self.console.print(self.stats_text())
        elif name == "/temp":
            temp = _number(arg, float, "/temp needs a number, e.g. /temp 0.7")
            sampling = SamplingParams(temp, state.settings.sampling.top_p, state.settings.sampling.top_k)
            state.settings = replace(state.settings, sampling=sampling)
            self.console.print(f"(temperature {temp})")
        elif name == "/block":
            size = _number(arg, int, "/block needs a whole number, e.g. /block 8")
            limit = self.models.drafter.block_size if self.models.drafter else 0
            if not 2 <= size <= limit:
                raise DFlashError(f"The block size must be between 2 and the drafter's trained {limit}.")
            state.settings = replace(state.settings, block_size=size)
            self.console.print(f"(block size {size})")
        elif name == "/draft":
            if arg not in ("on", "off"):
                raise DFlashError("Use /draft on or /draft off.")
            if arg == "on" and self.models.drafter is None:
                raise DFlashError("No drafter is loaded, so drafting cannot be turned on.")
            state.settings = replace(state.settings, draft=arg == "on")
            self.console.print(f"(drafting {arg})")
        else:
            self.console.print(f"unknown command {name}; /help lists them")
        return True

    def stats_text(self) -> str:
        last = self.state.last
        if last is None:
            return "(no answer yet)"
        histogram = " ".join(f"{k}:{v}" for k, v in last.histogram().items() if v)
        session_rate = self.state.session_tokens / max(self.state.session_decode_s, 1e-9)
        return (
            f"last answer: {status_line(last, self.state.settings.draft)}\n"
            f"  time to first token {last.prefill_s * 1000:.0f} ms · acceptance histogram {histogram or '-'}\n"
            f"session: {self.state.session_tokens} tokens · {session_rate:.1f} tok/s"
        )


def _number(text: str, kind: type, message: str):
    try:
        return kind(text)
    except ValueError:
        raise DFlashError(message) from None


def run_chat(models: LoadedModels, settings: Settings, stdin: TextIO = sys.stdin) -> None:
    """Interactive loop on a terminal; on a pipe, one answer per input line."""
    interactive = stdin.isatty()
    console = Console(highlight=False, force_terminal=interactive or None)
    chat = Chat(models, settings, console)
    if interactive:
        console.print("[dim]type a message, /help for commands, /quit to leave[/dim]")
    while True:
        try:
            line = console.input("[bold]>>> [/bold]") if interactive else stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /quit to leave)[/dim]")
            continue
        if not interactive and line == "":
            break
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not chat.command(line):
                    break
            else:
                chat.answer(line)
        except DFlashError as exc:
            console.print(f"error: {exc}")
