"""`dflash chat`: the interactive loop (its rendering lives in dflash_local/chat.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..defaults import CACHE_RAM_MIB, DEFAULT_CONTEXT
from . import values
from .app import user_errors
from .files import resolve
from .options import (
    BlockSize,
    CacheRam,
    CacheType,
    CacheTypeK,
    CacheTypeV,
    ChatTemplate,
    CpuMoe,
    CudaGraphs,
    DecodeOptions,
    Device,
    Drafter,
    DrafterKind,
    DrafterQuantize,
    DType,
    GpuLayers,
    Kernels,
    Lookup,
    MaxContext,
    Mmproj,
    ModelOptions,
    Offline,
    Quantize,
    Temperature,
    Threads,
    Token,
    TopK,
    TopP,
    picked,
)


def chat(
    ctx: typer.Context,
    model: str = typer.Argument("tiny", help="A model name (dflash models), a Hub repo, a folder or a .gguf file."),
    chat_template: ChatTemplate = None,
    drafter: Drafter = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Longest answer in tokens.")] = 256,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    block_size: BlockSize = "auto",
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Start with drafting off.")] = False,
    lookup: Lookup = True,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Answer until --max-new-tokens, past end-of-turn.")
    ] = False,
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
    cache_ram: CacheRam = CACHE_RAM_MIB,
    mmproj: Mmproj = None,
) -> None:
    """Chat with a model: streaming answers, live tokens/s and acceptance, /help for commands."""
    given = locals()
    with user_errors():
        decode, options = picked(DecodeOptions, given), picked(ModelOptions, given, progress=ctx.obj)
        values.check_numbers(decode.max_new_tokens, options.max_context, cache_ram=options.cache_ram)
        block_size = decode.block()

        from ..chat import run_chat
        from ..chat_template import read_template, use_template
        from ..generation import memory_guard
        from ..vulkan_probe import expose_for

        expose_for(device)  # before llama.cpp loads: which Vulkan devices it may use
        decode.sampling()  # checks them before anything loads
        template = None if chat_template is None else read_template(chat_template)
        resolved = resolve(model, decode.drafter, options.offline, options.token)
        models = options.load(resolved, resolved.drafter, resolved.backend, block_size is None)
        models.tokenizer.config = use_template(models.tokenizer.config, template, resolved.target)
        projector = None
        if (mmproj or resolved.mmproj) is not None:  # --mmproj, else the catalog's or the store's
            from ..vision import load_projector

            projector = load_projector(models, mmproj or resolved.mmproj, options.threads)
        with memory_guard("Answering in this conversation", models.target.device.type):
            run_chat(models, decode.settings(models), thinking=resolved.thinking, projector=projector)
