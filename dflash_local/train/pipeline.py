"""`dflash train` end to end: check inputs, self-distil the corpus into shards, train, export.

A target folder (HF layout) runs in torch; a .gguf target runs in llama.cpp (features from its layer taps), and the
drafter borrows its embedding and head dequantized from the file, one copy in fp32."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import torch

from ..defaults import MIN_BLOCK
from ..drafters.config import DrafterConfig
from ..errors import DFlashError
from ..gguf.file import GGUFTensor, read_gguf, read_header
from ..memory_estimate import target_sizes
from ..runtime import LoadSpec, RuntimeConfig, pick_device, plan_load
from ..target_config import TargetConfig
from ..targets.torch_llama import TorchLlamaTarget
from ..tokenizer import TextTokenizer, stop_token_ids
from ..weights import read_config
from . import warm_start
from .corpus import corpus_files, load_prompts
from .selfdistill import Continuer, generate_shards, load_shards, torch_continuer
from .settings import TrainRequest
from .trainer import Sequences, TrainEvent, default_layer_ids, draft_vocabulary, drafter_config, train
from .warm_start import LayerReader, WarmStart, gguf_layer_reader, torch_layer_reader


@dataclass
class DistillProgress:
    """Self-distillation progress in prompts, and where the target runs (e.g. 'Vulkan0 (llvmpipe): 4/4 layers')."""

    done: int
    total: int
    where: str


def check_request(request: TrainRequest) -> None:
    """Fail early, with one sentence, on inputs that cannot work."""
    if request.train.block_size < MIN_BLOCK:
        raise DFlashError(f"The block size must be at least {MIN_BLOCK}, not {request.train.block_size}.")
    if request.train.layers < 1:
        raise DFlashError("The drafter needs at least 1 layer.")
    if request.target.suffix == ".gguf":
        read_gguf(request.target)
    else:
        read_config(request.target)
    if request.draft_vocab is not None and request.draft_vocab < 2:
        raise DFlashError(f"--draft-vocab must be at least 2, not {request.draft_vocab}.")
    if not request.corpus:
        raise DFlashError("Give at least one --corpus path.")
    if not corpus_files(request.corpus):
        raise DFlashError("The corpus paths hold no text files.")


def _mask_token(tokenizer: TextTokenizer | None, vocab_size: int, requested: int | None) -> int:
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise DFlashError(f"The mask token id {requested} is outside the vocabulary (0..{vocab_size - 1}).")
        return requested
    for name in ("<|mask|>", "<mask>"):
        found = tokenizer.token_id(name) if tokenizer else None
        if found is not None:
            return found
    return vocab_size - 1


def gguf_target_config(path: Path) -> TargetConfig:
    """The shape fields a drafter copies from a GGUF target's metadata."""
    fields = read_header(path).fields
    arch = str(fields["general.architecture"])

    def key(name: str, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise DFlashError(f"{path} lacks the GGUF metadata key {arch}.{name}.")
        return value

    info = read_gguf(path)
    return TargetConfig(
        model_type=arch,
        dims=target_sizes(path),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=info.context_length,
        raw={"rope_theta": float(key("rope.freq_base", 10000.0))},
    )


def gguf_drafter_fields(path: Path, cfg: TargetConfig) -> dict:
    """How a drafter must embed and cap like this GGUF target: Gemma scales embeddings by sqrt(hidden)."""
    fields = read_header(path).fields
    extra: dict = {}
    if cfg.model_type.startswith("gemma"):
        extra["input_embedding_scale"] = math.sqrt(cfg.dims.hidden)
    cap = fields.get(f"{cfg.model_type}.final_logit_softcapping")
    if cap:
        extra["final_logit_softcapping"] = float(cap)
    return extra


def dequantized(tensor: GGUFTensor, rows: int, width: int, chunk: int = 4096) -> torch.Tensor:
    """A GGUF matrix in fp32, dequantized a few thousand rows at a time (gguf-py's intermediates are several times
    the rows' size)."""
    out = torch.empty(rows, width)
    for begin in range(0, rows, chunk):
        values = gguf.quants.dequantize(tensor.read_rows(slice(begin, begin + chunk)), tensor.tensor_type)
        block = np.array(values, dtype=np.float32).reshape(-1, width)  # a copy: F32 tensors come back read-only
        out[begin : begin + len(block)] = torch.from_numpy(block)
    return out


def _gguf_matrix(tensor: GGUFTensor) -> torch.Tensor:
    """A whole GGUF tensor in fp32, in torch's shape (GGUF lists the row length first)."""
    width = tensor.shape[0]
    rows = math.prod(tensor.shape[1:])
    return dequantized(tensor, rows, width).reshape(tuple(reversed(tensor.shape)))


@dataclass
class _Prepared:
    """What distillation and training need from a target, whichever backend runs it."""

    cfg: TargetConfig
    tokenizer: object
    stop_ids: frozenset[int]
    continuer: Callable[[list[list[int]]], Continuer]  # made for the prompts it will continue
    embed: torch.Tensor
    head: torch.Tensor
    extra: dict
    layers: LayerReader  # the target's layer tensors, for a warm start
    device: str  # torch's device for the drafter's training
    where: str  # where the target runs while distilling


def _prepare_torch(request: TrainRequest, layer_ids_of: Callable[[TargetConfig], list[int]]) -> _Prepared:
    device = pick_device(request.device)
    target = TorchLlamaTarget.load(request.target, LoadSpec(RuntimeConfig(device, "float32")))
    layer_ids = layer_ids_of(target.cfg)
    stops = stop_token_ids(request.target)
    return _Prepared(
        target.cfg,
        TextTokenizer.load(request.target),
        stops,
        lambda prompts: torch_continuer(
            target.model, request.distill.new_tokens, layer_ids, stops, request.distill.soft_top_k
        ),
        target.model.model.embed_tokens.weight.detach(),
        target.model.lm_head.weight.detach(),
        {},
        torch_layer_reader(target.model),
        device,
        device,
    )


def _prepare_gguf(request: TrainRequest, layer_ids_of: Callable[[TargetConfig], list[int]]) -> _Prepared:
    from ..gguf.tokenizer import GGUFTokenizer
    from .gguf_distill import ParallelTarget, continue_prompts

    cfg = gguf_target_config(request.target)
    layer_ids = layer_ids_of(cfg)
    settings = request.distill
    threads = request.threads or torch.get_num_threads()
    # placed for the longest sequences distillation holds (a prompt of prompt_tokens and its continuation)
    context = settings.batch_size * (request.prompt_tokens + settings.new_tokens + 1)
    spec = plan_load(request.target, LoadSpec(RuntimeConfig(request.device, threads=threads), max_context=context))

    def continuer(prompts: list[list[int]]) -> Continuer:
        length = max(map(len, prompts)) + settings.new_tokens + 1
        target = ParallelTarget(request.target, settings.batch_size, length, layer_ids, spec)

        def run(batch: list[list[int]], params, generator: torch.Generator):
            return continue_prompts(
                target, batch, settings.new_tokens, params, target.info.eos_ids, generator, settings.soft_top_k
            )

        return run

    info = read_gguf(request.target)
    embed = dequantized(info.tensors["token_embd.weight"], cfg.dims.vocab, cfg.dims.hidden)
    head_tensor = info.tensors.get("output.weight")
    head = embed if head_tensor is None else dequantized(head_tensor, cfg.dims.vocab, cfg.dims.hidden)
    return _Prepared(
        cfg,
        GGUFTokenizer.load(request.target),
        info.eos_ids,
        continuer,
        embed,
        head,
        gguf_drafter_fields(request.target, cfg),
        gguf_layer_reader(info.tensors, cfg, _gguf_matrix),
        "cpu" if request.device == "cpu" or not torch.cuda.is_available() else "cuda",  # trains on CUDA if any
        spec.placement.describe() if spec.placement else "CPU",
    )


def _layer_ids_of(request: TrainRequest, cfg: TargetConfig) -> list[int]:
    layer_ids = request.target_layer_ids or default_layer_ids(cfg, request.train.layers)
    bad = [i for i in layer_ids if not 0 <= i < cfg.dims.layers]
    if bad:
        raise DFlashError(f"Target layer ids {layer_ids} do not fit a target with {cfg.dims.layers} layers.")
    return layer_ids


def prepare(request: TrainRequest) -> _Prepared:
    """Check the request and load what distillation and training need from its target."""
    check_request(request)
    prepare_backend = _prepare_gguf if request.target.suffix == ".gguf" else _prepare_torch
    return prepare_backend(request, lambda cfg: _layer_ids_of(request, cfg))


def distill(request: TrainRequest, ready: _Prepared) -> Iterator[DistillProgress]:
    """Self-distil the request's corpus into shards under its work folder (shards already there are kept)."""
    prompts = load_prompts(request.corpus, ready.tokenizer, request.prompt_tokens, request.distill.seed)
    if request.max_prompts:
        prompts = prompts[: request.max_prompts]
    for done, total in generate_shards(
        lambda: ready.continuer(prompts), prompts, request.work_dir / "data", request.distill
    ):
        yield DistillProgress(done, total, ready.where)


def _adopt_drafter_shape(request: TrainRequest, config: dict) -> TrainRequest:
    """The request with the existing drafter's depth, block size, feature layers and mask token."""
    cfg = DrafterConfig.from_dict(config, Path(str(request.init)))
    return replace(
        request,
        target_layer_ids=cfg.target_layer_ids,
        mask_token_id=cfg.mask_token_id,
        train=replace(request.train, layers=cfg.dims.layers, block_size=cfg.block_size),
    )


def run_training(request: TrainRequest) -> Iterator[DistillProgress | WarmStart | TrainEvent]:
    """Yield progress while distilling and training; the drafter ends up in request.out."""
    init_config = None
    if request.init not in (None, "target"):
        init_config = warm_start.drafter_config(Path(str(request.init)))
        request = _adopt_drafter_shape(request, init_config)
    ready = prepare(request)
    cfg = ready.cfg
    if init_config is not None:
        warm_start.check_drafter_fits(Path(str(request.init)), init_config, cfg)
    layer_ids = _layer_ids_of(request, cfg)
    mask_id = _mask_token(ready.tokenizer, cfg.dims.vocab, request.mask_token_id)
    yield from distill(request, ready)
    data = Sequences(load_shards(request.work_dir / "data"), request.train.heldout_fraction, request.train.seed)
    initial = None
    if init_config is not None:
        initial, d2t, started = warm_start.from_drafter(Path(str(request.init)), init_config)
        config = init_config
        yield started
    else:
        d2t = draft_vocabulary(data, request.draft_vocab, cfg.dims.vocab) if request.draft_vocab else None
        config = drafter_config(
            cfg, request.train.layers, request.train.block_size, layer_ids, mask_id, ready.extra, d2t
        )
        if request.init == "target":
            initial, started = warm_start.from_target(ready.layers, config)
            yield started
    yield from train(
        ready.embed,
        ready.head,
        data,
        config,
        request.out,
        request.work_dir,
        request.train,
        request.resume,
        ready.device,
        d2t,
        initial,
    )
