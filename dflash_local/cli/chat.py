"""`dflash chat`: the interactive loop (its rendering lives in dflash_local/chat.py)."""

from __future__ import annotations

import typer

from . import values
from .app import user_errors
from .files import resolve
from .options import ChatTemplate, DecodeOptions, ModelOptions, Own, decode_options, model_options


@model_options(2048)
@decode_options(
    drafter=Own(),
    max_new_tokens=Own(256, "Longest answer in tokens."),
    temperature=Own(),
    top_p=Own(),
    top_k=Own(),
    block_size=Own(),
    no_draft=Own(help="Start with drafting off."),
    lookup=Own(),
    ignore_eos=Own(help="Answer until --max-new-tokens, past end-of-turn."),
)
def chat(
    model: str = typer.Argument("tiny", help="A model name (dflash models), a Hub repo, a folder or a .gguf file."),
    chat_template: ChatTemplate = None,
    *,
    decode: DecodeOptions,
    options: ModelOptions,
) -> None:
    """Chat with a model: streaming answers, live tokens/s and acceptance, /help for commands."""
    with user_errors():
        values.check_numbers(decode.max_new_tokens, options.max_context)
        block_size = decode.block()

        from ..chat import run_chat
        from ..chat_template import read_template, use_template
        from ..generation import memory_guard

        decode.sampling()  # checks them before anything loads
        template = None if chat_template is None else read_template(chat_template)
        resolved = resolve(model, decode.drafter, options.offline, options.token)
        models = options.load(resolved, resolved.drafter, resolved.backend, block_size is None)
        models.tokenizer.config = use_template(models.tokenizer.config, template, resolved.target)
        with memory_guard("Answering in this conversation", models.target.device.type):
            run_chat(models, decode.settings(models), thinking=resolved.thinking)
