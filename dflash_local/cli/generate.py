"""`dflash generate`: one continuation of a prompt, streamed as text or reported as one JSON object."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..defaults import DEFAULT_CONTEXT, MAX_NEW_TOKENS
from ..errors import DFlashError
from . import values
from .app import user_errors
from .files import resolve
from .options import (
    BlockSize,
    CacheType,
    CacheTypeK,
    CacheTypeV,
    CpuMoe,
    CudaGraphs,
    DecodeOptions,
    Device,
    DrafterKind,
    DrafterQuantize,
    DType,
    GpuLayers,
    IgnoreEos,
    Kernels,
    Lookup,
    MaxContext,
    MaxNewTokens,
    Mmproj,
    ModelOptions,
    NoDraft,
    Offline,
    Quantize,
    Seed,
    Temperature,
    Threads,
    Token,
    TopK,
    TopP,
    picked,
)

Images = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--image",
        metavar="PATH",
        help="An image (PNG, JPEG, GIF or BMP) for --prompt, at its <__media__> marker, else before it; repeatable.",
    ),
]

if TYPE_CHECKING:
    from ..decode import Settings
    from ..generation import LoadedModels


def generate(
    ctx: typer.Context,
    target: str = typer.Option(..., "--target", help="A model name, a Hub repo, an HF-layout folder or a .gguf file."),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", help="Prompt text, UTF-8 (other bytes are an error); needs the target's tokenizer."
    ),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    mmproj: Mmproj = None,
    images: Images = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    backend: str = typer.Option("auto", "--backend", help="auto (llamacpp for .gguf), torch or llamacpp."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Output JSON following this schema file."),
    drafter: Annotated[Optional[str], typer.Option("--drafter", help="DFlash drafter: a folder or a Hub repo.")] = None,
    max_new_tokens: MaxNewTokens = MAX_NEW_TOKENS,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    block_size: BlockSize = "auto",
    no_draft: NoDraft = False,
    lookup: Lookup = True,
    ignore_eos: IgnoreEos = False,
    device: Device = "auto",
    dtype: DType = "auto",
    kernels: Kernels = "auto",
    cuda_graphs: CudaGraphs = True,
    drafter_kind: DrafterKind = "auto",
    threads: Threads = None,
    gpu_layers: GpuLayers = "auto",
    cpu_moe: CpuMoe = False,
    max_context: MaxContext = DEFAULT_CONTEXT,
    cache_type: CacheType = "f16",
    cache_type_k: CacheTypeK = None,
    cache_type_v: CacheTypeV = None,
    offline: Offline = False,
    quantize: Quantize = "auto",
    drafter_quantize: DrafterQuantize = "none",
    token: Token = None,
) -> None:
    """Generate one continuation of a prompt, with DFlash drafting or without."""
    given = locals()
    with user_errors():
        decode, options = picked(DecodeOptions, given), picked(ModelOptions, given, progress=ctx.obj)
        text = _prompt(prompt, prompt_ids, images)
        values.check_numbers(decode.max_new_tokens, options.max_context, decode.seed)
        block_size = decode.block()

        from ..generation import GenerationRequest, run_request
        from ..grammar import json_schema_grammar, load_schema
        from ..vulkan_probe import expose_for

        expose_for(device)  # before llama.cpp loads: which Vulkan devices it may use
        decode.sampling()  # checks them before anything loads
        grammar_text = None if json_schema is None else json_schema_grammar(load_schema(json_schema))
        resolved = resolve(target, decode.drafter, options.offline, options.token)
        if not decode.no_draft and resolved.drafter is None and not decode.lookup:
            raise DFlashError("Pass --drafter DIR, drop --no-lookup, or --no-draft for plain autoregressive decoding.")
        mmproj = _projector(images, mmproj or resolved.mmproj)  # --mmproj, else the catalog's or the store's
        backend = resolved.backend if backend == "auto" else backend
        models = options.load(resolved, None if decode.no_draft else resolved.drafter, backend, block_size is None)
        settings = _settings(decode, models, grammar_text)
        if images:
            from ..vision import image_prompt

            text = image_prompt(models, mmproj, images, text, settings, threads)
        on_text = None if as_json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        result = run_request(models, GenerationRequest(text, settings), on_text=on_text)
        _report(result, models.devices, as_json, models.tokenizer is None)


def _settings(decode: DecodeOptions, models: LoadedModels, grammar_text: str | None) -> Settings:
    """Decode's settings for the loaded models, with the --json-schema grammar compiled for their vocabulary."""
    from ..grammar import compile_grammar

    vocab, stops = models.target.vocab_size, models.stop_ids
    grammar = None if grammar_text is None else compile_grammar(grammar_text, models.tokenizer, vocab, stops)
    return replace(decode.settings(models), grammar=grammar)


def _prompt(prompt: str | None, prompt_ids: str | None, images: list[Path] | None) -> str | list[int]:
    """The prompt's text (or ids), checked: exactly one of --prompt and --prompt-ids; --image only with --prompt."""
    if (prompt is None) == (prompt_ids is None):
        raise DFlashError("Give exactly one of --prompt or --prompt-ids.")
    if images and prompt is None:
        raise DFlashError("--image needs --prompt (text around the image), not --prompt-ids.")
    return values.prompt_text(prompt) if prompt is not None else values.parse_ids(prompt_ids, "--prompt-ids")


def _projector(images: list[Path] | None, mmproj: Path | None) -> Path | None:
    """The projector to load (--mmproj's, else the one that comes with the model), checked to be there for --image."""
    if images and mmproj is None:
        raise DFlashError(
            "--image needs --prompt and the target's vision projector (--mmproj FILE): a text-only model takes no "
            "images."
        )
    return mmproj


def _report(result: dict, devices: dict, as_json: bool, ids_only: bool) -> None:
    """The result: one JSON object (with where the models ran), or after the streamed text (the ids, without a
    tokenizer) a summary line on stderr."""
    if as_json:
        typer.echo(json.dumps(result | {"devices": devices}))
        return
    typer.echo(",".join(map(str, result["output_ids"])) if ids_only else "")
    typer.echo(
        f"[{result['new_tokens']} tokens · tau {result['tau']:.2f} · "
        f"{result['decode_tokens_per_s']:.1f} tok/s decode · prefill {result['prefill_s'] * 1000:.0f} ms]",
        err=True,
    )
