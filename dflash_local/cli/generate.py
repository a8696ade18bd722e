"""`dflash generate`: one continuation of a prompt, streamed as text or reported as one JSON object."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from ..errors import DFlashError
from . import values
from .app import user_errors
from .files import resolve
from .options import DecodeOptions, ModelOptions, Own, decode_options, model_options


@model_options()
@decode_options(
    drafter=Own(help="DFlash drafter: a folder or a Hub repo."),
    max_new_tokens=Own(),
    temperature=Own(),
    top_p=Own(),
    top_k=Own(),
    seed=Own(),
    block_size=Own(),
    no_draft=Own(),
    lookup=Own(),
    ignore_eos=Own(),
)
def generate(
    target: str = typer.Option(..., "--target", help="A model name, a Hub repo, an HF-layout folder or a .gguf file."),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", help="Prompt text, UTF-8 (other bytes are an error); needs the target's tokenizer."
    ),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    backend: str = typer.Option("auto", "--backend", help="auto (llamacpp for .gguf), torch or llamacpp."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Output JSON following this schema file."),
    *,
    decode: DecodeOptions,
    options: ModelOptions,
) -> None:
    """Generate one continuation of a prompt, with DFlash drafting or without."""
    with user_errors():
        if (prompt is None) == (prompt_ids is None):
            raise DFlashError("Give exactly one of --prompt or --prompt-ids.")
        values.check_numbers(decode.max_new_tokens, options.max_context, decode.seed)
        block_size = decode.block()
        given = values.prompt_text(prompt) if prompt is not None else values.parse_ids(prompt_ids, "--prompt-ids")

        from ..generation import GenerationRequest, run_request
        from ..grammar import compile_grammar, json_schema_grammar, load_schema

        decode.sampling()  # checks them before anything loads
        grammar_text = None if json_schema is None else json_schema_grammar(load_schema(json_schema))
        resolved = resolve(target, decode.drafter, options.offline, options.token)
        if not decode.no_draft and resolved.drafter is None and not decode.lookup:
            raise DFlashError("Pass --drafter DIR, drop --no-lookup, or --no-draft for plain autoregressive decoding.")
        backend = resolved.backend if backend == "auto" else backend
        drafter = None if decode.no_draft else resolved.drafter
        models = options.load(resolved, drafter, backend, block_size is None)
        vocab, stops = models.target.vocab_size, models.stop_ids
        grammar = None if grammar_text is None else compile_grammar(grammar_text, models.tokenizer, vocab, stops)
        request = GenerationRequest(given, replace(decode.settings(models), grammar=grammar))
        on_text = None if as_json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        result = run_request(models, request, on_text=on_text)
        if as_json:
            typer.echo(json.dumps(result | {"devices": models.devices}))
            return
        if models.tokenizer is None:
            typer.echo(",".join(map(str, result["output_ids"])))
        else:
            typer.echo()
        typer.echo(
            f"[{result['new_tokens']} tokens · tau {result['tau']:.2f} · "
            f"{result['decode_tokens_per_s']:.1f} tok/s decode · prefill {result['prefill_s'] * 1000:.0f} ms]",
            err=True,
        )
