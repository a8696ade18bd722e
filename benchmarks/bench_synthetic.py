"""Speed-of-light sheet at real shapes, no downloads: a random-weight pair of a real shape (benchmarks.synthetic),
its load time, peak RSS (and VRAM on CUDA), per-step costs and the speedup they give at acceptance profiles.

    .venv/bin/python -m benchmarks.bench_synthetic llama3.2-1b                # CPU: Q4_K_M GGUF, no/native/torch
    .venv/bin/python -m benchmarks.bench_synthetic llama3.1-8b --device cuda  # CUDA: bf16 torch target and drafter

The pair is written once under --dir (default $DFLASH_HOME/synthetic/NAME), the GGUF through `dflash convert`.
Each configuration runs in its own process, so its peak RSS is its own. Per configuration: load time (the target
alone for `none`, the pair otherwise; a second load: the files are in the page cache), target decode-1 and
verify-k for k = 2..B, the drafter step returning k-1 rows, greedy acceptance, the memory estimate
(dflash_local/memory_estimate.py) beside the measured peak, and the issue #11 memory and load-time targets.
Writes bench_synthetic.json and bench_synthetic.md.

Acceptance profiles: ASSUMED, not the paper's per-position numbers (it reports mean acceptance length per benchmark):
each draft position is accepted at the same rate r given the ones before it (so at least j drafts in a share r^j
of the steps), with r set so that
the mean acceptance length at block 16 is 6.5 (math), 5.5 (code) and 3.5 (chat), about the paper's Qwen3-8B
figures at temperature 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_local.defaults import DEFAULT_CONTEXT
from dflash_local.memory_estimate import estimate_files

from .step_costs import measure_steps, projected_speedup

PROFILE_TAUS = {"math": 6.5, "code": 5.5, "chat": 3.5}  # ASSUMED mean acceptance length at block 16 (see above)


def geometric_rates(tau: float, block: int = 16) -> list[float]:
    """The conditional rate r at each of the block-1 draft positions, with 1 + sum of r^j (j = 1..block-1) = tau
    (bisection on r)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        r = (low + high) / 2
        low, high = (r, high) if 1 + sum(r**j for j in range(1, block)) < tau else (low, r)
    return [low] * (block - 1)


def prepare(name: str, folder: Path, device: str, threads: int) -> tuple[Path, Path]:
    """The pair's target (a Q4_K_M GGUF on CPU, the HF folder on CUDA) and drafter folder, written if missing."""
    from .synthetic import write_pair

    if not (folder / "drafter" / "config.json").is_file():
        write_pair(name, folder)
    if device.startswith("cuda"):
        return folder / "target", folder / "drafter"
    gguf = folder / "target-q4_k_m.gguf"
    if not gguf.is_file():
        from dflash_local.gguf.convert import convert

        convert(folder / "target", gguf, "q4_k_m", threads)
    return gguf, folder / "drafter"


def child(target: Path, drafter: Path | None, kind: str, args) -> dict:
    """One configuration in this process: load, measure the steps, report memory."""
    from dflash_local.generation import load_models
    from dflash_local.runtime import LoadSpec, RuntimeConfig

    row: dict = {"drafter": kind}
    if drafter is not None:
        began = time.perf_counter()
        buffer = bytearray(1 << 24)  # read in 16 MB pieces: the file's bytes must not count in the peak RSS
        for path in sorted(drafter.glob("*.safetensors")):
            with path.open("rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
        row["drafter_read_s"] = time.perf_counter() - began
    runtime = RuntimeConfig(device=args.device, drafter="auto" if drafter is None else kind, threads=args.threads)
    began = time.perf_counter()
    models = load_models(target, drafter, LoadSpec(runtime, max_context=args.max_context), auto_block=False)
    row["load_s"] = time.perf_counter() - began
    target_, drafter_ = models.target, models.drafter
    device = str(target_.device)
    if drafter_ is not None:
        target_.set_feature_layers(drafter_.target_layer_ids)
        ks = [int(k) for k in args.sizes.split(",")] if args.sizes else range(2, drafter_.block_size + 1)
        sizes = sorted({1, drafter_.block_size, *(k for k in ks if 2 <= k <= drafter_.block_size)})
        row |= measure_steps(target_, drafter_, target_.vocab_size, args.context, sizes, device, args.repeats)
        row["block_size"] = drafter_.block_size
    else:
        began = time.perf_counter()
        ids = torch.randint(0, target_.vocab_size - 1, (args.context + 1,), generator=torch.Generator().manual_seed(0))
        target_.forward(ids[: args.context].to(device), features=False)
        row["prefill_ms"] = (time.perf_counter() - began) * 1000
    row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    if device.startswith("cuda"):
        row["peak_vram_gb"] = torch.cuda.max_memory_allocated() / 1e9
    layer = drafter_.model.layers[0].mlp.up_proj if kind == "torch" else None  # fp16-packed on the CPU (Fp16Linear)
    fp32_layers = isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.float32
    estimate = estimate_files(target, drafter, args.max_context, 4 if fp32_layers else 2, kind)
    row["estimate_gb"] = estimate.total_gb
    row["estimate_parts_gb"] = {part: b / 1e9 for part, b in estimate.parts.items()}
    return row


def targets_met(row: dict, target: Path, drafter: Path | None, alone_s: float) -> dict:
    """Issue #11's memory and load-time targets for one configuration (GB, seconds)."""
    parts = row["estimate_parts_gb"]
    kv = parts["KV cache"] + parts.get("drafter KV cache", 0.0)
    budget = target.stat().st_size / 1e9 + kv + (0.5 if drafter is None else 1.0)
    if drafter is not None:
        stored = sum(p.stat().st_size for p in drafter.glob("*.safetensors")) / 1e9
        budget += stored * (2 if row["drafter"] == "torch" and not torch.cuda.is_available() else 1)
        budget += parts.get("output head for the drafter", 0.0)  # the torch drafter's one copy, in its compute dtype
    out = {"rss_budget_gb": budget, "rss_ok": row["peak_rss_gb"] <= budget}
    if drafter is not None:
        limit = 1.5 * (alone_s + row["drafter_read_s"])
        out |= {"load_limit_s": limit, "load_ok": row["load_s"] <= limit}
    return out


def markdown(report: dict) -> str:
    """Memory and load rows, then per-k costs, then projected speedups per profile."""
    rows = report["rows"]
    lines = [
        f"{report['name']} on {report['device']}, {report['threads']} threads, {report['context']}-token context, "
        f"{report['max_context']}-token KV cache; profiles ASSUMED (geometric, tau at block 16: "
        + ", ".join(f"{k} {v}" for k, v in PROFILE_TAUS.items())
        + ")",
        "",
        "| drafter | load s | peak RSS GB | estimate GB | RSS target GB | RSS ok | load ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        load_ok = str(row["targets"].get("load_ok", "-"))
        lines.append(
            f"| {row['drafter']} | {row['load_s']:.2f} | {row['peak_rss_gb']:.2f} | "
            f"{row['estimate_gb']:.2f} | {row['targets']['rss_budget_gb']:.2f} | {row['targets']['rss_ok']} | "
            f"{load_ok} |"
        )
    drafted = [row for row in rows if "verify_k_ms" in row]
    if drafted:
        lines += [
            "",
            "| k | verify-k ms | " + " | ".join(f"{r['drafter']} drafter k-1 rows ms" for r in drafted) + " |",
        ]
        lines.append("|---" * (2 + len(drafted)) + "|")
        lines.append(f"| 1 (decode) | {drafted[0]['decode_1_ms']:.1f} |" + " - |" * len(drafted))
        for k in sorted(int(k) for k in drafted[0]["verify_k_ms"] if k != "1"):
            cells = " | ".join(f"{r['drafter_rows_ms'][str(k - 1)]:.1f}" for r in drafted)
            lines.append(f"| {k} | {drafted[0]['verify_k_ms'][str(k)]:.1f} | {cells} |")
        lines += ["", "| drafter | accept ms | " + " | ".join(f"{p}: best k, speedup" for p in PROFILE_TAUS) + " |"]
        lines.append("|---" * (2 + len(PROFILE_TAUS)) + "|")
        for row in drafted:
            cells = [f"k={row['speedup'][p]['best_k']}, {row['speedup'][p]['best']:.2f}x" for p in PROFILE_TAUS]
            lines.append(f"| {row['drafter']} | {row['accept_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a shape of dflash_local/shapes.py: llama3.2-1b, llama3.1-8b, qwen3-8b, ...")
    parser.add_argument("--dir", type=Path, help="where the pair lives (default: $DFLASH_HOME/synthetic/NAME)")
    parser.add_argument("--device", default="cpu", help="cpu (GGUF target) or cuda (torch target)")
    parser.add_argument("--drafters", help="comma list of none, native, torch (default: none,native,torch on CPU)")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache while steps are timed")
    parser.add_argument("--max-context", type=int, default=DEFAULT_CONTEXT, help="KV cache length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", help="comma list of k to time (default 2..B; B is always timed)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=Path("bench_synthetic.json"))
    parser.add_argument("--markdown", type=Path, default=Path("bench_synthetic.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.dir is None:
        from dflash_local.paths import state_dir

        args.dir = state_dir() / "synthetic" / args.name
    folder = args.dir
    target, drafter = prepare(args.name, folder, args.device, args.threads)
    if args.child:
        row = child(target, None if args.child == "none" else drafter, args.child, args)
        print(json.dumps(row))
        return row
    kinds = (args.drafters or ("none,native,torch" if args.device == "cpu" else "none,torch")).split(",")
    rows = []
    for kind in kinds:
        given = argv if argv is not None else sys.argv[1:]
        command = [sys.executable, "-m", "benchmarks.bench_synthetic", *given, "--child", kind]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise SystemExit(f"configuration {kind} failed:\n{done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    alone = next((row["load_s"] for row in rows if row["drafter"] == "none"), float("nan"))
    for row in rows:
        row["targets"] = targets_met(row, target, None if row["drafter"] == "none" else drafter, alone)
        if "verify_k_ms" in row:
            row["speedup"] = {}
            for profile, tau in PROFILE_TAUS.items():
                rates = geometric_rates(tau)
                measured = sorted(int(k) for k in row["verify_k_ms"] if k != "1")
                by_k = {k: projected_speedup(row, rates, k) for k in measured}
                best = max(by_k, key=by_k.get)
                row["speedup"][profile] = {"best_k": best, "best": by_k[best], "by_k": by_k}
    report = {
        "name": args.name,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": args.threads,
        "context": args.context,
        "max_context": args.max_context,
        "profile_taus_assumed": PROFILE_TAUS,
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.markdown.write_text(markdown(report))
    print(markdown(report), end="")
    return report


if __name__ == "__main__":
    main()
