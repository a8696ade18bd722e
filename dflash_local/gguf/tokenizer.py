"""The tokenizer and chat template stored inside a GGUF file, used through llama.cpp's vocabulary of a loaded model."""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from ..chat_template import ChatEncoder
from ..errors import DFlashError

if TYPE_CHECKING:
    from ..llama_context import LlamaContext


class GGUFTokenizer(ChatEncoder):
    """Same surface as TextTokenizer: encode, encode_chat, decode, token_id; over a llama.cpp model's vocabulary.

    `owner` keeps the model alive (the target whose weights it came with, or nothing for a vocabulary-only load)."""

    def __init__(self, model, owner: object = None) -> None:
        from ..llama_lib import llama_cpp

        self._model, self._owner = model, owner
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.config = {"chat_template": self._meta("tokenizer.chat_template")}
        for name in ("bos", "eos"):
            token = self._meta(f"tokenizer.ggml.{name}_token_id")
            if token is not None:
                self.config[f"{name}_token"] = self.decode([int(token)])
        self.config["add_bos_token"] = self._meta("tokenizer.ggml.add_bos_token") == "true"

    @classmethod
    def load(cls, path: Path) -> GGUFTokenizer:
        """Read the vocabulary of a .gguf file (llama.cpp loads it without the weights)."""
        from ..llama_lib import first_llama_error, llama_cpp, quiet_llama_logs

        quiet_llama_logs()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params) if Path(path).is_file() else None
        if not model:
            reason = first_llama_error() or "no reason given"
            raise DFlashError(f"{path}: llama.cpp cannot read its tokenizer ({reason}).")
        tokenizer = cls(model)
        weakref.finalize(tokenizer, llama_cpp.llama_model_free, model)
        return tokenizer

    @classmethod
    def of_context(cls, context: LlamaContext) -> GGUFTokenizer:
        """The vocabulary llama.cpp loaded with a context's model, e.g. the target's (the file is not read again)."""
        return cls(context.model, context)

    @property
    def vocab(self):
        """llama.cpp's vocabulary pointer (the grammar library reads each token's bytes through it)."""
        return self._vocab

    def _meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp prints it, or None when the file lacks the key."""
        from ..llama_lib import llama_cpp

        size = 256
        while True:
            buffer = ctypes.create_string_buffer(size)
            length = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buffer, size)
            if length < 0:
                return None
            if length < size:
                return buffer.value.decode("utf-8", "replace")
            size = length + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        from ..llama_lib import llama_cpp

        data = text.encode()
        add_bos = add_special_tokens and self.config["add_bos_token"]
        size = len(data) + 2
        while True:
            ids = (llama_cpp.llama_token * size)()
            count = llama_cpp.llama_tokenize(self._vocab, data, len(data), ids, size, add_bos, True)
            if count >= 0:
                return list(ids[:count])
            size = -count

    def decode(self, ids: list[int]) -> str:
        """The pieces of ids, special tokens spelled out, joined (a leading space after BOS dropped)."""
        from ..llama_lib import llama_cpp

        pieces = []
        buffer = ctypes.create_string_buffer(16)  # grown for longer pieces
        for token in ids:
            length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            if length < 0:  # the piece needs -length bytes
                buffer = ctypes.create_string_buffer(-length)
                length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            pieces.append(buffer.raw[: max(length, 0)])
        text = b"".join(pieces)
        if ids and ids[0] == llama_cpp.llama_vocab_bos(self._vocab) and text.startswith(b" "):
            text = text[1:]
        return text.decode("utf-8", "replace")

    def token_id(self, token: str) -> int | None:
        ids = self.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None
