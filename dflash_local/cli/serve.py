"""`dflash serve`: the HTTP server (dflash_local/server), or the launch command of vLLM/SGLang for the same pair."""

from __future__ import annotations

import os
import shlex
from functools import partial
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..defaults import CACHE_RAM_MIB, DEFAULT_CONTEXT, MAX_BODY, MAX_CONNECTIONS, READ_TIMEOUT_S
from ..errors import DFlashError
from . import values
from .app import user_errors
from .files import fetcher, resolve
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
    MaxContext,
    Mmproj,
    ModelOptions,
    NoDraft,
    Offline,
    Quantize,
    Threads,
    Token,
    picked,
)

if TYPE_CHECKING:
    from pathlib import Path

    from ..server import Engine, Limits

# serve's own options (and its help for --max-new-tokens and --seed).
ApiKey = Annotated[
    Optional[str],
    typer.Option("--api-key", envvar="DFLASH_API_KEY", help="Require Authorization: Bearer KEY on /v1 requests."),
]
MaxQueue = Annotated[
    int,
    typer.Option("--max-queue", "--queue-size", help="Requests that may wait; more are answered 429 (Anthropic: 529)."),
]
RemoteImages = Annotated[
    bool, typer.Option("--allow-remote-images", help="Fetch http(s) image URLs in requests (default: inline only).")
]
MaxBody = Annotated[int, typer.Option("--max-body", help="Largest request body in bytes; more is a 413.")]
ReadTimeout = Annotated[
    float,
    typer.Option(
        "--read-timeout", help="Seconds a client has to send its request's headers, then its body (else 408)."
    ),
]
Parallel = Annotated[
    int,
    typer.Option(
        "--parallel",
        help="Requests decoded together, one llama.cpp batch per step (GGUF targets on the CPU), each with its own "
        "--max-context KV cache (N times the memory) and --cache-ram / N; a request goes to the idle sequence holding "
        "the longest prefix of its prompt, more wait in the queue. Default 1: one at a time.",
    ),
]
MaxConnections = Annotated[int, typer.Option("--max-connections", help="Open connections; more are answered 503.")]
EngineName = Annotated[
    Optional[str],
    typer.Option(
        "--engine", help="vllm or sglang: print that engine's launch command for this pair instead of serving."
    ),
]
ServeMaxNewTokens = Annotated[
    Optional[int],
    typer.Option(
        "--max-new-tokens", help="Default answer length when a request has no max_tokens (default: the context)."
    ),
]
ServeSeed = Annotated[
    Optional[int],
    typer.Option(
        "--seed",
        help="Seed of requests that name none: the same request, the same answer (default: a fresh one each).",
    ),
]


def serve(
    ctx: typer.Context,
    model: str = typer.Argument("tiny", help="A model name (dflash models), a Hub repo, a folder or a .gguf file."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (other machines: 0.0.0.0)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one)."),
    api_key: ApiKey = None,
    max_queue: MaxQueue = 16,
    parallel: Parallel = 1,
    chat_template: ChatTemplate = None,
    max_body: MaxBody = MAX_BODY,
    read_timeout: ReadTimeout = READ_TIMEOUT_S,
    max_connections: MaxConnections = MAX_CONNECTIONS,
    cors_origins: list[str] = typer.Option(
        [], "--cors-origin", help="A browser origin allowed to call the API (repeatable; default: none)."
    ),
    engine: EngineName = None,
    run_engine: bool = typer.Option(False, "--exec", help="With --engine: then run it (in place of dflash)."),
    drafter: Drafter = None,
    max_new_tokens: ServeMaxNewTokens = None,
    block_size: BlockSize = "auto",
    no_draft: NoDraft = False,
    seed: ServeSeed = None,
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
    allow_remote_images: RemoteImages = False,
) -> None:
    """Serve a model over OpenAI's, Anthropic's and Ollama's HTTP APIs (or print a vLLM/SGLang command for the
    same pair)."""
    given = locals()
    with user_errors():
        decode, options = picked(DecodeOptions, given), picked(ModelOptions, given, progress=ctx.obj)
        block_size = decode.block()
        if engine is not None:
            _hand_off(engine, model, decode.drafter, block_size, run_engine, options.offline, options.token)
            return
        if run_engine:
            raise DFlashError("--exec runs an engine's command: use it with --engine vllm or --engine sglang.")
        new_tokens = 1 if max_new_tokens is None else max_new_tokens
        values.check_numbers(new_tokens, options.max_context, decode.seed, options.cache_ram)
        limits = _limits(max_queue, max_body, read_timeout, max_connections, port, options.parallel)

        from ..chat_template import read_template
        from ..server import create_app, listen, run_server
        from ..vulkan_probe import expose_for

        expose_for(device)  # before llama.cpp loads: which Vulkan devices it may use
        template = None if chat_template is None else read_template(chat_template)
        sock = listen(host, port)  # before loading: a taken port fails at once
        worker = _engine(model, decode, options, template, max_new_tokens, max_queue, mmproj, allow_remote_images)
        _announce(model, host, api_key, sock.getsockname())
        run_server(create_app(worker, model, api_key, limits, tuple(cors_origins)), sock, limits)


def _engine(
    model: str,
    decode: DecodeOptions,
    options: ModelOptions,
    template: str | None,
    max_new_tokens: int | None,
    max_queue: int,
    mmproj: Path | None = None,
    remote_images: bool = False,
) -> Engine:
    """The model loaded (with the chat template given, and the prompt cache --cache-ram asks for) and its serving
    engine (with --parallel, its workers' views of the models), taking images where a projector is given (--mmproj) or
    comes with the model (catalog, ollama, LM Studio) and one sequence decodes."""
    from ..chat_template import use_template
    from ..server import Engine

    if options.parallel > 1 and mmproj is not None:
        raise DFlashError(f"--parallel {options.parallel} takes no images yet: serve --mmproj with --parallel 1.")
    block_size = decode.block()
    resolved = resolve(model, decode.drafter, options.offline, options.token)
    drafter_path = None if decode.no_draft else resolved.drafter
    models = options.load(resolved, drafter_path, resolved.backend, block_size is None and not decode.no_draft)
    models.tokenizer.config = use_template(models.tokenizer.config, template, resolved.target)
    report = partial(typer.echo, err=True)
    engine = Engine(
        models,
        block_size,
        max_new_tokens,
        max_queue,
        resolved.thinking,
        decode.seed,
        decode.no_draft,
        report,
        parallel=options.parallel,
    )
    projector = mmproj or resolved.mmproj
    if projector is not None and options.parallel > 1:  # one that comes with the model: serve text, and say so
        report(f"note: images are off: --parallel {options.parallel} takes no images yet (--parallel 1 takes them).")
    elif projector is not None:
        _images(engine, projector, options.threads, remote_images)
    return engine


def _images(worker: Engine, mmproj: Path, threads: int | None, remote: bool) -> None:
    """Give the engine --mmproj's projector (images in requests) and --allow-remote-images."""
    from ..vision import load_projector

    worker.projector, worker.remote_images = load_projector(worker.models, mmproj, threads), remote


def _announce(model: str, host: str, api_key: str | None, address: tuple) -> None:
    """On stderr: the exposure warning where one is due, then where the model is served."""
    from ..server import exposure_warning

    warning = exposure_warning(host, api_key)
    if warning:
        typer.echo(warning, err=True)
    shown = f"[{address[0]}]" if ":" in address[0] else address[0]
    apis = "OpenAI, Anthropic and Ollama APIs"
    typer.echo(f"serving {model} on http://{shown}:{address[1]}/v1 ({apis}; Ctrl-C stops)", err=True)


def _limits(
    max_queue: int, max_body: int, read_timeout: float, max_connections: int, port: int, parallel: int
) -> Limits:
    """serve's limits as the server wants them, each checked (and --max-queue, --parallel and --port) before anything
    loads."""
    from ..server import Limits

    counts = {"--max-queue": max_queue, "--max-body": max_body, "--max-connections": max_connections}
    counts["--parallel"] = parallel
    for flag, value in counts.items():
        if value < 1:
            raise DFlashError(f"{flag} must be at least 1, got {value}.")
    if not 0 < read_timeout < float("inf"):
        raise DFlashError(f"--read-timeout must be a number of seconds above 0, got {read_timeout:g}.")
    if not 0 <= port < 2**16:
        raise DFlashError(f"--port must be from 0 to 65535, got {port}.")
    return Limits(max_body, read_timeout, max_connections)


def _hand_off(
    engine: str, model: str, drafter: str | None, block_size: int | None, run: bool, offline: bool, token: str | None
) -> None:
    """serve --engine: print (or exec) the vLLM/SGLang launch command for the pair."""
    from ..handoff import ENGINES, engine_pair, launch_command

    if engine not in ENGINES:
        raise DFlashError(f"--engine must be {' or '.join(ENGINES)}, got '{engine}'.")
    fetch = fetcher(offline, token, cached_first=True)
    command = launch_command(engine, engine_pair(model, drafter, block_size, fetch))
    typer.echo(shlex.join(command))
    if run:
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            raise DFlashError(f"Cannot run {command[0]} ({exc.strerror}): is {engine} installed here?") from None
