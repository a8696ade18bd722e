"""What `dflash train` is asked to do, with every default stated here once: the command's options take theirs
from these classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..defaults import DRAFTER_BLOCK


@dataclass(frozen=True)
class DistillSettings:
    """How much to generate and how."""

    new_tokens: int = 192
    batch_size: int = 32
    shard_size: int = 256
    sampled_fraction: float = 0.25
    temperature: float = 0.8
    seed: int = 0
    soft_top_k: int = 0  # keep the target's k likeliest ids and their logits before each written token (0: none)


@dataclass(frozen=True)
class TrainSettings:
    """Drafter shape and optimisation settings."""

    layers: int = 2
    block_size: int = DRAFTER_BLOCK
    steps: int = 2000
    batch_size: int = 8
    anchors: int = 16
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    heldout_fraction: float = 0.03
    eval_every: int = 100
    eval_sequences: int = 32
    checkpoint_every: int = 200
    seed: int = 0
    gamma: float | None = None  # position-weight decay over block offsets (None: 7 * block_size / 16)
    soft_weight: float = 0.0  # share of the loss on the target's top-k distribution (needs soft-label shards)


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
    draft_vocab: int | None = None  # draft over the most frequent ids of the data only (None: all of them)
    threads: int | None = None
    resume: bool = False
    device: str = "cpu"  # --device: torch's for a folder target; a GGUF's llama.cpp device (runtime.plan_load)
    init: str | None = None  # "target" (its last layers) or an existing drafter's folder; None: random
    distill: DistillSettings = field(default_factory=DistillSettings)
    train: TrainSettings = field(default_factory=TrainSettings)

    @property
    def work_dir(self) -> Path:
        return self.work or self.out.with_name(self.out.name + ".work")
