"""The tokenizer and chat template stored inside a GGUF file, used through llama.cpp (vocab only, no weights)."""

from __future__ import annotations

from pathlib import Path

from .chat_template import render_chat
from .errors import DFlashError


class GGUFTokenizer:
    """Same surface as TextTokenizer: encode, encode_chat, decode, token_id; built from GGUF metadata."""

    def __init__(self, vocab, config: dict) -> None:
        self.vocab = vocab
        self.config = config

    @classmethod
    def load(cls, path: Path) -> GGUFTokenizer:
        """Read the vocabulary of a .gguf file (llama.cpp loads it without the weights)."""
        import llama_cpp

        from .targets.llama_taps import quiet_llama_logs

        quiet_llama_logs()
        try:
            vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise DFlashError(f"{path}: llama.cpp cannot read its tokenizer ({exc}).") from None
        metadata = vocab.metadata
        config = {"chat_template": metadata.get("tokenizer.chat_template")}
        for name in ("bos", "eos"):
            token = metadata.get(f"tokenizer.ggml.{name}_token_id")
            if token is not None:
                config[f"{name}_token"] = vocab.detokenize([int(token)], special=True).decode("utf-8", "replace")
        config["add_bos_token"] = metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        return cls(vocab, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        add_bos = add_special_tokens and self.config["add_bos_token"]
        return self.vocab.tokenize(text.encode(), add_bos=add_bos, special=True)

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, enable_thinking: bool | None = None
    ) -> list[int]:
        """Token ids of messages rendered with the chat template from the GGUF metadata."""
        text = render_chat(self.config, messages, add_generation_prompt, enable_thinking)
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.vocab.detokenize(ids, special=True).decode("utf-8", "replace")

    def token_id(self, token: str) -> int | None:
        ids = self.vocab.tokenize(token.encode(), add_bos=False, special=True)
        return ids[0] if len(ids) == 1 else None
