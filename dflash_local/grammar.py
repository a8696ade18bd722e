"""Constrained decoding: grammars from JSON schemas (llguidance) and the matcher whose masks the decode loop applies.

A `Grammar` is compiled once per request against a tokenizer; `Grammar.matcher()` gives one generation its own
`GrammarMatcher`, which says which ids may not come next, consumes tokens and rolls back past rejected drafts.
"""

from __future__ import annotations

import ctypes
import json
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import DFlashError
from .tokenizer import TextTokenizer

if TYPE_CHECKING:
    import llguidance

    from .gguf.tokenizer import GGUFTokenizer

# Compact JSON in json.dumps' layout: no free whitespace, so a model cannot pad its output with blanks forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, eos): LLTokenizer}
_BUILDING = threading.Lock()  # one build at a time: a request waits for the one a server started ahead


def json_schema_grammar(schema: dict | None, strict: bool = True, prefix: str = "", suffix: str = "") -> str:
    """Grammar text for one JSON value following `schema` (None: any JSON object) between fixed prefix and suffix
    texts (a tool call's wrapping). strict False ignores the schema keywords the grammar cannot enforce."""
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise DFlashError(f"The JSON schema must be an object, not {type(schema).__name__}.")
    options = {**JSON_LAYOUT, "lenient": not strict, **schema.get("x-guidance", {})}
    try:
        body = json.dumps({**schema, "x-guidance": options})
    except (TypeError, ValueError) as exc:
        raise DFlashError(f"The JSON schema cannot be written as JSON ({exc}).") from None
    parts = [json.dumps(text) for text in (prefix,) if text] + [f"%json {body}"]
    parts += [json.dumps(suffix)] if suffix else []
    return _checked(_llguidance().LLMatcher.grammar_from_lark(f"start: {' '.join(parts)}\n"))


def load_schema(path: Path) -> dict:
    """The JSON schema in a file (`dflash generate --json-schema`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DFlashError(f"The JSON schema file {path} cannot be read ({exc}).") from None
    return read_schema(text, f"The JSON schema file {path}")


def read_schema(text: str, source: str) -> dict:
    """A JSON schema from text (a file's or a request's), or one sentence saying why it is not one."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{source} is not valid JSON ({exc}).") from None
    if not isinstance(schema, dict):
        raise DFlashError(f"{source} must hold a JSON object (a JSON schema), not {type(schema).__name__}.")
    return schema


@dataclass(frozen=True)
class Grammar:
    """A grammar checked against one tokenizer; stop_ids end the text once the grammar is complete."""

    text: str
    tokenizer: llguidance.LLTokenizer = field(repr=False, compare=False)
    stop_ids: frozenset[int]

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, for one generation."""
        return GrammarMatcher(self)


def compile_grammar(
    text: str, tokenizer: TextTokenizer | GGUFTokenizer | None, vocab_size: int, stop_ids: frozenset[int]
) -> Grammar:
    """The grammar text checked against the tokenizer's tokens (vocab_size: the target's scores per position);
    one sentence naming the problem when the grammar or schema is malformed."""
    if tokenizer is None:
        raise DFlashError("Constrained output needs the target's tokenizer, and this target has none.")
    if not stop_ids:
        raise DFlashError("Constrained output needs an end-of-sequence token, and this model declares none.")
    lltokenizer = _lltokenizer(tokenizer, vocab_size, stop_ids)
    return Grammar(_checked(text, lltokenizer), lltokenizer, stop_ids)


def _checked(text: str, lltokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The grammar text, once llguidance finds it valid (for the tokenizer, where one is given)."""
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, lltokenizer)
    if is_error:
        reason = messages[0].split("failed to compile JSON schema: ", 1)[-1].split("\n   1 | start:", 1)[0]
        raise DFlashError(f"The JSON schema is not valid: {' '.join(reason.split()).rstrip('.')}.")
    return text


class GrammarMatcher:
    """One generation's position in a grammar: the ids forbidden next, tokens consumed, rollback of the last n."""

    def __init__(self, grammar: Grammar) -> None:
        self.matcher = _llguidance().LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.vocab_size = grammar.tokenizer.vocab_size
        self.words = np.zeros((self.vocab_size + 31) // 32, dtype="<u4")  # llguidance's bitmask: bit i = id i
        self._check()

    def forbidden(self, device: torch.device | str) -> torch.Tensor:
        """Which ids may not come next: bool [vocab] on device (True: forbidden)."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self._check()
        bits = np.unpackbits((~self.words).view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits).view(torch.bool).to(device)

    def consume(self, token: int) -> None:
        """Advance past one token (one the last mask allowed)."""
        self.matcher.consume_token(token)
        self._check()

    def rollback(self, count: int) -> None:
        """Forget the last count consumed tokens."""
        if count:
            self.matcher.rollback(count)
            self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise DFlashError(f"The grammar matcher failed: {self.matcher.get_error()}.")


def _lltokenizer(tokenizer: TextTokenizer | GGUFTokenizer, vocab_size: int, stop_ids: frozenset[int]):
    """llguidance's view of the tokenizer's token bytes (built once per tokenizer, vocabulary size and stop ids:
    several seconds for a 262K vocabulary; prepare_tokenizer builds it ahead)."""
    key = (vocab_size, stop_ids)
    with _BUILDING:
        built = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in built:
            built[key] = _build_lltokenizer(tokenizer, vocab_size, sorted(stop_ids))
        return built[key]


def prepare_tokenizer(tokenizer: TextTokenizer | GGUFTokenizer | None, vocab_size: int, stop_ids: frozenset[int]):
    """Build the grammar library's tokenizer now (a server at start), so that the first constrained request does not
    wait for it; nothing for a model without tokenizer or stop ids (constrained output fails there anyway)."""
    if tokenizer is not None and stop_ids:
        _lltokenizer(tokenizer, vocab_size, stop_ids)


def _build_lltokenizer(tokenizer: TextTokenizer | GGUFTokenizer, vocab_size: int, eos: list[int]):
    """A new llguidance tokenizer: from tokenizer.json's text, or from a llama.cpp vocabulary's token bytes."""
    llguidance = _llguidance()
    if isinstance(tokenizer, TextTokenizer):
        return llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    from .llama_lib import function_address

    tokens = _llama_token_bytes(tokenizer.vocab)
    tokens += [b""] * (vocab_size - len(tokens))
    tokenize = function_address("llama_tokenize")
    return llguidance.LLTokenizer.from_llamacpp(
        tokens=tokens, vocab_ptr=tokenizer.vocab, tokenize_fptr=tokenize, eos_token=eos
    )


def _llama_token_bytes(vocab) -> list[bytes]:
    """Each token's bytes in a llama.cpp vocabulary, special ones (control tokens, and user-defined ones spelled
    <...>) marked by a leading 0xff as llguidance expects."""
    from .llama_lib import llama_cpp

    control, user = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL, llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    buffer = ctypes.create_string_buffer(256)
    tokens = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        length = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        if length < 0:  # the piece needs -length bytes
            buffer = ctypes.create_string_buffer(-length)
            length = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        piece = buffer.raw[:length]
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
    return tokens


def _llguidance():
    """The llguidance module, imported on first use (start-up time of commands that constrain nothing)."""
    import llguidance

    return llguidance
