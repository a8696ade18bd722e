"""Tokenizer loading (tokenizer.json), stop tokens, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from .chat_template import ChatEncoder
from .errors import DFlashError

if TYPE_CHECKING:
    from .gguf.tokenizer import GGUFTokenizer


class TextTokenizer(ChatEncoder):
    """A `tokenizers` tokenizer plus the folder's tokenizer_config.json."""

    def __init__(self, tokenizer: Tokenizer, config: dict) -> None:
        self.tokenizer = tokenizer
        self.config = config

    @classmethod
    def load(cls, folder: Path) -> TextTokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise DFlashError(f"{path} cannot be read as a tokenizer ({exc}).") from None
        config = _read_json(Path(folder) / "tokenizer_config.json")
        return cls(tokenizer, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON ({exc}).") from None
    return data if isinstance(data, dict) else {}


def stop_token_ids(folder: Path) -> frozenset[int]:
    """End-of-sequence ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(Path(folder) / name).get("eos_token_id")
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


class Detokenizer:
    """Turns a growing list of token ids into text deltas with constant work per step, holding back incomplete UTF-8.

    Only a short window of ids is decoded each time: a few already shown ids (so that merges and leading-space
    rules see their context), then the ids not shown yet. The deltas joined equal decoding every id at once.
    """

    CONTEXT = 4  # shown ids kept in front of the new ones
    HOLD = 4  # a character's UTF-8 bytes span at most 4 ids, so one of the last 4 cuts ends on a whole character

    def __init__(self, tokenizer: TextTokenizer | GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.window: list[int] = []
        self.shown = 0  # how many of the window's ids are already in the output

    def add(self, ids: list[int]) -> str:
        """Append ids; return the newly complete text."""
        self.window.extend(ids)
        end, text = self._complete()
        if end <= self.shown:
            return ""
        delta = text[len(self.tokenizer.decode(self.window[: self.shown])) :]
        keep = max(0, end - self.CONTEXT)
        self.window, self.shown = self.window[keep:], end - keep
        return delta

    def _complete(self) -> tuple[int, str]:
        """The longest window prefix (of those leaving out fewer than HOLD ids) whose text ends on a whole character,
        and its text; the whole window when none does though HOLD ids wait (the text itself holds U+FFFD)."""
        total = len(self.window)
        for end in range(total, max(self.shown, total - self.HOLD), -1):
            text = self.tokenizer.decode(self.window[:end])
            if not text.endswith("\ufffd"):
                return end, text
        if total - self.shown >= self.HOLD:
            return total, self.tokenizer.decode(self.window)
        return self.shown, ""
