"""`dflash train`: a drafter trained for a target by self-distillation, with its progress bars."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ..train.settings import DistillSettings, TrainRequest, TrainSettings
from . import values
from .app import user_errors
from .options import Device, Seed, Threads

# The options that are TrainRequest's and TrainSettings' fields under the same names (TrainSettings' give the defaults
# of theirs).
REQUEST_OPTIONS = (
    "target", "corpus", "out", "work", "prompt_tokens", "max_prompts", "mask_token_id", "draft_vocab", "threads",
    "resume", "device", "init",
)  # fmt: skip
TRAIN_OPTIONS = (
    "layers", "block_size", "steps", "batch_size", "anchors", "lr", "warmup", "eval_every", "seed", "gamma",
    "soft_weight",
)  # fmt: skip

if TYPE_CHECKING:
    from ..train.pipeline import DistillProgress
    from ..train.trainer import TrainEvent
    from ..train.warm_start import WarmStart


def train(
    target: Path = typer.Option(
        ..., "--target", help="Target the drafter will serve: a model folder (HF layout) or a .gguf file (llama.cpp)."
    ),
    corpus: list[Path] = typer.Option(..., "--corpus", help="Prompt corpus: text files, folders, JSONL chats."),
    out: Path = typer.Option(..., "--out", help="Where to write the drafter (config.json + model.safetensors)."),
    work: Optional[Path] = typer.Option(None, "--work", help="Shards and checkpoints (default: OUT.work)."),
    layers: int = typer.Option(TrainSettings.layers, "--layers", help="Drafter depth."),
    block_size: int = typer.Option(TrainSettings.block_size, "--block-size"),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="e.g. 1,3,5 (default: spread)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Default: <|mask|> or the last id."),
    prompt_tokens: int = typer.Option(
        TrainRequest.prompt_tokens, "--prompt-tokens", help="Window length of text prompts."
    ),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Use at most this many prompts."),
    new_tokens: int = typer.Option(
        DistillSettings.new_tokens, "--new-tokens", help="Tokens the target writes per prompt."
    ),
    sampled_fraction: float = typer.Option(
        DistillSettings.sampled_fraction, "--sampled-fraction", help="Share of sampled (not greedy) data."
    ),
    steps: int = typer.Option(TrainSettings.steps, "--steps"),
    batch_size: int = typer.Option(TrainSettings.batch_size, "--batch-size", help="Sequences per optimisation step."),
    anchors: int = typer.Option(TrainSettings.anchors, "--anchors", help="Blocks per sequence per step."),
    lr: float = typer.Option(TrainSettings.lr, "--lr"),
    warmup: int = typer.Option(TrainSettings.warmup, "--warmup", help="Steps of linear learning-rate warm-up."),
    eval_every: int = typer.Option(TrainSettings.eval_every, "--eval-every"),
    seed: Seed = TrainSettings.seed,
    draft_vocab: Optional[int] = typer.Option(
        None, "--draft-vocab", help="Draft over the N ids most frequent in the data only (default: all)."
    ),
    distill_batch: int = typer.Option(
        DistillSettings.batch_size, "--distill-batch", help="Prompts the target continues at once."
    ),
    threads: Threads = None,
    resume: bool = typer.Option(
        TrainRequest.resume, "--resume", help="Continue from the checkpoint in the work folder."
    ),
    device: Device = "auto",
    init: Optional[str] = typer.Option(
        None, "--init", help="Start from 'target' (its last layers) or a drafter folder (fine-tune it); default random."
    ),
    soft_top_k: int = typer.Option(
        DistillSettings.soft_top_k, "--soft-top-k", help="Keep the target's top-k logits per token (soft labels)."
    ),
    soft_weight: float = typer.Option(
        TrainSettings.soft_weight, "--soft-weight", help="Share of the loss on the soft labels (0..1)."
    ),
    gamma: Optional[float] = typer.Option(
        TrainSettings.gamma, "--gamma", help="Loss decay over block offsets (default 7*B/16)."
    ),
) -> None:
    """Train a DFlash drafter for a target by self-distillation."""
    given = locals()
    with user_errors():
        from ..train.pipeline import run_training
        from ..vulkan_probe import expose_for

        expose_for(device)  # before llama.cpp loads: which Vulkan devices it may use
        tau = render_training(run_training(_request(given)))
        typer.echo(f"drafter written to {out} (held-out tau estimate {tau})")


def _request(given: dict[str, Any]) -> TrainRequest:
    """The training request from train's arguments (its locals() on entry), --target-layer-ids parsed."""
    ids = given["target_layer_ids"]
    distill = DistillSettings(
        new_tokens=given["new_tokens"],
        batch_size=given["distill_batch"],
        sampled_fraction=given["sampled_fraction"],
        seed=given["seed"],
        soft_top_k=given["soft_top_k"],
    )
    return TrainRequest(
        **{name: given[name] for name in REQUEST_OPTIONS},
        target_layer_ids=values.parse_ids(ids, "--target-layer-ids") if ids else None,
        distill=distill,
        train=TrainSettings(**{name: given[name] for name in TRAIN_OPTIONS}),
    )


def render_training(events: Iterator[DistillProgress | WarmStart | TrainEvent]) -> str:
    """Progress bars for the self-distillation and the training, a log line per held-out estimate; returns the last
    held-out tau estimate as shown ("-" for none)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ..train.pipeline import DistillProgress
    from ..train.warm_start import WarmStart

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    tau = "-"
    with Progress(*columns, transient=False) as progress:
        distill = progress.add_task("self-distilling", total=None, info="")
        fit, where = None, None
        for event in events:
            if isinstance(event, DistillProgress):
                if where is None:
                    where = event.where
                    progress.console.log(f"self-distilling with the target on {where}")
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
    return tau
