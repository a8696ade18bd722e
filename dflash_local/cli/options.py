"""The options commands share, each declared once: the model options (how models are found, loaded and run) and the
decode options (what to generate; a command picks those it offers and may give one its own default or help). Each
group reaches its command as one value."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, Optional, get_type_hints

import typer

from ..defaults import DEFAULT_CONTEXT, MAX_NEW_TOKENS
from . import values

if TYPE_CHECKING:
    from pathlib import Path

    from ..catalog import ResolvedModel
    from ..decode import Settings
    from ..generation import LoadedModels
    from ..sampling import SamplingParams

Command = Callable[..., None]
BLOCK_HELP = "auto (chosen every step from measured costs and acceptance) or a fixed 2..the drafter's trained size."


# The options `dflash train` shares with the model options.
Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto (llama.cpp's GPU for a GGUF, CUDA for torch, else the CPU), cpu, cuda, vulkan, metal, or a "
        "llama.cpp device name such as Vulkan0 (dflash doctor lists them).",
    ),
]
Threads = Annotated[
    Optional[int], typer.Option("--threads", envvar="DFLASH_THREADS", help="CPU threads (default: torch's).")
]
# `dflash serve` and `dflash chat`: a chat template in place of the model's.
ChatTemplate = Annotated[
    Optional[str],
    typer.Option("--chat-template", help="chatml or a Jinja file, in place of the model's template (base models)."),
]

# The options `dflash pull` shares with the model options.
Offline = Annotated[bool, typer.Option("--offline", help="Use only models already pulled.")]
Token = Annotated[Optional[str], typer.Option("--token", help="Hugging Face token (default: HF_TOKEN).")]


# The environment variables give the model options' defaults.
@dataclass(frozen=True)
class ModelOptions:
    """The shared model options as one value, and the one way from them to loaded models."""

    device: Device = "auto"
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
    threads: Threads = None
    gpu_layers: Annotated[
        str, typer.Option("--gpu-layers", help="GGUFs on a GPU: auto (as many as fit), all, or a number of layers.")
    ] = "auto"
    cpu_moe: Annotated[
        bool, typer.Option("--cpu-moe", help="GGUFs on a GPU: keep MoE expert tensors in host memory.")
    ] = False
    max_context: Annotated[int, typer.Option("--max-context", help="KV cache length in tokens.")] = DEFAULT_CONTEXT
    cache_type: Annotated[
        str, typer.Option("--cache-type", help="GGUF targets: the KV cache's type, f16, q8_0 or q4_0 (K and V).")
    ] = "f16"
    cache_type_k: Annotated[
        Optional[str], typer.Option("--cache-type-k", help="GGUF targets: the K cache's type (default: --cache-type).")
    ] = None
    cache_type_v: Annotated[
        Optional[str], typer.Option("--cache-type-v", help="GGUF targets: the V cache's type (default: --cache-type).")
    ] = None
    offline: Offline = False
    quantize: Annotated[
        str, typer.Option("--quantize", help="Torch targets: auto (model's default), none, int4, nf4.")
    ] = "auto"
    drafter_quantize: Annotated[str, typer.Option("--drafter-quantize", help="Drafter linears: none, int8 or nf4.")] = (
        "none"
    )
    token: Token = None
    progress: Optional[Callable[[str], None]] = None  # no option: the status line's show() that main() passes, if any

    def __post_init__(self) -> None:
        from ..vulkan_probe import expose_for

        expose_for(self.device)

    def load(self, resolved: ResolvedModel, drafter: Path | None, backend: str, auto_block: bool) -> LoadedModels:
        """Load the resolved target and `drafter` (None: none) with `backend`, running as these options say; loading
        reports its phases to `progress`, and what it warns of goes to stderr."""
        from ..generation import load_models, placement_line
        from ..runtime import LoadSpec, RuntimeConfig

        runtime = RuntimeConfig(
            self.device, self.dtype, self.kernels, self.cuda_graphs, self.drafter_kind, self.threads
        )
        spec = LoadSpec(
            runtime,
            self.max_context,
            values.quantize(self.quantize, resolved.quantize),
            values.drafter_quantize(self.drafter_quantize),
            backend,
            gpu_layers=values.gpu_layers(self.gpu_layers),
            cpu_moe=self.cpu_moe,
            kv_cache=values.kv_cache(self.cache_type, self.cache_type_k, self.cache_type_v),
        )
        if self.progress is not None:
            spec = spec.reporting_to(self.progress)
        models = load_models(resolved.target, drafter, spec, auto_block=auto_block)
        for warning in models.warnings:
            typer.echo(warning, err=True)
        if models.devices["target"].get("layers_on_device") or self.device != "auto" or spec.kv_cache.quantized:
            typer.echo(f"placed: {placement_line(models.devices)}", err=True)
        return models


@dataclass(frozen=True)
class DecodeOptions:
    """The decode options as one value, and the one builder of decode's Settings from them."""

    drafter: Optional[str] = None
    max_new_tokens: Optional[int] = MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    block_size: str = "auto"
    no_draft: bool = False
    ignore_eos: bool = False
    lookup: bool = True

    def block(self) -> int | None:
        """--block-size as the engine wants it (None: auto); checked."""
        return values.block_size(self.block_size)

    def sampling(self) -> SamplingParams:
        """The sampling parameters, checked (before anything loads)."""
        from ..sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def settings(self, models: LoadedModels) -> Settings:
        """decode's Settings for `models`, checked (generation.decode_settings)."""
        from ..generation import decode_settings

        return decode_settings(
            models,
            self.max_new_tokens,
            self.sampling(),
            self.block(),
            no_draft=self.no_draft,
            lookup=self.lookup,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


@dataclass(frozen=True)
class Flag:
    """How a decode option reads on the command line: its flags, type and help."""

    flags: tuple[str, ...]
    annotation: Any
    help: str | None = None

    def annotated(self, own: Own | None = None) -> Any:
        """The option's type with its typer.Option, as declared or with `own` help or flags."""
        own = own or Own()
        help_text = self.help if own.help is DECLARED else own.help
        return Annotated[self.annotation, typer.Option(*(own.flags or self.flags), help=help_text)]


DECODE_FLAGS = {
    "drafter": Flag(
        ("--drafter",),
        Optional[str],
        "Drafter folder or Hub repo (default: the model's), or mtp: a GGUF's own MTP layers (Qwen3.5/3.6).",
    ),
    "max_new_tokens": Flag(("--max-new-tokens",), Optional[int]),
    "temperature": Flag(("--temperature",), float),
    "top_p": Flag(("--top-p",), float),
    "top_k": Flag(("--top-k",), int),
    "seed": Flag(("--seed",), Optional[int], "0 to 2**64 - 1: the same seed, the same samples."),
    "block_size": Flag(("--block-size",), str, BLOCK_HELP),
    "no_draft": Flag(("--no-draft",), bool, "Plain autoregressive decoding (the baseline)."),
    "ignore_eos": Flag(("--ignore-eos",), bool, "Do not stop at end-of-sequence tokens."),
    "lookup": Flag(("--lookup/--no-lookup",), bool, "Also draft what follows the text's end where it came before."),
}
DECLARED = object()  # an override that keeps the declared default or help


@dataclass(frozen=True)
class Own:
    """A command's own default, help or flags for a decode option (the rest as declared)."""

    default: Any = DECLARED
    help: Any = DECLARED
    flags: tuple[str, ...] | None = None


Seed = DECODE_FLAGS["seed"].annotated()  # `dflash train`'s --seed is decoding's


def _grouped(
    group: type, name: str, shared: list[inspect.Parameter], progress: bool = False
) -> Callable[[Command], Command]:
    """Give a command the `shared` parameters after its own and call it with their values as one `group`, `name`;
    with `progress`, also the click context's object (what main() passes: the status line's show) as its progress."""
    context = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)] if progress else []

    def decorate(command: Command) -> Command:
        @functools.wraps(command)
        def run(**given: Any) -> None:
            chosen = {p.name: given.pop(p.name) for p in shared}
            if progress:
                chosen["progress"] = given.pop("ctx").obj
            command(**given, **{name: group(**chosen)})

        own = inspect.signature(command, eval_str=True).parameters.values()
        parameters = [p for p in own if p.name != name] + shared + context
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        return run

    return decorate


def model_options(max_context: int | None = DEFAULT_CONTEXT) -> Callable[[Command], Command]:
    """The model options after a command's own, --max-context defaulting to `max_context` (None: the command has
    none); the command gets them as one ModelOptions, `options`."""
    hints, keyword = get_type_hints(ModelOptions, include_extras=True), inspect.Parameter.KEYWORD_ONLY
    shared = [
        inspect.Parameter(
            f.name, keyword, default=max_context if f.name == "max_context" else f.default, annotation=hints[f.name]
        )
        for f in fields(ModelOptions)
        if f.name != "progress" and (f.name != "max_context" or max_context is not None)
    ]
    return _grouped(ModelOptions, "options", shared, progress=True)


def decode_options(**offered: Own) -> Callable[[Command], Command]:
    """The decode options a command offers (by field name, each with its own default or help where it differs),
    after its own; the command gets them as one DecodeOptions, `decode` (the options it lacks at their defaults)."""
    defaults = {f.name: f.default for f in fields(DecodeOptions)}
    shared = []
    for name, own in offered.items():
        default = defaults[name] if own.default is DECLARED else own.default
        annotation = DECODE_FLAGS[name].annotated(own)
        shared.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return _grouped(DecodeOptions, "decode", shared)
