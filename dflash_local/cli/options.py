"""The options commands share, each declared once as an Annotated alias that a command writes out in its signature:
the model options (how models are found, loaded and run) and the decode options (what to generate). A command picks
its arguments up as one ModelOptions and one DecodeOptions (`picked`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

from ..defaults import DEFAULT_CONTEXT, MAX_NEW_TOKENS, MIN_BLOCK
from . import values

if TYPE_CHECKING:
    from ..catalog import ResolvedModel
    from ..decode import Settings
    from ..generation import LoadedModels
    from ..sampling import SamplingParams
    from ..session import Session


# The model options (how models are found, loaded and run), in the order the commands list them; `dflash train`
# shares --device and --threads, `dflash pull` --offline and --token.
Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto (llama.cpp's GPU for a GGUF, CUDA for torch, else the CPU), cpu, cuda, vulkan, metal, or a "
        "llama.cpp device name such as Vulkan0 (dflash doctor lists them).",
    ),
]
DType = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
Kernels = Annotated[
    str, typer.Option("--kernels", envvar="DFLASH_KERNELS", help="auto (Triton on CUDA), triton or torch.")
]
CudaGraphs = Annotated[
    bool,
    typer.Option(
        "--cuda-graphs/--no-cuda-graphs", envvar="DFLASH_CUDA_GRAPHS", help="Replay fixed-shape steps on CUDA."
    ),
]
DrafterKind = Annotated[
    str,
    typer.Option("--drafter-kind", envvar="DFLASH_DRAFTER", help="GGUF targets: auto, native (llama.cpp's) or torch."),
]
Threads = Annotated[
    Optional[int], typer.Option("--threads", envvar="DFLASH_THREADS", help="CPU threads (default: torch's).")
]
GpuLayers = Annotated[
    str, typer.Option("--gpu-layers", help="GGUFs on a GPU: auto (as many as fit), all, or a number of layers.")
]
CpuMoe = Annotated[bool, typer.Option("--cpu-moe", help="GGUFs on a GPU: keep MoE expert tensors in host memory.")]
MaxContext = Annotated[int, typer.Option("--max-context", help="KV cache length in tokens.")]
CacheType = Annotated[
    str, typer.Option("--cache-type", help="GGUF targets: the KV cache's type, f16, q8_0 or q4_0 (K and V).")
]
CacheTypeK = Annotated[
    Optional[str], typer.Option("--cache-type-k", help="GGUF targets: the K cache's type (default: --cache-type).")
]
CacheTypeV = Annotated[
    Optional[str], typer.Option("--cache-type-v", help="GGUF targets: the V cache's type (default: --cache-type).")
]
Offline = Annotated[bool, typer.Option("--offline", help="Use only models already pulled.")]
Quantize = Annotated[str, typer.Option("--quantize", help="Torch targets: auto (model's default), none, int4, nf4.")]
DrafterQuantize = Annotated[str, typer.Option("--drafter-quantize", help="Drafter linears: none, int8 or nf4.")]
Token = Annotated[Optional[str], typer.Option("--token", help="Hugging Face token (default: HF_TOKEN).")]
# Vision: a GGUF target's projector, for images in the prompt.
Mmproj = Annotated[
    Optional[Path],
    typer.Option(
        "--mmproj",
        metavar="FILE",
        help="The vision projector (an mmproj GGUF) of a GGUF target, for images (default: the catalog entry's, or "
        "the one ollama or LM Studio keeps with the model).",
    ),
]
# `dflash serve` and `dflash chat`: the prompt cache (saved prompt states in host RAM).
CacheRam = Annotated[
    int,
    typer.Option(
        "--cache-ram", help="MiB of RAM for other conversations' saved prompt states, least recently used out (0: off)."
    ),
]

# The decode options (what to generate); a command that gives one its own help writes its Annotated out.
Drafter = Annotated[
    Optional[str],
    typer.Option(
        "--drafter",
        help="Drafter folder or Hub repo (default: the model's), or mtp: a GGUF's own MTP layers (Qwen3.5/3.6).",
    ),
]
MaxNewTokens = Annotated[Optional[int], typer.Option("--max-new-tokens")]
Temperature = Annotated[float, typer.Option("--temperature")]
TopP = Annotated[float, typer.Option("--top-p")]
TopK = Annotated[int, typer.Option("--top-k")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="0 to 2**64 - 1: the same seed, the same samples.")]
BlockSize = Annotated[
    str,
    typer.Option(
        "--block-size",
        help=f"auto (chosen every step from measured costs and acceptance) or a fixed {MIN_BLOCK}..the drafter's "
        "trained size.",
    ),
]
NoDraft = Annotated[bool, typer.Option("--no-draft", help="Plain autoregressive decoding (the baseline).")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence tokens.")]
Lookup = Annotated[
    bool, typer.Option("--lookup/--no-lookup", help="Also draft what follows the text's end where it came before.")
]

# `dflash serve` and `dflash chat`: a chat template in place of the model's.
ChatTemplate = Annotated[
    Optional[str],
    typer.Option("--chat-template", help="chatml or a Jinja file, in place of the model's template (base models)."),
]

Group = TypeVar("Group", "ModelOptions", "DecodeOptions")


def picked(group: type[Group], arguments: dict[str, Any], **extra: Any) -> Group:
    """A command's arguments (its locals() on entry) as one `group`: its fields by name, the ones the command lacks at
    their defaults, and `extra`."""
    return group(**{f.name: arguments[f.name] for f in fields(group) if f.name in arguments}, **extra)


@dataclass(frozen=True)
class ModelOptions:
    """The shared model options as one value, and the one way from them to loaded models."""

    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    cuda_graphs: bool = True
    drafter_kind: str = "auto"
    threads: Optional[int] = None
    gpu_layers: str = "auto"
    cpu_moe: bool = False
    max_context: int = DEFAULT_CONTEXT
    cache_type: str = "f16"
    cache_type_k: Optional[str] = None
    cache_type_v: Optional[str] = None
    offline: bool = False
    quantize: str = "auto"
    drafter_quantize: str = "none"
    token: Optional[str] = None
    cache_ram: int = 0  # MiB of host RAM for saved prompt states (the commands with --cache-ram); 0: none
    parallel: int = 1  # sequences the target's context holds, decoded together (serve --parallel)
    progress: Optional[Callable[[str], None]] = None  # the status line's show() that main() passes, if any

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
            sequences=self.parallel,
        )
        if self.progress is not None:
            spec = spec.reporting_to(self.progress)
        models = load_models(resolved.target, drafter, spec, auto_block=auto_block)
        for warning in models.warnings:
            typer.echo(warning, err=True)
        placed = models.devices["target"].get("layers_on_device") or self.device != "auto" or spec.kv_cache.quantized
        if self.cache_ram:
            models.session = prompt_cache_session(self.cache_ram)
        if placed:
            cache = f"; prompt cache up to {self.cache_ram} MiB of host RAM" if self.cache_ram else ""
            typer.echo(f"placed: {placement_line(models.devices)}{cache}", err=True)
        return models


def prompt_cache_session(mib: int) -> Session:
    """A session whose prompt cache keeps up to `mib` MiB of saved prompt states in host RAM."""
    from ..prompt_cache import PromptCache
    from ..session import Session

    return Session(PromptCache(mib * 2**20))


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
