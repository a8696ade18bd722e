"""The interactive chat loop: chat template, streaming answers, a live status line, slash commands."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, TextIO

from rich.cells import cell_len, chop_cells
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from .chat_template import render_chat, template_source, uses_thinking
from .decode import Settings, Stats
from .defaults import check_block
from .errors import DFlashError
from .generation import GenerationRequest, LoadedModels, device_label, placement_line, stream
from .reasoning import ANSWER, Piece, opens_thinking
from .reply.channels import Parts, ReplyReader, reply_family
from .reply.text_stream import TextStream, end_texts, ending
from .sampling import SamplingParams
from .vision import MEDIA_MARKER, Chunk, Projector, image_file, named_images, prefill_for

HELP = """commands:
  /help          this text
  /reset         forget the conversation
  /stats         statistics of the last answer and of the session
  /temp X        sampling temperature (0 = greedy, lossless vs the target's greedy output)
  /block N|auto  verify block size (2..the drafter's trained size), or auto: chosen every step
  /draft on|off  speculative decoding on or off (off = plain autoregressive)
  /think on|off  the chat template's thinking mode (templates with enable_thinking, e.g. Qwen3)
  /image PATH    attach an image to the next message (a model with a projector, or --mmproj)
  /quit          leave (Ctrl-D works too)"""


@dataclass
class ChatState:
    """The conversation and the knobs the user can turn."""

    settings: Settings
    thinking: bool | None = None  # the template's enable_thinking; None when the template has no such switch
    messages: list[dict[str, str]] = field(default_factory=list)
    last: Stats | None = None
    session_tokens: int = 0
    session_decode_s: float = 0.0


def acceptance_bar(accepted: int, block_size: int) -> str:
    """B cells, the accepted ones filled: the last step at a glance."""
    return "█" * accepted + "·" * max(0, block_size - accepted)


def status_line(stats: Stats, draft: bool, thinking: bool | None = None, where: str | None = None) -> str:
    """tokens/s, tau, last step's acceptance, drafter vs target time; the thinking mode where the template has one;
    where the models run."""
    parts = [f"{stats.new_tokens} tok", f"{stats.decode_tokens_per_s:.1f} tok/s"]
    if draft and stats.acceptance_lengths:
        parts.append(f"tau {stats.tau:.2f}")
        parts.append(f"k {stats.block_sizes[-1]} {acceptance_bar(stats.acceptance_lengths[-1], stats.block_sizes[-1])}")
        parts.append(f"draft {100 * stats.draft_s / max(stats.decode_s, 1e-9):.0f}% / target")
    elif not draft:
        parts.append("no drafting")
    if thinking is not None:
        parts.append(f"think {'on' if thinking else 'off'}")
    if where is not None:
        parts.append(f"on {where}")
    return " · ".join(parts)


def styled(pieces: list[Piece]) -> Text:
    """Pieces as rich text, thinking (and its tags) dimmed."""
    text = Text()
    for piece, kind in pieces:
        text.append(piece, style="" if kind == ANSWER else "dim")
    return text


def finished_rows(text: Text, width: int) -> tuple[list[Text], Text]:
    """Split growing text into rows that are final (ended lines, full-width rows cut at a space) and the rest."""
    *rows, rest = text.split("\n", allow_blank=True)
    while cell_len(rest.plain) > width:
        head = chop_cells(rest.plain, width)[0]
        cut = head.rfind(" ")
        cut = cut + 1 if cut > 0 else len(head)
        row = rest[:cut]
        row.rstrip()
        rows.append(row)
        rest = rest[cut:]
    return rows, rest


class TerminalAnswer:
    """An answer streaming on a terminal: final rows are printed once, above a live region that holds only the
    unfinished row and the status line (so an answer taller than the terminal is never cropped)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = None
        self.rest = Text()
        self.status = ""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The live region, as it is now (rich redraws it after anything printed above it)."""
        if self.rest:
            yield self.rest
        yield Text(self.status, style="dim")

    def update(self, pieces: list[Piece], status: str) -> None:
        """Add pieces to the unfinished row (work bounded by one row, however long the answer), print finished
        rows above the live region, show the status."""
        if self.live is None:
            self.live = Live(self, console=self.console, auto_refresh=False)
            self.live.start()
        rows, self.rest = finished_rows(self.rest + styled(pieces), self.console.width)
        self.status = status
        if rows:
            self.console.print(Text("\n").join(rows))
        else:
            self.live.refresh()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


class PipedAnswer:
    """An answer going to a pipe: its exact text streams to stdout, the status line goes to stderr."""

    def __init__(self, out: Console, notes: Console) -> None:
        self.out, self.notes = out, notes
        self.status = ""

    def update(self, pieces: list[Piece], status: str) -> None:
        self.out.file.write("".join(piece for piece, _ in pieces))
        self.out.file.flush()
        self.status = status

    def close(self) -> None:
        if self.status:
            self.out.file.write("\n")
            self.out.file.flush()
            self.notes.print(self.status, markup=False)


class Chat:
    """One chat session over loaded models: answers go to `console`, status lines and notices to `notes`."""

    def __init__(
        self,
        models: LoadedModels,
        settings: Settings,
        console: Console,
        notes: Console | None = None,
        thinking: bool | None = None,
        projector: Projector | None = None,
    ) -> None:
        """thinking: the mode the drafter was trained with (catalog); templates with a switch default to on;
        projector: --mmproj's, for /image."""
        if models.tokenizer is None:
            raise DFlashError("The model has no tokenizer.json, so it cannot chat.")
        self.models = models
        self.console = console
        self.notes = notes or console
        switch = uses_thinking(models.tokenizer.config)
        self.state = ChatState(settings, (True if thinking is None else thinking) if switch else None)
        self.where = device_label(models.devices) if models.devices else None
        self.family = reply_family(models.tokenizer.config)  # how replies write reasoning (as serve reads them)
        self.ends = end_texts(models.tokenizer, models.stop_ids)
        self.completion = template_source(models.tokenizer.config) is None  # a base model: lines continue the text
        self.projector, self.pending = projector, []  # images for the next message (their bytes)
        self.chunks: list[Chunk] | None = None  # the last encoded conversation's chunks, where it holds images
        if self.completion:
            self.notes.print("[dim](this model has no chat template: each line continues the text so far)[/dim]")

    def fit(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """The newest turns that fit with room for the answer, and their ids; the new message must fit alone."""
        room = self.models.target.max_context - self.state.settings.max_new_tokens
        ids = self.encode(messages)
        if len(ids) > room:
            alone = len(self.encode(messages[-1:]))
            if alone > room:
                raise DFlashError(
                    f"This message is {alone} tokens, and the {self.models.target.max_context}-token context keeps "
                    f"{self.state.settings.max_new_tokens} for the answer; send a shorter one."
                )
        while len(ids) > room:
            messages = messages[2:]
            ids = self.encode(messages)
        return messages, ids

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages rendered (with the thinking mode) and tokenized, ready for the answer; without a template,
        the text so far: each user line on a line of its own, each answer right after it."""
        self.chunks = None
        images = [image for message in messages for image in message.get("images", ())]
        messages = [{key: value for key, value in m.items() if key != "images"} for m in messages]
        if images:
            text = render_chat(self.models.tokenizer.config, messages, True, self.state.thinking)
            names = [f"Image {index + 1}" for index in range(len(images))]
            self.chunks = self.projector.chunks(text, self.projector.bitmaps(images, names), add_special=False)
            return [i for chunk in self.chunks for i in chunk.row_ids()]
        if not self.completion:
            return self.models.tokenizer.encode_chat(messages, True, self.state.thinking)
        text = ""
        for message in messages:
            joint = "\n" if message["role"] == "user" and text and not text.endswith("\n") else ""
            text += joint + message["content"]
        return self.models.tokenizer.encode(text)

    def answer(self, text: str) -> None:
        """Stream the answer to one user message; the turn joins the history only once the answer starts.

        Ctrl-C before the first token (rendering, prefill) leaves the history untouched and propagates;
        Ctrl-C while decoding keeps the partial answer and returns. Thinking shows dimmed and stays out of the history.
        The models' session reuses the caches for the conversation's prefix that the last turn left there. Image
        files the message names (a path, as in piped input) are attached as /image attaches them.
        """
        if self.projector is not None and not self.completion:  # image files the message names go with it
            paths, text = named_images(text)
            self.pending = [*self.pending, *(image_file(self.projector, path) for path in paths)]
            for path in paths:
                self.notes.print(f"(image attached: {path})", markup=False, soft_wrap=True)
        user = {"role": "user", "content": MEDIA_MARKER * len(self.pending) + text, "images": self.pending}
        candidate = [*self.state.messages, user]
        messages, ids = self.fit(candidate)
        if self.chunks:  # the images' rows (those not in the caches) go in first, then the decode loop's text
            ids = prefill_for(self.models, self.chunks, self.state.settings)[0]
        settings, stats, answer = self.state.settings, Stats(), []
        reader = ReplyReader(
            self.family, None, opens_thinking(self.models.tokenizer.decode([i for i in ids[-8:] if i >= 0]))
        )
        ends = ending(self.ends, self.models.stop_ids, settings.stop_ids)
        reply = TextStream(self.models.tokenizer, self.models.stop_ids, (), ends, reader)
        view = TerminalAnswer(self.console) if self.console.is_terminal else PipedAnswer(self.console, self.notes)
        turn: dict[str, str] | None = None
        chunks = stream(self.models, GenerationRequest(ids, settings))
        try:
            try:
                with closing(chunks):
                    for chunk in chunks:
                        if turn is None:
                            turn = self.commit(messages, (len(candidate) - len(messages)) // 2)
                        stats = chunk.stats
                        status = status_line(stats, settings.draft, self.state.thinking, self.where)
                        view.update(_kept(reply.add(chunk.step.token_ids), answer), status)
                        if reply.hit is not None:
                            break
            finally:
                if turn is not None:  # the text held back shows too, and the history keeps what showed
                    status = status_line(stats, settings.draft, self.state.thinking, self.where)
                    view.update(_kept(reply.finish(stats.finish_reason)[0], answer), status)
                    turn["content"] = "".join(answer)
                view.close()
        except KeyboardInterrupt:
            if turn is None:
                raise
            self.notes.print("[dim](stopped)[/dim]")
        self.state.last = stats
        self.state.session_tokens += stats.new_tokens
        self.state.session_decode_s += stats.decode_s

    def commit(self, messages: list[dict[str, str]], dropped: int) -> dict[str, str]:
        """Make the fitted conversation the history, with an empty answer turn to fill; say what was dropped."""
        turn = {"role": "assistant", "content": ""}
        self.state.messages, self.pending = [*messages, turn], []
        if dropped:
            self.notes.print(f"[dim](context full: dropped the oldest {dropped} turn{'s' * (dropped > 1)})[/dim]")
        return turn

    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, arg = line.strip().partition(" ")
        arg, state = arg.strip(), self.state
        if name in ("/quit", "/exit", "/bye"):
            return False
        if name == "/help":
            self.console.print(HELP, markup=False)
        elif name == "/reset":
            state.messages = []
            self.console.print("(conversation cleared)")
        elif name == "/stats":
            self.console.print(self.stats_text(), markup=False)
        elif name == "/temp":
            temp = _number(arg, float, "/temp needs a number, e.g. /temp 0.7")
            sampling = SamplingParams(temp, state.settings.sampling.top_p, state.settings.sampling.top_k)
            state.settings = replace(state.settings, sampling=sampling)
            self.console.print(f"(temperature {temp})")
        elif name == "/block":
            if arg == "auto" and self.models.policy is not None:
                state.settings = replace(state.settings, block_size=None)
                self.console.print("(block size auto: chosen every step)")
                return True
            size = _number(arg, int, "/block needs auto or a whole number, e.g. /block 8")
            state.settings = replace(state.settings, block_size=check_block(size, self.models.drafter))
            self.console.print(f"(block size {size})")
        elif name == "/draft":
            if arg not in ("on", "off"):
                raise DFlashError("Use /draft on or /draft off.")
            if arg == "on" and self.models.drafter is None:
                raise DFlashError("No drafter is loaded, so drafting cannot be turned on.")
            state.settings = replace(state.settings, draft=arg == "on")
            self.console.print(f"(drafting {arg})")
        elif name == "/think":
            if arg not in ("on", "off"):
                raise DFlashError("Use /think on or /think off.")
            if state.thinking is None:
                raise DFlashError("This model's chat template has no thinking switch.")
            state.thinking = arg == "on"
            self.console.print(f"(thinking {arg})")
        elif name == "/image":
            if self.projector is None or self.completion:
                raise DFlashError(
                    "This chat takes no images: start it with the model's chat template and its vision projector "
                    "(--mmproj FILE, or a model that comes with one: dflash models marks them)."
                )
            self.pending.append(image_file(self.projector, Path(arg).expanduser()))
            self.console.print(f"(image {len(self.pending)} attached to the next message)")
        else:
            raise DFlashError(f"Unknown command {name}; /help lists them.")
        return True

    def stats_text(self) -> str:
        last = self.state.last
        if last is None:
            return "(no answer yet)"
        histogram = " ".join(f"{k}:{v}" for k, v in last.histogram().items() if v)
        blocks = " ".join(f"{k}:{v}" for k, v in last.block_histogram().items())
        session_rate = self.state.session_tokens / max(self.state.session_decode_s, 1e-9)
        cache = self.models.session.cache
        held = "" if cache is None else f"\nprompt cache: {len(cache.entries)} saved prompts, "
        held += "" if cache is None else f"{cache.used / 2**20:.0f} of {cache.budget / 2**20:.0f} MiB of host RAM"
        return (
            f"last answer: {status_line(last, self.state.settings.draft, self.state.thinking, self.where)}\n"
            f"  time to first token {last.prefill_s * 1000:.0f} ms ({last.prefill_tokens} new prompt tokens prefilled)"
            f" · acceptance histogram {histogram or '-'}\n"
            f"  steps by block size k (1 = plain): {blocks or '-'}\n"
            f"session: {self.state.session_tokens} tokens · {session_rate:.1f} tok/s"
            + (f"\nplaced: {placement_line(self.models.devices)}" if self.models.devices else "")
            + held
        )


def _kept(parts: Parts, answer: list[str]) -> list[Piece]:
    """The parts' pieces, their answer text (the turn the history keeps: no thinking, no markup) added to answer."""
    answer.append(parts.content)
    return parts.pieces


def _number(text: str, kind: type, message: str):
    try:
        return kind(text)
    except ValueError:
        raise DFlashError(message) from None


def piped_lines(stream: BinaryIO) -> Iterator[str]:
    """Lines of a byte stream as text; bytes that are not valid UTF-8 become U+FFFD and the line is still answered."""
    for raw in stream:
        yield raw.decode("utf-8", errors="replace")


def run_chat(
    models: LoadedModels,
    settings: Settings,
    stdin: TextIO | None = None,
    thinking: bool | None = None,
    projector: Projector | None = None,
) -> None:
    """Interactive loop on a terminal; on a pipe, one answer per input line. stdin: sys.stdin at the call (not at
    import: whoever runs the CLI may have replaced it). thinking, projector: as for Chat.

    On a pipe, answers go to stdout, status lines and `error: ...` lines to stderr, and the process exits
    with status 1 when the last line failed.
    """
    stdin = sys.stdin if stdin is None else stdin
    if stdin.isatty():
        chat = Chat(models, settings, Console(highlight=False, force_terminal=True), None, thinking, projector)
        _interactive(chat)
        return
    out, notes = Console(highlight=False, soft_wrap=True), Console(highlight=False, soft_wrap=True, stderr=True)
    chat, failed = Chat(models, settings, out, notes, thinking, projector), False
    for line in piped_lines(stdin.buffer):
        if line.strip():
            failed = _turn(chat, line.strip())
            if failed is None:
                break
    if failed:
        raise SystemExit(1)


def _interactive(chat: Chat) -> None:
    """Read and answer lines until /quit or Ctrl-D; Ctrl-C stops an answer even if our launcher ignored SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _read_and_answer(chat)
    finally:
        signal.signal(signal.SIGINT, previous)


def _read_and_answer(chat: Chat) -> None:
    """The terminal loop: one line read, one turn run, until /quit or Ctrl-D."""
    console = chat.console
    console.print("[dim]type a message, /help for commands, /quit to leave[/dim]")
    while True:
        try:
            line = console.input("[bold]>>> [/bold]").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /quit to leave)[/dim]")
            continue
        if line and _turn(chat, line) is None:
            break


def _turn(chat: Chat, line: str) -> bool | None:
    """Run one line; an error or Ctrl-C ends it in one line, not the session. True: it failed; None: quit."""
    try:
        if not line.startswith("/"):
            chat.answer(line)
        elif not chat.command(line):
            return None
    except DFlashError as exc:
        chat.notes.print(f"error: {exc}", markup=False, soft_wrap=True)
        return True
    except KeyboardInterrupt:
        chat.notes.print("[dim](stopped)[/dim]")
    return False
