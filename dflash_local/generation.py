"""Glue between files on disk and the decode loop: load a target/drafter pair, run one request."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .block_policy import (
    CHECK_ROUNDS,
    BlockPolicy,
    CostTable,
    costs_file,
    load_policy,
    measure_costs,
    time_steps,
    unwritable_warning,
)
from .decode import Settings, Stats, Step, generate
from .defaults import block_limit
from .drafters import load_drafter, native_runs
from .drafters.base import Drafter
from .errors import DFlashError
from .kv_cache import KVCache
from .offload import file_bytes
from .reply.text_stream import TextStream
from .runtime import LoadSpec, plan_load
from .session import Session
from .targets import load_target
from .targets.base import Target
from .tokenizer import TextTokenizer, stop_token_ids

if TYPE_CHECKING:
    from .gguf.tokenizer import GGUFTokenizer
    from .grammar import Grammar
    from .sampling import SamplingParams


@dataclass
class LoadedModels:
    """A target, its optional drafter, tokenizer and end-of-sequence ids, the session their caches belong to, and what
    loading warns the user of (the CLI shows it)."""

    target: Target
    drafter: Drafter | None
    tokenizer: TextTokenizer | GGUFTokenizer | None
    stop_ids: frozenset[int]
    policy: BlockPolicy | None = None  # picks each step's block size (--block-size auto)
    session: Session = field(default_factory=Session)  # what the caches hold: every generation reuses it
    warnings: tuple[str, ...] = ()  # e.g. the block costs cannot be kept (an unwritable state folder)
    devices: dict = field(default_factory=dict)  # where the target's layers and the drafter run (placed_on)


def decode_settings(
    models: LoadedModels,
    max_new_tokens: int,
    sampling: SamplingParams,
    block_size: int | None,
    *,
    no_draft: bool = False,
    lookup: bool = True,
    ignore_eos: bool = False,
    seed: int | None = None,
    grammar: Grammar | None = None,
) -> Settings:
    """decode's Settings for a request to `models`, the one builder (chat, generate, bench, serve): drafting unless
    no_draft, or no drafter is loaded and lookup is off; the end-of-sequence ids stop it unless ignore_eos."""
    return Settings(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        block_size=block_size,
        draft=not no_draft and (models.drafter is not None or lookup),
        stop_ids=frozenset() if ignore_eos else models.stop_ids,
        seed=seed,
        grammar=grammar,
        lookup=lookup,
    )


OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)


def out_of_memory(what: str, device: str) -> DFlashError:
    """The one sentence for running out of (GPU) memory: what did not fit, and what to try."""
    if device.startswith("cuda"):
        where, advice = "GPU memory", "a smaller --max-context, --quantize int4, a smaller model or --device cpu"
    else:
        where, advice = "memory", "a smaller --max-context or a smaller model"
    return DFlashError(f"{what} does not fit in {where}: try {advice}.")


@contextmanager
def memory_guard(what: str, device: str) -> Iterator[None]:
    """Turn running out of memory inside the block into out_of_memory(what, device)."""
    try:
        yield
    except OUT_OF_MEMORY:
        raise out_of_memory(what, device) from None


def load_models(
    target_path: Path, drafter_path: Path | None, spec: LoadSpec = LoadSpec(), auto_block: bool = True
) -> LoadedModels:
    """Load and cross-check a target and (optionally) a drafter from local paths as `spec` says (planned here, once:
    runtime.plan_load); with auto_block, also the pair's block policy (its costs measured on first load on this
    machine, then cached and checked by a few timings at each load; an unwritable cache folder is a warning)."""
    if spec.max_context < 1:
        raise DFlashError(f"The context (--max-context) must be at least 1 token, got {spec.max_context}.")
    path = Path(target_path)
    drafter_file = None if drafter_path is None else Path(drafter_path)
    mtp = drafter_file is not None and drafter_file.resolve() == path.resolve()  # its own drafter: its MTP layers
    spec = plan_load(
        path, replace(spec, mtp=mtp), mtp or native_runs(drafter_file), 0 if mtp else file_bytes(drafter_file)
    )
    spec.runtime.apply()
    device = spec.runtime.device
    spec.progress("loading the target")
    with memory_guard(f"The target {path} with a {spec.max_context}-token KV cache", device):
        target = load_target(path, spec)
    drafter = None
    if drafter_path is not None:
        if not Path(drafter_path).exists():
            raise DFlashError(f"{drafter_path} does not exist.")
        spec.progress("loading the drafter")
        with memory_guard(f"The drafter {drafter_path} with a {target.max_context}-token cache", device):
            drafter = load_drafter(drafter_path, target, spec)
        drafter.check_target(target)
    policy, warnings = None, ()
    if auto_block:  # with no drafter, lookup's block policy
        costs = costs_file(path, None if drafter is None else Path(drafter_path), target, drafter, spec)
        warning = unwritable_warning(costs)
        warnings = () if warning is None else (warning,)
        policy = _block_policy(target, drafter, costs, spec)
    devices = placed_on(spec, drafter is not None)
    if path.suffix == ".gguf":
        from .gguf.tokenizer import GGUFTokenizer
        from .targets.torch_llama import TorchLlamaTarget

        # llama.cpp's vocabulary: loaded alone for the torch target, else the one loaded with the weights
        alone = isinstance(target, TorchLlamaTarget)
        tokenizer = GGUFTokenizer.load(path) if alone else GGUFTokenizer.of_context(target.context)
        return LoadedModels(target, drafter, tokenizer, target.stop_ids, policy, warnings=warnings, devices=devices)
    tokenizer = TextTokenizer.load(path)
    return LoadedModels(target, drafter, tokenizer, stop_token_ids(path), policy, warnings=warnings, devices=devices)


def placed_on(spec: LoadSpec, drafting: bool) -> dict:
    """Where a planned spec runs the target's layers and the drafter (generate --json's devices field)."""
    placement = spec.placement if spec.backend == "llamacpp" else None
    target = placement.as_json() if placement else {"device": spec.runtime.device, "backend": "torch"}
    if placement:
        target["kv_cache"] = {"k": spec.kv_cache.k, "v": spec.kv_cache.v}
    native = placement is not None and spec.runtime.drafter == "native"
    drafter = {"device": placement.name if native else spec.runtime.device, "kind": spec.runtime.drafter}
    return {"target": target, "drafter": drafter if drafting else None}


def placement_line(devices: dict) -> str:
    """Where the target's layers and the drafter run, in one line (the load report and chat's /stats)."""
    target = devices["target"]
    where = target["device"]
    if "layers_on_device" in target and target["layers_on_device"]:
        where += f" ({target['description']}), {target['layers_on_device']}/{target['layers']} layers"
        where += ", MoE experts on the CPU" if target.get("cpu_moe") else ""
    if "kv_cache" in target:
        where += f", KV cache {KVCache(**target['kv_cache']).describe()}"
    drafter = devices.get("drafter")
    return f"target on {where}" + (f"; drafter on {drafter['device']}" if drafter else "")


def device_label(devices: dict) -> str:
    """Where the models run, in a word or two (chat's status line): the target's device (`Vulkan0`, `cpu`), `+CPU`
    where some of its layers stay on the CPU, and the drafter's device where it is another."""
    target, drafter = devices["target"], devices.get("drafter")
    partial = 0 < target.get("layers_on_device", 0) < target.get("layers", 0)
    where = target["device"] + ("+CPU" if partial else "")
    if drafter and drafter["device"].lower() != target["device"].lower():
        where += f", drafter {drafter['device']}"
    return where


def _block_policy(target: Target, drafter: Drafter | None, costs: Path, spec: LoadSpec) -> BlockPolicy:
    """The pair's block policy (with no drafter, lookup's) from its cached costs, measured first where none are cached
    (or they are found off)."""

    def calibrate() -> CostTable:
        spec.progress("calibrating: timing each block size on this machine (a first load, or a cached table found off)")
        return measure_costs(target, drafter)

    block = block_limit(drafter)[0]
    return load_policy(
        costs, block, calibrate, lambda sizes: time_steps(target, drafter, sizes, CHECK_ROUNDS), drafter is not None
    )


def recalibrate(models: LoadedModels) -> BlockPolicy:
    """Measure the pair's costs per block size afresh (bench --calibrate) and keep them for later loads."""
    if models.policy is None:
        raise DFlashError("Calibration needs --block-size auto.")
    models.session.invalidate()  # the measurement runs its own forwards through both caches
    models.policy.costs = measure_costs(models.target, models.drafter)
    models.policy.save()
    return models.policy


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (text, encoded by the models' tokenizer, or token ids) and how to continue it: what every front-end
    (generate, chat, serve, bench) hands `stream`."""

    prompt: str | list[int]
    settings: Settings = Settings()


def prompt_ids_of(models: LoadedModels, prompt: str | list[int]) -> list[int]:
    """The prompt as token ids (an empty text is no ids: the decode loop says the prompt is empty)."""
    if not isinstance(prompt, str) or not prompt:
        return list(prompt)
    if models.tokenizer is None:
        raise DFlashError("The target has no tokenizer.json; pass the prompt as --prompt-ids.")
    return models.tokenizer.encode(prompt)


@dataclass
class Chunk:
    """One step of a streamed generation: the step and the running stats (reply.TextStream reads its tokens)."""

    step: Step
    stats: Stats


def block_policy(models: LoadedModels, settings: Settings, drafter: Drafter | None) -> BlockPolicy | None:
    """The policy that picks each step's source and block size: the models' one (their drafter's, or with none
    lookup's) for --block-size auto with their own drafter, else none."""
    return models.policy if settings.block_size is None and drafter is models.drafter else None


def stream(
    models: LoadedModels,
    request: GenerationRequest,
    drafter: Drafter | None = None,
    session: Session | None = None,
) -> Iterator[Chunk]:
    """Generate, one chunk per step: the one path from every front-end to the decode loop.

    With block_size None the models' policy picks each step's source and size (auto); another drafter than the
    models' drafts its own block without one. The models' session reuses the caches' longest common prefix with the
    prompt; pass a fresh Session to start from empty caches."""
    settings = request.settings
    drafter = models.drafter if drafter is None else drafter
    policy = block_policy(models, settings, drafter)
    ids = prompt_ids_of(models, request.prompt)
    stats = Stats()
    session = models.session if session is None else session
    with closing(generate(models.target, drafter, ids, settings, policy, session)) as steps:
        for step in steps:
            stats.add(step)
            yield Chunk(step, stats)


class StopGeneration(Exception):
    """Raised by an on_text callback to end the generation after the current step, keeping what it made."""


def run_request(models: LoadedModels, request: GenerationRequest, on_text: Callable[[str], None] | None = None) -> dict:
    """Generate to the end, streaming text to on_text; return ids, text and stats as a dict. The text leaves the stop
    tokens' text out (the ids keep them), so a constrained answer is exactly its JSON.

    The prompt's longest common prefix with what the models' caches hold is not prefilled again (`prefill_tokens`
    says how many were). on_text raising StopGeneration ends the generation there with finish_reason "stop" and the
    stats so far; any other exception propagates. Either way the session stays consistent."""
    ids = prompt_ids_of(models, request.prompt)
    request = GenerationRequest(ids, request.settings)
    stats = Stats()
    output_ids: list[int] = []
    reply = TextStream(models.tokenizer, models.stop_ids) if models.tokenizer and on_text else None
    try:
        with closing(stream(models, request)) as chunks:
            for chunk in chunks:
                output_ids.extend(chunk.step.token_ids)
                stats = chunk.stats
                if reply is not None and on_text is not None:
                    on_text(reply.add(chunk.step.token_ids).content)
    except StopGeneration:
        stats.finish_reason = "stop"
    except OUT_OF_MEMORY:
        context = len(ids) + len(output_ids)
        raise out_of_memory(f"A decoding step at {context} tokens of context", models.target.device.type) from None
    result = {"prompt_ids": ids, "output_ids": output_ids, **stats.to_dict()}
    if models.tokenizer:
        result["text"] = models.tokenizer.decode([t for t in output_ids if t not in models.stop_ids])
    return result


def refusal(models: LoadedModels) -> str | None:
    """Why these models cannot decode several sequences together in this version (None: they can)."""
    from .drafters.native import NativeDrafter
    from .targets.llamacpp import LlamaCppTarget

    target = models.target
    if not isinstance(target, LlamaCppTarget):
        return "only a GGUF target (llama.cpp) decodes several sequences together"
    if target.fixed_rows or target.on_gpu:
        return "several sequences decode together on the CPU only (a GPU's kernels change with the rows of a batch)"
    if target.recurrent:
        return "a recurrent or hybrid target's state is not kept per sequence yet"
    if models.drafter is not None and not isinstance(models.drafter, NativeDrafter):
        return "only llama.cpp's native DFlash drafter (or none: --no-draft, lookup) drafts for several sequences"
    return None


def share(models: LoadedModels, count: int) -> list[LoadedModels]:
    """count views of the models, one per llama.cpp sequence (0..count-1) of the context loaded for them
    (LoadSpec.sequences), meeting at one Lanes; each with its own session (a prompt cache of an even share of the
    models' budget) and its own copy of the block policy. Every cache starts empty."""
    from .lanes import Lanes
    from .prompt_cache import PromptCache
    from .targets.llamacpp import VERIFY_ROWS

    reason = refusal(models)
    if reason is not None:
        raise DFlashError(f"--parallel {count} cannot serve this model: {reason}.")
    target, drafter, cache = models.target, models.drafter, models.session.cache
    if target.context.sequences < count:
        raise ValueError(f"the target's context holds {target.context.sequences} sequences, not {count}")
    for model in (target,) if drafter is None else (target, drafter):
        model.trim(0)
        model.context.reset()  # every sequence's cells (another engine's views may have filled them)
    models.session.invalidate()
    lanes = Lanes(target.context, VERIFY_ROWS)
    views = []
    for seq in range(count):
        view = target.sequence(seq, lanes)
        session = Session(None if cache is None else PromptCache(cache.budget // count))
        policy = copy.deepcopy(models.policy)
        viewer = None if drafter is None else drafter.sequence(seq, view)
        views.append(replace(models, target=view, drafter=viewer, session=session, policy=policy))
    return views
