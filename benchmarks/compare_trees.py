"""Side by side: `dflash generate` from this tree and from another checkout of the project (e.g. the tree before a
refactor), interleaved and repeated in one run; tok/s, peak RSS and output ids per decoding mode.

    git worktree add --detach /tmp/before COMMIT
    python -m benchmarks.compare_trees --before /tmp/before --target tiny --modes plain,16,auto --repeats 5

Each run is its own process (`python -m dflash_local generate --json`, PYTHONPATH set to the tree); peak RSS is the
child's own (wait4). Each tree gets its own DFLASH_HOME (under --work), calibrated by one unmeasured run first, so
auto decodes with costs that tree measured itself. The two trees alternate which goes first on every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MODES = {"plain": ["--no-draft"], "auto": ["--block-size", "auto"]}


def mode_args(mode: str) -> list[str]:
    """The generate options of a mode: plain, auto or a fixed block size."""
    return MODES.get(mode, ["--block-size", mode])


def run_once(tree: Path, home: Path, base: list[str], mode: str) -> dict:
    """One `generate --json` from tree: its report plus the child's own peak RSS in MB (wait4's ru_maxrss, KB)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "DFLASH_HOME": str(home)}
    command = [sys.executable, "-m", "dflash_local", "generate", *base, *mode_args(mode), "--json"]
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        message = err.read().strip()
    if child.returncode != 0:
        raise SystemExit(f"error: {tree} {mode} failed: {message.splitlines()[-1] if message else child.returncode}")
    return json.loads(out) | {"peak_rss_mb": usage.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="plain,16,auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/compare-trees"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    base = ["--target", args.target, "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
    base += ["--threads", str(args.threads), "--ignore-eos"] + (["--drafter", args.drafter] if args.drafter else [])
    trees = {"before": args.before.resolve(), "now": HERE}
    homes = {name: args.work / name for name in trees}
    modes = args.modes.split(",")
    for name, tree in trees.items():  # calibrate each tree's costs once, unmeasured
        run_once(tree, homes[name], base, "auto")
    runs: dict[tuple[str, str], list[dict]] = {(m, t): [] for m in modes for t in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
        for mode in modes:
            for name in order:
                runs[mode, name].append(run_once(trees[name], homes[name], base, mode))
    summary = {mode: _summary(runs[mode, "before"], runs[mode, "now"]) for mode in modes}
    print(
        f"{'mode':6} {'tok/s before':>12} {'tok/s now':>10} {'now/before':>10} {'RSS MB before':>13} "
        f"{'RSS MB now':>10} identical"
    )
    for mode, row in summary.items():
        print(
            f"{mode:6} {row['tok_s_before']:12.1f} {row['tok_s_now']:10.1f} {row['ratio']:10.3f} "
            f"{row['rss_before']:13.0f} {row['rss_now']:10.0f} {row['identical']}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"before": str(args.before), "work": str(args.work), "json": str(args.json)},
                    "summary": summary,
                },
                indent=1,
            )
        )
    return summary


def _summary(before: list[dict], now: list[dict]) -> dict:
    """Median tok/s of each tree, the median of per-repeat ratios, peak RSS medians, and whether all ids agree."""
    ratios = [n["decode_tokens_per_s"] / b["decode_tokens_per_s"] for b, n in zip(before, now, strict=True)]
    outputs = {tuple(r["output_ids"]) for r in before + now}
    return {
        "tok_s_before": statistics.median(r["decode_tokens_per_s"] for r in before),
        "tok_s_now": statistics.median(r["decode_tokens_per_s"] for r in now),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "rss_before": statistics.median(r["peak_rss_mb"] for r in before),
        "rss_now": statistics.median(r["peak_rss_mb"] for r in now),
        "identical": len(outputs) == 1,
    }


if __name__ == "__main__":
    main()
