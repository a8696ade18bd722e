"""Per-forward costs of the bundled pair on this machine: target decode-1, verify-4/8/16, drafter step.

.venv/bin/python scripts/time_forwards.py [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.targets.torch_llama import TorchLlamaTarget

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
CONTEXT = 100


def milliseconds(fn, repeats: int = 100) -> float:
    for _ in range(5):
        fn()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    target, drafter = TorchLlamaTarget.load(TINY / "target"), DFlashDrafter.load(TINY / "drafter")
    target.set_feature_layers(drafter.target_layer_ids)
    ids = torch.randint(0, target.vocab_size - 16, (CONTEXT,))
    features = target.forward(ids).features
    known = ids.tolist() + [0]  # token at position CONTEXT, the next one to draft from
    drafter.propose(target, features[:-1], known, CONTEXT - 1, 16)

    def feed(count: int):
        def run() -> None:
            target.rollback(CONTEXT)
            target.forward(ids[:count], features=count > 1)

        return run

    def draft() -> None:
        drafter.length = CONTEXT - 1
        drafter.propose(target, features[-1:], known, CONTEXT, 16)

    print("| threads | decode-1 ms | verify-4 ms | verify-8 ms | verify-16 ms | drafter step ms |")
    print("|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        costs = [milliseconds(feed(n)) for n in (1, 4, 8, 16)] + [milliseconds(draft)]
        print(f"| {threads} | " + " | ".join(f"{c:.2f}" for c in costs) + " |")


if __name__ == "__main__":
    main()
