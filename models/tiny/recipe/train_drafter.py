"""Reproduce models/tiny/drafter: self-distil the tiny target on its own training corpus, train with `dflash train`.

    .venv/bin/python -m models.tiny.recipe.train_drafter [--work /tmp/tiny_drafter_work]

The corpus is the one the target was trained on (stdlib sources minus the held-out modules, see
models/tiny/recipe/corpus.py) plus the mined chat instructions, so the held-out prompts stay unseen.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .corpus import chat_pairs, training_documents

TINY = Path(__file__).resolve().parents[1]
REPO = TINY.parents[1]


def write_corpus(path: Path, chats: int) -> None:
    """Training documents as {"text"} lines and mined instructions as {"messages"} lines."""
    with path.open("w") as handle:
        for document in training_documents():
            handle.write(json.dumps({"text": document}) + "\n")
        for instruction, _ in chat_pairs()[:chats]:
            handle.write(json.dumps({"messages": [{"role": "user", "content": instruction}]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tiny_drafter_work"))
    parser.add_argument("--out", type=Path, default=TINY / "drafter")
    parser.add_argument("--prompts", type=int, default=9000)
    parser.add_argument("--chats", type=int, default=600)
    parser.add_argument("--steps", type=int, default=11000)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus, args.chats)
    command = [
        sys.executable,
        "-m",
        "dflash_local",
        "train",
        "--target",
        str(TINY / "target"),
        "--corpus",
        str(corpus),
        "--out",
        str(args.out),
        "--work",
        str(args.work / "run"),
        "--layers",
        "2",
        "--block-size",
        "16",
        "--prompt-tokens",
        "64",
        "--max-prompts",
        str(args.prompts),
        "--new-tokens",
        "128",
        "--sampled-fraction",
        "0.2",
        "--steps",
        str(args.steps),
        "--batch-size",
        "4",
        "--anchors",
        "8",
        "--lr",
        "1e-3",
        "--eval-every",
        "250",
        "--seed",
        "0",
        "--device",
        "cpu",
    ] + (["--resume"] if args.resume else [])
    subprocess.run(command, check=True, cwd=REPO)


if __name__ == "__main__":
    main()
