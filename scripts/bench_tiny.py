"""Held-out benchmark of the bundled pair: `dflash generate --json` with and without drafting, per prompt.

    .venv/bin/python scripts/bench_tiny.py [--prompts 10] [--max-new-tokens 128] [--block-size 16]

Prints a markdown table (per prompt and mean) of tau, decode tokens/s both ways, speedup, and whether
the output ids were identical. Each prompt runs DFlash and the baseline back to back in this one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "models" / "tiny"


def generate(prompt: str, extra: list[str], args) -> dict:
    command = [
        sys.executable,
        "-m",
        "dflash_local",
        "generate",
        "--target",
        str(TINY / "target"),
        "--prompt",
        prompt,
        "--json",
        "--ignore-eos",
        "--max-new-tokens",
        str(args.max_new_tokens),
    ] + extra
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[: args.prompts]
    print("| prompt | tau | DFlash tok/s | AR tok/s | speedup | identical |")
    print("|---|---|---|---|---|---|")
    rows = []
    for index, line in enumerate(lines):
        prompt = json.loads(line)["prompt"]
        fast = generate(prompt, ["--drafter", str(TINY / "drafter"), "--block-size", str(args.block_size)], args)
        slow = generate(prompt, ["--no-draft"], args)
        row = (fast["tau"], fast["decode_tokens_per_s"], slow["decode_tokens_per_s"])
        rows.append(row)
        same = fast["output_ids"] == slow["output_ids"]
        name = prompt.split("(")[0].replace("def ", "")[:28]
        print(f"| {index} `{name}` | {row[0]:.2f} | {row[1]:.0f} | {row[2]:.0f} | {row[1] / row[2]:.2f}x | {same} |")
    tau, fast, slow = (sum(col) / len(rows) for col in zip(*rows, strict=True))
    print(f"| **mean** | **{tau:.2f}** | **{fast:.0f}** | **{slow:.0f}** | **{fast / slow:.2f}x** | |")


if __name__ == "__main__":
    main()
