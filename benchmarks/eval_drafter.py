"""Compare drafters on held-out prompts: tau at blocks 4, 8 and 16 with 95% bootstrap intervals over prompts, and the
acceptance at each block offset, on held-out rows and (with --train-work) on rows the drafters trained on.

    python -m benchmarks.eval_drafter --target GEMMA.gguf --prompts models/gemma3-270m/heldout_prompts.jsonl \
        --work /tmp/heldout-shards --drafter models/gemma3-270m/drafter [--drafter OTHER ...] \
        [--train-work RUN.work --train-rows 64] [--threads 1] [--json]

The held-out prompts are continued by the target once (greedy, 192 tokens) into shards under --work, reused after.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_local.errors import DFlashError
from dflash_local.train.evaluate import evaluate_folder
from dflash_local.train.pipeline import TrainRequest, distill, prepare
from dflash_local.train.selfdistill import DistillSettings, load_shards
from dflash_local.train.trainer import Sequences, TrainSettings
from dflash_local.weights import read_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="held-out prompts (JSONL) or text files")
    parser.add_argument("--work", type=Path, required=True, help="where the held-out shards are kept")
    parser.add_argument("--drafter", type=Path, action="append", required=True)
    parser.add_argument("--train-work", type=Path, help="a training run's work folder: evaluate on its rows too")
    parser.add_argument("--train-rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layer_ids = {tuple(read_config(d)["dflash_config"]["target_layer_ids"]) for d in args.drafter}
    if len(layer_ids) != 1:
        raise DFlashError("The drafters read different target layers; evaluate them separately.")
    request = TrainRequest(
        target=args.target,
        corpus=[args.prompts],
        out=args.work / "unused",
        work=args.work,
        target_layer_ids=list(next(iter(layer_ids))),
        threads=args.threads,
        distill=DistillSettings(new_tokens=args.new_tokens, sampled_fraction=0.0),
    )
    ready = prepare(request)
    for _ in distill(request, ready):
        pass
    heldout = Sequences(load_shards(args.work / "data"), 0.0, 0)
    sets = {"heldout": (heldout, list(range(len(heldout.rows))))}
    if args.train_work:  # the rows the run trained on: its split (TrainSettings' held-out fraction and seed)
        training = Sequences(load_shards(args.train_work / "data"), TrainSettings().heldout_fraction, 0)
        sets["train"] = (training, training.train[: args.train_rows])
    results = {}
    for folder in args.drafter:
        for name, (data, rows) in sets.items():
            found = evaluate_folder(folder, ready.embed, ready.head, data, rows)
            results[f"{folder} {name}"] = asdict(found)
            if not args.json:
                taus = "  ".join(
                    f"tau@{b} {t:.3f} [{found.interval[b][0]:.3f}, {found.interval[b][1]:.3f}]"
                    for b, t in found.tau.items()
                )
                offsets = " ".join(f"{a:.2f}" for a in found.acceptance[:8])
                print(f"{folder} ({name}, {found.rows} rows): {taus}  acceptance by offset: {offsets}")
    if args.json:
        json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    try:
        main()
    except DFlashError as error:
        sys.exit(f"error: {error}")
