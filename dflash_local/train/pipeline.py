"""`dflash train` end to end: check inputs, self-distil the corpus into shards, train, export."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DFlashError
from ..targets.torch_llama import TorchLlamaTarget
from ..tokenizer import TextTokenizer, stop_token_ids
from ..weights import read_config
from .corpus import corpus_files, load_prompts
from .selfdistill import DistillSettings, generate_shards, load_shards
from .trainer import Sequences, TrainEvent, TrainSettings, default_layer_ids, drafter_config, train


@dataclass(frozen=True)
class TrainRequest:
    """Everything `dflash train` was asked to do."""

    target: Path
    corpus: list[Path]
    out: Path
    work: Path | None = None
    prompt_tokens: int = 64
    max_prompts: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    resume: bool = False
    device: str = "cpu"
    distill: DistillSettings = field(default_factory=DistillSettings)
    train: TrainSettings = field(default_factory=TrainSettings)

    @property
    def work_dir(self) -> Path:
        return self.work or self.out.with_name(self.out.name + ".work")


@dataclass
class DistillProgress:
    """Self-distillation progress in prompts."""

    done: int
    total: int


def check_request(request: TrainRequest) -> None:
    """Fail early, with one sentence, on inputs that cannot work."""
    if request.train.block_size < 2:
        raise DFlashError(f"The block size must be at least 2, not {request.train.block_size}.")
    if request.train.layers < 1:
        raise DFlashError("The drafter needs at least 1 layer.")
    read_config(request.target)
    if not request.corpus:
        raise DFlashError("Give at least one --corpus path.")
    if not corpus_files(request.corpus):
        raise DFlashError("The corpus paths hold no text files.")


def _mask_token(tokenizer: TextTokenizer | None, vocab_size: int, requested: int | None) -> int:
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise DFlashError(f"The mask token id {requested} is outside the vocabulary (0..{vocab_size - 1}).")
        return requested
    found = tokenizer.token_id("<|mask|>") if tokenizer else None
    return found if found is not None else vocab_size - 1


def run_training(request: TrainRequest) -> Iterator[DistillProgress | TrainEvent]:
    """Yield progress while distilling and training; the drafter ends up in request.out."""
    check_request(request)
    target = TorchLlamaTarget.load(request.target, dtype=torch.float32, device=request.device)
    cfg = target.cfg
    layer_ids = request.target_layer_ids or default_layer_ids(cfg, request.train.layers)
    bad = [i for i in layer_ids if not 0 <= i < cfg.num_layers]
    if bad:
        raise DFlashError(f"Target layer ids {layer_ids} do not fit a target with {cfg.num_layers} layers.")
    tokenizer = TextTokenizer.load(request.target)
    mask_id = _mask_token(tokenizer, cfg.vocab_size, request.mask_token_id)
    prompts = load_prompts(request.corpus, tokenizer, request.prompt_tokens, request.distill.seed)
    if request.max_prompts:
        prompts = prompts[: request.max_prompts]
    data_dir = request.work_dir / "data"
    for done, total in generate_shards(
        target.model, prompts, layer_ids, stop_token_ids(request.target), data_dir, request.distill
    ):
        yield DistillProgress(done, total)
    data = Sequences(load_shards(data_dir), request.train.heldout_fraction, request.train.seed)
    config = drafter_config(cfg, request.train.layers, request.train.block_size, layer_ids, mask_id)
    embed = target.model.model.embed_tokens.weight.detach()
    head = target.model.lm_head.weight.detach()
    yield from train(
        embed, head, data, config, request.out, request.work_dir, request.train, request.resume, request.device
    )
