"""Generated tokens as a reply's typed pieces, on the worker, for `dflash chat` and `dflash serve` alike.

The stop rule, the same in chat and serve: an answer ends at a stop token (whose text never shows) or at the first stop
string in its text, which is cut there: the request's own, and, unless the answer goes past stop tokens (--ignore-eos),
the end-of-turn texts (the stop tokens' texts, the template's ChatML turn markers), so a model that spells
`<|im_end|>` in several tokens ends a chat answer and a serve answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..chat_template import TURN_ENDS, template_source
from ..reasoning import held
from ..tokenizer import Detokenizer, TextTokenizer
from .channels import PLAIN, Parts, ReplyReader

if TYPE_CHECKING:
    from ..gguf.tokenizer import GGUFTokenizer


def end_texts(tokenizer: TextTokenizer | GGUFTokenizer, stop_ids: frozenset[int]) -> tuple[str, ...]:
    """The end-of-turn texts: the stop tokens' texts, and ChatML's turn markers where the template writes them."""
    texts = tuple(t for t in (tokenizer.decode([i]) for i in sorted(stop_ids)) if t)
    template = template_source(tokenizer.config) or ""
    return texts + tuple(end for end in TURN_ENDS if end in template and end not in texts)


def ending(ends: tuple[str, ...], model_stops: frozenset[int], answer_stops: frozenset[int]) -> tuple[str, ...]:
    """The end-of-turn texts that end an answer: all, unless it goes past the model's stop tokens (--ignore-eos)."""
    return ends if answer_stops or not model_stops else ()


@dataclass(frozen=True)
class End:
    """Why a reply ended: "stop" or "length", and the request's stop string that ended it, if one did."""

    reason: str
    stop: str | None = None


class TextStream:
    """One reply's tokens as Parts: detokenized without the stop tokens, cut at the first stop string, read by its
    family; the one hold-back rule: a tail that may begin a stop string or a reader's marker waits for more text."""

    def __init__(
        self,
        tokenizer: TextTokenizer | GGUFTokenizer,
        stop_ids: frozenset[int],
        stops: tuple[str, ...] = (),
        ends: tuple[str, ...] = (),
        reader: ReplyReader | None = None,
    ) -> None:
        """stops: the request's stop strings; ends: the end-of-turn texts (none past stop tokens)."""
        self.detokenizer, self.stop_ids = Detokenizer(tokenizer), stop_ids
        self.stops, self.cuts = stops, stops + ends
        self.reader = ReplyReader(PLAIN, None) if reader is None else reader
        self.markers = self.cuts + self.reader.markers
        self.text, self.sent = "", 0
        self.hit: str | None = None  # the stop string that ended the reply

    def add(self, ids: list[int]) -> Parts:
        """The parts that one step's tokens complete."""
        return self.add_text(self.detokenizer.add([t for t in ids if t not in self.stop_ids]))

    def add_text(self, delta: str) -> Parts:
        """The parts that delta completes (nothing after a stop string, nothing that may begin a marker)."""
        if self.hit is not None:
            return Parts()
        self.text += delta
        found = [(self.text.find(s, max(0, self.sent - len(s))), s) for s in self.cuts]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.hit = min(found)
            self.text = self.text[:at]
            return self._read(len(self.text))
        return self._read(len(self.text) - held(self.text[self.sent :], self.markers))

    def finish(self, reason: str | None) -> tuple[Parts, End]:
        """The rest at the end (all text held back, every call), and why it ended (reason: the decode loop's)."""
        out = self._read(len(self.text))
        out += self.reader.finish()
        stopped = self.hit is not None or reason == "stop"
        return out, End("stop" if stopped else "length", self.hit if self.hit in self.stops else None)

    def _read(self, end: int) -> Parts:
        end = max(end, self.sent)
        text, self.sent = self.text[self.sent : end], end
        return self.reader.add(text)
