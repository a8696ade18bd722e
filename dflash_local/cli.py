"""The `dflash` command line: parses arguments, calls the engine, renders results."""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, get_type_hints

import typer

from .errors import DFlashError

if TYPE_CHECKING:
    from .catalog import ResolvedModel
    from .generation import LoadedModels

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Lossless block-diffusion speculative decoding (DFlash) on your own machine.",
)


# How models are found, loaded and run: the options generate, chat, serve and bench share, declared once here; the
# environment variables give their defaults.
@dataclass(frozen=True)
class ModelOptions:
    """The shared model options as one value, and the one way from them to loaded models."""

    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto"
    dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")] = "auto"
    kernels: Annotated[
        str, typer.Option("--kernels", envvar="DFLASH_KERNELS", help="auto (Triton on CUDA), triton or torch.")
    ] = "auto"
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs", envvar="DFLASH_CUDA_GRAPHS", help="Replay fixed-shape steps on CUDA."
        ),
    ] = True
    drafter_kind: Annotated[
        str,
        typer.Option(
            "--drafter-kind", envvar="DFLASH_DRAFTER", help="GGUF targets: auto, native (llama.cpp's) or torch."
        ),
    ] = "auto"
    threads: Annotated[
        Optional[int], typer.Option("--threads", envvar="DFLASH_THREADS", help="CPU threads (default: torch's).")
    ] = None
    max_context: int = 4096  # the command's own --max-context (its default and help differ; bench has none)
    offline: Annotated[bool, typer.Option("--offline", help="Use only models already pulled.")] = False
    quantize: Annotated[
        str, typer.Option("--quantize", help="Torch targets: auto (model's default), none, int4, nf4.")
    ] = "auto"
    drafter_quantize: Annotated[str, typer.Option("--drafter-quantize", help="Drafter linears: none, int8 or nf4.")] = (
        "none"
    )
    token: Annotated[Optional[str], typer.Option("--token", help="Hugging Face token (default: HF_TOKEN).")] = None

    def load(self, resolved: ResolvedModel, drafter: Path | None, backend: str, auto_block: bool) -> LoadedModels:
        """Load the resolved target and `drafter` (None: none) with `backend`, running as these options say."""
        from .generation import load_models
        from .runtime import RuntimeConfig

        quantize = _quantize(self.quantize, resolved.quantize)
        runtime = RuntimeConfig(
            self.device, self.dtype, self.kernels, self.cuda_graphs, self.drafter_kind, self.threads
        )
        drafter_quantize = _drafter_quantize(self.drafter_quantize)
        return load_models(
            resolved.target,
            drafter,
            runtime,
            backend,
            self.max_context,
            quantize,
            drafter_quantize,
            auto_block=auto_block,
        )


def model_options(max_context: Any = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the model options after its own, with `max_context` (a typer.Option, or None for none) as
    --max-context among them, and call it with their values as one ModelOptions, `options`."""
    hints, keyword = get_type_hints(ModelOptions, include_extras=True), inspect.Parameter.KEYWORD_ONLY
    shared = [
        inspect.Parameter(f.name, keyword, default=f.default, annotation=hints[f.name])
        if f.name != "max_context"
        else inspect.Parameter(f.name, keyword, default=max_context, annotation=int)
        for f in fields(ModelOptions)
        if f.name != "max_context" or max_context is not None
    ]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(command)
        def run(**values: Any) -> None:
            options = ModelOptions(**{p.name: values.pop(p.name) for p in shared})
            command(**values, options=options)

        own = inspect.signature(command, eval_str=True).parameters.values()
        run.__signature__ = inspect.Signature([p for p in own if p.name != "options"] + shared)  # type: ignore[attr-defined]
        return run

    return decorate


def _print_version(wanted: bool) -> None:
    """--version: print the version and exit while parsing, before click asks for a command."""
    if wanted:
        from . import __version__

        typer.echo(f"dflash-local {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn DFlashError into one line on stderr and exit status 1."""
    try:
        yield
    except DFlashError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _check_storage(hub_cache: bool = True) -> None:
    """Before anything is downloaded: the Hub cache and dflash's own folder must take files (one sentence if not)."""
    from .atomic import unwritable_reason
    from .paths import cache_dir, state_dir

    folders = [("The dflash folder", state_dir(), ("DFLASH_HOME",))]
    if hub_cache:
        folders.insert(0, ("The Hugging Face cache", cache_dir(), ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")))
    for what, folder, variables in folders:
        reason = unwritable_reason(folder)
        if reason is not None:
            variable = next((v for v in variables if os.environ.get(v)), None)
            source = f" (from {variable}={os.environ[variable]})" if variable else ""
            fix = f"point {variable} at a writable folder" if variable else f"make it writable or set {variables[0]}"
            raise DFlashError(f"{what} {folder}{source} is not writable ({reason}): {fix}.")


def _resolve(model: str, drafter: str | None, offline: bool, token: str | None):
    """Local paths for what the user named, pulling from the Hub (with progress) unless offline."""
    from .catalog import resolve
    from .downloads import Downloader

    downloader = Downloader(token, offline)

    def fetch(source):
        if not offline:
            _check_storage()
        return downloader(source)

    return resolve(model, drafter, fetch)


BLOCK_HELP = "auto (chosen every step from measured costs and acceptance) or a fixed 2..the drafter's trained size."


def _block_size(option: str) -> int | None:
    """--block-size as the engine wants it: None for auto, else a fixed size of at least 2."""
    if option == "auto":
        return None
    try:
        size = int(option)
    except ValueError:
        raise DFlashError(f"--block-size must be auto or a whole number, got '{option}'.") from None
    if size < 2:
        raise DFlashError(f"--block-size must be at least 2 (up to the drafter's trained size), got {size}.")
    return size


def _check_numbers(max_new_tokens: int, max_context: int | None = None, seed: int | None = None) -> None:
    """The numeric options of generate/chat/bench, checked before anything loads."""
    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    if max_context is not None and max_context < 1:
        raise DFlashError(f"--max-context must be at least 1 token, got {max_context}.")
    if seed is not None and not 0 <= seed < 2**64:
        raise DFlashError(f"--seed must be a whole number from 0 to {2**64 - 1}, got {seed}.")


def _prompt_text(prompt: str) -> str:
    """--prompt as given, unless the shell passed bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(exc.object[exc.start])
        what = f"the byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"the code point U+{char:04X}"
        raise DFlashError(
            f"--prompt is not valid UTF-8 text ({what} at position {exc.start}): "
            "pass UTF-8, or token ids with --prompt-ids."
        ) from None
    return prompt


def _quantize(option: str, default: str | None) -> str | None:
    """--quantize as the loader wants it: None, 'int4' or 'nf4'."""
    if option not in ("auto", "none", "int4", "nf4"):
        raise DFlashError(f"--quantize must be auto, none, int4 or nf4, got '{option}'.")
    return default if option == "auto" else (None if option == "none" else option)


def _drafter_quantize(option: str) -> str | None:
    """--drafter-quantize as the loader wants it: None, 'int8' or 'nf4'."""
    if option not in ("none", "int8", "nf4"):
        raise DFlashError(f"--drafter-quantize must be none, int8 or nf4, got '{option}'.")
    return None if option == "none" else option


def _parse_ids(text: str, option: str) -> list[int]:
    """Comma-separated integers; blank text is no ids, an empty or non-integer element is an error."""
    if not text.strip():
        return []
    ids = []
    for number, part in enumerate(text.split(","), 1):
        try:
            ids.append(int(part))
        except ValueError:
            what = f"element {number} is empty" if not part.strip() else f"'{part.strip()}' is not an integer"
            raise DFlashError(f"{option} must be comma-separated integers, got '{text}' ({what}).") from None
    return ids


@app.command()
@model_options(typer.Option(4096, "--max-context", help="KV cache length in tokens."))
def generate(
    target: str = typer.Option(..., "--target", help="A model name, a Hub repo, an HF-layout folder or a .gguf file."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="DFlash drafter: a folder or a Hub repo."),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", help="Prompt text, UTF-8 (other bytes are an error); needs the target's tokenizer."
    ),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="0 to 2**64 - 1: the same seed, the same samples."),
    block_option: str = typer.Option("auto", "--block-size", help=BLOCK_HELP),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding (the baseline)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at end-of-sequence tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    backend: str = typer.Option("auto", "--backend", help="auto (llamacpp for .gguf on the CPU), torch or llamacpp."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Output JSON following this schema file."),
    *,
    options: ModelOptions,
) -> None:
    """Generate one continuation of a prompt, with DFlash drafting or without."""
    with user_errors():
        if (prompt is None) == (prompt_ids is None):
            raise DFlashError("Give exactly one of --prompt or --prompt-ids.")
        _check_numbers(max_new_tokens, options.max_context, seed)
        block_size = _block_size(block_option)
        given = _prompt_text(prompt) if prompt is not None else _parse_ids(prompt_ids, "--prompt-ids")

        from .decode import Settings
        from .generation import GenerationRequest, run_request
        from .grammar import compile_grammar, json_schema_grammar, load_schema
        from .sampling import SamplingParams

        sampling = SamplingParams(temperature, top_p, top_k)  # checks them before anything loads
        grammar_text = None if json_schema is None else json_schema_grammar(load_schema(json_schema))
        resolved = _resolve(target, drafter, options.offline, options.token)
        if not no_draft and resolved.drafter is None:
            raise DFlashError("Pass --drafter DIR, or --no-draft for plain autoregressive decoding.")
        if backend == "auto":
            backend = resolved.backend
        models = options.load(resolved, None if no_draft else resolved.drafter, backend, block_size is None)
        vocab, stops = models.target.vocab_size, models.stop_ids
        grammar = None if grammar_text is None else compile_grammar(grammar_text, models.tokenizer, vocab, stops)
        settings = Settings(
            grammar=grammar,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            block_size=block_size,
            draft=not no_draft,
            stop_ids=models.stops(ignore_eos),
            seed=seed,
        )
        request = GenerationRequest(given, settings)
        on_text = None if as_json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        result = run_request(models, request, on_text=on_text)
        if as_json:
            typer.echo(json.dumps(result))
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


@app.command()
@model_options(typer.Option(2048, "--max-context"))
def chat(
    model: str = typer.Argument("tiny", help="A model name (dflash models), a Hub repo, a folder or a .gguf file."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter folder or Hub repo (default: the model's)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Longest answer in tokens."),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    block_option: str = typer.Option("auto", "--block-size", help=BLOCK_HELP),
    no_draft: bool = typer.Option(False, "--no-draft", help="Start with drafting off."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Answer until --max-new-tokens, past end-of-turn."),
    *,
    options: ModelOptions,
) -> None:
    """Chat with a model: streaming answers, live tokens/s and acceptance, /help for commands."""
    with user_errors():
        _check_numbers(max_new_tokens, options.max_context)
        block_size = _block_size(block_option)

        from .chat import run_chat
        from .decode import Settings
        from .generation import OUT_OF_MEMORY, out_of_memory
        from .sampling import SamplingParams

        sampling = SamplingParams(temperature, top_p, top_k)
        resolved = _resolve(model, drafter, options.offline, options.token)
        models = options.load(resolved, resolved.drafter, resolved.backend, block_size is None)
        settings = Settings(
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            block_size=block_size,
            draft=not no_draft and models.drafter is not None,
            stop_ids=models.stops(ignore_eos),
        )
        try:
            run_chat(models, settings, thinking=resolved.thinking)
        except OUT_OF_MEMORY:
            raise out_of_memory("Answering in this conversation", models.target.device.type) from None


@app.command()
@model_options(typer.Option(4096, "--max-context", help="KV cache length in tokens."))
def serve(
    model: str = typer.Argument("tiny", help="A model name (dflash models), a Hub repo, a folder or a .gguf file."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter folder or Hub repo (default: the model's)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (other machines: 0.0.0.0)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="DFLASH_API_KEY", help="Require Authorization: Bearer KEY on /v1 requests."
    ),
    queue_size: int = typer.Option(16, "--queue-size", help="Requests that may wait; more are answered 503."),
    max_body: int = typer.Option(4 * 2**20, "--max-body", help="Largest request body in bytes; more is a 413."),
    read_timeout: float = typer.Option(
        30.0, "--read-timeout", help="Seconds a client has to send its request's headers, then its body (else 408)."
    ),
    max_connections: int = typer.Option(100, "--max-connections", help="Open connections; more are answered 503."),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", help="Default answer length when a request has no max_tokens (default: the context)."
    ),
    cors_origins: list[str] = typer.Option(
        [], "--cors-origin", help="A browser origin allowed to call the API (repeatable; default: none)."
    ),
    block_option: str = typer.Option("auto", "--block-size", help=BLOCK_HELP),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding (the baseline)."),
    engine: Optional[str] = typer.Option(
        None, "--engine", help="vllm or sglang: print that engine's launch command for this pair instead of serving."
    ),
    run_engine: bool = typer.Option(False, "--exec", help="With --engine: then run it (in place of dflash)."),
    *,
    options: ModelOptions,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (or print a vLLM/SGLang command for the same pair)."""
    with user_errors():
        block_size = _block_size(block_option)
        if engine is not None:
            _hand_off(engine, model, drafter, block_size, run_engine, options.offline, options.token)
            return
        if run_engine:
            raise DFlashError("--exec runs an engine's command: use it with --engine vllm or --engine sglang.")
        _check_numbers(1 if max_new_tokens is None else max_new_tokens, options.max_context)
        counts = {"--queue-size": queue_size, "--max-body": max_body, "--max-connections": max_connections}
        for flag, value in counts.items():
            if value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}.")
        if not 0 < read_timeout < float("inf"):
            raise DFlashError(f"--read-timeout must be a number of seconds above 0, got {read_timeout:g}.")
        if not 0 <= port < 2**16:
            raise DFlashError(f"--port must be from 0 to 65535, got {port}.")

        from .server import Engine, Limits, create_app, exposure_warning, listen, run_server

        sock = listen(host, port)  # before loading: a taken port fails at once
        resolved = _resolve(model, drafter, options.offline, options.token)
        models = options.load(resolved, None if no_draft else resolved.drafter, resolved.backend, block_size is None)
        worker = Engine(models, block_size, max_new_tokens, queue_size, resolved.thinking)
        warning = exposure_warning(host, api_key)
        if warning:
            typer.echo(warning, err=True)
        address = sock.getsockname()
        shown = f"[{address[0]}]" if ":" in address[0] else address[0]
        typer.echo(f"serving {model} on http://{shown}:{address[1]}/v1 (OpenAI API; Ctrl-C stops)", err=True)
        limits = Limits(max_body, read_timeout, max_connections)
        run_server(create_app(worker, model, api_key, limits, tuple(cors_origins)), sock, limits)


def _hand_off(
    engine: str, model: str, drafter: str | None, block_size: int | None, run: bool, offline: bool, token: str | None
) -> None:
    """serve --engine: print (or exec) the vLLM/SGLang launch command for the pair."""
    import shlex

    from .downloads import Downloader
    from .handoff import ENGINES, engine_pair, launch_command
    from .hub import cached_folder

    if engine not in ENGINES:
        raise DFlashError(f"--engine must be {' or '.join(ENGINES)}, got '{engine}'.")
    downloader = Downloader(token, offline)

    def fetch(source):
        if not offline:
            _check_storage()
        return cached_folder(source) or downloader(source)

    command = launch_command(engine, engine_pair(model, drafter, block_size, fetch))
    typer.echo(shlex.join(command))
    if run:
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            raise DFlashError(f"Cannot run {command[0]} ({exc.strerror}): is {engine} installed here?") from None


@app.command()
@model_options()
def bench(
    names: Optional[list[str]] = typer.Argument(
        None, help="Model names (dflash models), Hub repos, folders or .gguf files; default: tiny.", show_default=False
    ),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter folder or Hub repo (default: the model's)."),
    prompts: Optional[str] = typer.Option(
        None, "--prompts", help="A JSONL file, or a dataset: gsm8k, humaneval, mt-bench (default: the model's own set)."
    ),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    block_option: str = typer.Option("auto", "--block-size", help=BLOCK_HELP),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--stop-at-eos", help="Generate all max-new-tokens."),
    lookup: bool = typer.Option(True, "--lookup/--no-lookup", help="Also run the prompt-lookup baseline."),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Measure this machine's cost per block size afresh and show the table first."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: histogram and tokens/s."),
    *,
    options: ModelOptions,
) -> None:
    """Autoregressive vs DFlash (and prompt lookup) on the same target, prompt by prompt; one table per model."""
    with user_errors():
        _check_numbers(max_new_tokens, seed=seed)
        block_size = _block_size(block_option)
        if limit is not None and limit < 1:
            raise DFlashError(f"--limit must be at least 1, got {limit}.")

        from .bench import calibration_report, plot, read_prompts, run_bench
        from .decode import Settings
        from .generation import OUT_OF_MEMORY, out_of_memory, recalibrate
        from .sampling import SamplingParams

        if calibrate and block_size is not None:
            raise DFlashError("--calibrate measures the costs behind --block-size auto; drop --block-size.")
        sampling = SamplingParams(temperature)
        reports = []
        for model in names or ["tiny"]:
            resolved = _resolve(model, drafter, options.offline, options.token)
            prompt_file = _prompt_file(prompts, options.offline, options.token) if prompts else resolved.prompts
            if prompt_file is None:
                raise DFlashError(f"'{model}' has no built-in prompt set: pass --prompts FILE.jsonl or a dataset name.")
            if resolved.drafter is None:
                raise DFlashError(f"'{model}' has no drafter: pass --drafter DIR or a Hub repo.")
            models = options.load(resolved, resolved.drafter, resolved.backend, block_size is None)
            calibration = calibration_report(recalibrate(models).costs) if calibrate else None
            if calibration is not None and not as_json:
                _print_costs(model, calibration)
            settings = Settings(
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                block_size=block_size,
                stop_ids=models.stops(ignore_eos),
                seed=seed,
            )
            try:
                report = run_bench(models, read_prompts(prompt_file, models, limit), settings, lookup)
            except OUT_OF_MEMORY:
                raise out_of_memory(f"A benchmark run of {model}", models.target.device.type) from None
            report["model"] = model
            if calibration is not None:
                report["calibration"] = calibration
            if plot_path is not None:
                suffix = f"-{Path(model).name}" if len(names or []) > 1 else ""
                plot(report, plot_path.with_name(f"{plot_path.stem}{suffix}{plot_path.suffix}"))
            if not as_json:
                _print_bench(report)
            reports.append(report)
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports))


def _print_costs(model: str, calibration: dict) -> None:
    """The cost table behind --block-size auto: when it was measured, and per k the calibration's timings (fastest,
    median, slowest, rounds), the fitted target and drafter costs, the step's, and the break-even tokens per step."""
    import statistics
    import time

    from rich.console import Console
    from rich.table import Table

    def timings(samples: list[float]) -> str:
        if not samples:
            return "-"
        return f"{samples[0]:.2f} / {statistics.median(samples):.2f} / {samples[-1]:.2f} ({len(samples)})"

    measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(calibration["measured_at"]))
    table = Table(
        title=f"{model}: cost per step on this machine (--block-size auto), measured {measured}",
        caption="timings: fastest / median / slowest (rounds); the fit: each size's fastest, never falling with k and "
        "at most doubling per doubling of k; sizes not timed are interpolated",
    )
    columns = (
        "k",
        "target timings ms",
        "target ms",
        "drafter timings ms",
        "drafter ms",
        "step ms",
        "tokens to beat plain",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in calibration["sizes"]:
        drafter = f"{row['draft_ms']:.2f}" if row["k"] > 1 else "-"
        table.add_row(
            str(row["k"]),
            timings(row["target_samples_ms"]),
            f"{row['target_ms']:.2f}",
            timings(row["draft_samples_ms"]),
            drafter,
            f"{row['step_ms']:.2f}",
            f"{row['break_even_tokens']:.2f}",
        )
    Console().print(table)


def _prompt_file(prompts: str, offline: bool, token: str | None) -> Path:
    """A JSONL path as given, or a named Hugging Face prompt set fetched and converted to JSONL."""
    from .prompt_sets import PROMPT_SETS, prompt_file

    if prompts in PROMPT_SETS and not Path(prompts).exists():
        _check_storage(hub_cache=not offline)
        return prompt_file(prompts, token, offline)
    return Path(prompts)


def _print_bench(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    names = [name for name in report["mean"] if name != "speedup"]
    labels = {"autoregressive": "AR", "dflash": "DFlash", "prompt_lookup": "lookup"}
    table = Table(title=f"{report['model']}: {report['max_new_tokens']} new tokens, block {report['block_size']}")
    table.add_column("prompt", max_width=28, no_wrap=True)
    table.add_column("tau", justify="right")
    for name in names:
        table.add_column(f"{labels[name]} tok/s", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("identical")
    for row in report["prompts"]:
        rates = [f"{row[n]['decode_tokens_per_s']:.0f}" for n in names]
        table.add_row(
            row["prompt"].splitlines()[0],
            f"{row['dflash']['tau']:.2f}",
            *rates,
            f"{row['speedup']:.2f}x",
            "yes" if row["identical"] else "NO",
        )
    mean = report["mean"]
    table.add_row(
        "mean",
        f"{mean['dflash']['tau']:.2f}",
        *[f"{mean[n]['decode_tokens_per_s']:.0f}" for n in names],
        f"{mean['speedup']:.2f}x",
        "yes" if report["all_identical"] else "NO",
        style="bold",
    )
    used: dict[int, int] = {}
    for row in report["prompts"]:
        for k, count in row["dflash"]["block_histogram"].items():
            used[int(k)] = used.get(int(k), 0) + count
    rates = " ".join(f"{rate:.2f}" for rate in report["dflash_acceptance_by_position"])
    table.caption = (
        "DFlash steps by block size k (1 = plain): "
        + " ".join(f"{k}:{n}" for k, n in sorted(used.items()))
        + f"\ndrafting steps that accepted at least j = 1, 2, ... drafts: {rates}"
    )
    Console().print(table)


@app.command()
def convert(
    source: Path = typer.Argument(..., help="HF-layout Llama/Qwen3 target folder."),
    out: Path = typer.Option(..., "--out", help="The GGUF file to write."),
    kind: str = typer.Option("f16", "--type", help="f16, bf16, q8_0, q6_k, q5_k_m, q4_k_m or q4_0."),
) -> None:
    """Convert a target to one GGUF file, quantized by llama.cpp's own quantizer."""
    with user_errors():
        try:
            from .gguf.convert import convert as convert_to_gguf
        except ImportError:
            raise DFlashError("dflash convert needs llama-cpp-python and gguf (dflash-local[gguf]).") from None

        path = convert_to_gguf(source, out, kind)
        typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {kind})")


def _hub_sources(name: str) -> tuple[list, bool]:
    """The Hub sources behind a model name or repo, and whether the name is a bundled model."""
    from .catalog import ModelEntry, lookup
    from .hub import HubSource

    found = lookup(name)
    sources = found.sources() if isinstance(found, ModelEntry) else [found]
    hub = [s for s in sources if isinstance(s, HubSource)]
    return hub, isinstance(found, ModelEntry) and found.bundled


@app.command()
def pull(
    name: str = typer.Argument(..., help="A model name (dflash models) or a Hub repo: owner/name[:QUANT]."),
    offline: bool = typer.Option(False, "--offline", help="Do not download: check what is already pulled."),
    token: Optional[str] = typer.Option(
        None, "--token", help="Hugging Face token for gated repos (default: HF_TOKEN)."
    ),
) -> None:
    """Download a model (target + drafter) into the Hugging Face cache: resumable, verified, only needed files."""
    with user_errors():
        from .downloads import Downloader
        from .hub import HubUnreachable, cached_folder, human_size, local_size

        sources, bundled = _hub_sources(name)
        if bundled:
            typer.echo(f"{name} is bundled with dflash-local: nothing to download.")
            return
        if not offline:
            _check_storage()
        downloader = Downloader(token, offline)
        for source in sources:
            if offline:
                folder = cached_folder(source) or downloader(source)  # refuses: nothing is fetched offline
                typer.echo(f"{source.repo}: pulled, {human_size(local_size(source) or 0)} in {folder}")
            else:
                try:
                    downloader.pull(source)
                except HubUnreachable:
                    if cached_folder(source) is None:
                        raise
                    typer.echo(f"{source.repo}: the Hub is unreachable, so no update check; the pulled copy is whole.")
        typer.echo(f"{name} is ready: dflash chat {name}")


@app.command(name="models")
def list_models(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON array instead of the list."),
) -> None:
    """The model catalog and the GGUF models other tools keep here: what each name is, needs, and has on disk."""
    with user_errors():
        from rich.console import Console

        from .model_list import model_rows, plain_line, render, rows_as_json

        rows = model_rows()
        console = Console()
        if as_json:
            typer.echo(json.dumps(rows_as_json(rows)))
        elif console.is_terminal:
            render(rows, console)
        else:
            for row in rows:
                typer.echo(plain_line(row))


@app.command()
def rm(name: str = typer.Argument(..., help="A model name or Hub repo pulled before.")) -> None:
    """Delete a pulled model's files from the cache (files another downloaded model uses are kept)."""
    with user_errors():
        from .catalog import load_catalog
        from .hub import cached_folder, human_size, pulled_files, remove

        sources, bundled = _hub_sources(name)
        if bundled:
            raise DFlashError(f"{name} is bundled with dflash-local; there is nothing to remove.")
        pulled = [s for s in sources if pulled_files(s)]
        if not pulled:
            raise DFlashError(f"{name} is not downloaded.")
        shared = {
            s
            for other in load_catalog().values()
            if other.name != name and not other.bundled and all(cached_folder(x) for x in other.sources())
            for s in other.sources()
        }
        freed = sum(remove(s) for s in pulled if s not in shared)
        kept = [s.repo for s in pulled if s in shared]
        note = f" (kept {', '.join(kept)}: another downloaded model uses it)" if kept else ""
        typer.echo(f"removed {name}: freed {human_size(freed)}{note}")


@app.command()
def doctor(
    model: Optional[str] = typer.Argument(
        None, help="A model name, Hub repo, folder or .gguf file: also whether it is downloaded and fits (no download)."
    ),
) -> None:
    """What this machine offers: torch, CUDA/GPU and VRAM, Triton, bitsandbytes, llama.cpp, huggingface_hub, disk."""
    with user_errors():
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        from .doctor import model_checks, run_checks

        about_model = model_checks(model) if model is not None else []
        table = Table(show_header=False, box=None)
        marks = {True: "[green]ok[/green]", False: "[red]!![/red]", None: "[dim]--[/dim]"}
        for check in run_checks() + about_model:
            table.add_row(marks[check.ok], check.name, escape(check.found))
        Console().print(table)


def main() -> None:
    """Console-script entry point: a status line on a terminal until the command's first output."""
    from .startup import STATUS

    STATUS.start("starting: importing libraries")
    try:
        app()
    finally:
        STATUS.stop()


@app.command()
def train(
    target: Path = typer.Option(
        ..., "--target", help="Target the drafter will serve: a model folder (HF layout) or a .gguf file (llama.cpp)."
    ),
    corpus: list[Path] = typer.Option(..., "--corpus", help="Prompt corpus: text files, folders, JSONL chats."),
    out: Path = typer.Option(..., "--out", help="Where to write the drafter (config.json + model.safetensors)."),
    work: Optional[Path] = typer.Option(None, "--work", help="Shards and checkpoints (default: OUT.work)."),
    layers: int = typer.Option(2, "--layers", help="Drafter depth."),
    block_size: int = typer.Option(16, "--block-size"),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="e.g. 1,3,5 (default: spread)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Default: <|mask|> or the last id."),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", help="Window length of text prompts."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Use at most this many prompts."),
    new_tokens: int = typer.Option(192, "--new-tokens", help="Tokens the target writes per prompt."),
    sampled_fraction: float = typer.Option(0.25, "--sampled-fraction", help="Share of sampled (not greedy) data."),
    steps: int = typer.Option(2000, "--steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per optimisation step."),
    anchors: int = typer.Option(16, "--anchors", help="Blocks per sequence per step."),
    lr: float = typer.Option(6e-4, "--lr"),
    warmup: int = typer.Option(100, "--warmup", help="Steps of linear learning-rate warm-up."),
    eval_every: int = typer.Option(100, "--eval-every"),
    seed: int = typer.Option(0, "--seed"),
    draft_vocab: Optional[int] = typer.Option(
        None, "--draft-vocab", help="Draft over the N ids most frequent in the data only (default: all)."
    ),
    distill_batch: int = typer.Option(32, "--distill-batch", help="Prompts the target continues at once."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for a GGUF target (default: all)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in the work folder."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    init: Optional[str] = typer.Option(
        None, "--init", help="Start from 'target' (its last layers) or a drafter folder (fine-tune it); default random."
    ),
    soft_top_k: int = typer.Option(0, "--soft-top-k", help="Keep the target's top-k logits per token (soft labels)."),
    soft_weight: float = typer.Option(0.0, "--soft-weight", help="Share of the loss on the soft labels (0..1)."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Loss decay over block offsets (default 7*B/16)."),
) -> None:
    """Train a DFlash drafter for a target by self-distillation."""
    with user_errors():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        from .runtime import pick_device
        from .train.pipeline import DistillProgress, TrainRequest, run_training
        from .train.selfdistill import DistillSettings
        from .train.trainer import TrainSettings
        from .train.warm_start import WarmStart

        request = TrainRequest(
            target=target,
            corpus=corpus,
            out=out,
            work=work,
            prompt_tokens=prompt_tokens,
            max_prompts=max_prompts,
            mask_token_id=mask_token_id,
            target_layer_ids=_parse_ids(target_layer_ids, "--target-layer-ids") if target_layer_ids else None,
            draft_vocab=draft_vocab,
            threads=threads,
            resume=resume,
            device=pick_device(device),
            init=init,
            distill=DistillSettings(
                new_tokens=new_tokens,
                batch_size=distill_batch,
                sampled_fraction=sampled_fraction,
                seed=seed,
                soft_top_k=soft_top_k,
            ),
            train=TrainSettings(
                layers=layers,
                block_size=block_size,
                steps=steps,
                batch_size=batch_size,
                anchors=anchors,
                lr=lr,
                warmup=warmup,
                eval_every=eval_every,
                seed=seed,
                gamma=gamma,
                soft_weight=soft_weight,
            ),
        )
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        tau = "-"
        with Progress(*columns, transient=False) as progress:
            distill = progress.add_task("self-distilling", total=None, info="")
            fit = None
            for event in run_training(request):
                if isinstance(event, DistillProgress):
                    progress.update(distill, completed=event.done, total=event.total, info=f"{event.done} prompts")
                    continue
                if isinstance(event, WarmStart):
                    progress.console.log(f"warm start from {event.source}: {event.tensors} tensors {event.layers}")
                    continue
                if fit is None:
                    fit = progress.add_task("training", total=event.steps, info="")
                if event.tau_estimate is not None:
                    tau = f"{event.tau_estimate:.2f}"
                    progress.console.log(f"step {event.step}/{event.steps} loss {event.loss:.3f} held-out tau {tau}")
                progress.update(
                    fit,
                    completed=event.step,
                    info=f"loss {event.loss:.3f} · held-out tau {tau} · {event.tokens_per_s:.0f} tok/s",
                )
        typer.echo(f"drafter written to {out} (held-out tau estimate {tau})")
