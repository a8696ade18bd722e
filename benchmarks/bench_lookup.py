"""The default mode (the DFlash drafter and lookup, as the block policy picks each step) against plain decoding, side
by side per prompt: both modes run on each prompt --repeats times, in a shuffled order each time, and every output is
compared with plain decoding's. And the suffix index's cost per step at a long context.

    .venv/bin/python -m benchmarks.bench_lookup --case gemma --prompts copy        # benchmarks/copy_prompts.jsonl
    .venv/bin/python -m benchmarks.bench_lookup --case gemma --prompts heldout     # the model's held-out prompts
    .venv/bin/python -m benchmarks.bench_lookup --case tiny --prompts copy         # the bundled pair (torch)
    .venv/bin/python -m benchmarks.bench_lookup --case synthetic --prompts copy    # random llama3.2-1b, Q4_K_M
    .venv/bin/python -m benchmarks.bench_lookup --index-cost 32768

Ratios two ways, as benchmarks/bench_block.py gives them: "fastest" divides all new tokens by each mode's fastest
run per prompt (a stall of the shared machine drops out); "paired" is the median over every (prompt, repeat) of the
two modes' speeds in that repeat, seconds apart. One thread; the block policy's costs are measured on first load
and kept under DFLASH_HOME, as `dflash` keeps them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from dflash_local.decode import Settings, run
from dflash_local.drafters.suffix_index import SuffixIndex
from dflash_local.generation import LoadedModels, load_models
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.session import Session

ROOT = Path(__file__).resolve().parent.parent
COPY_PROMPTS = ROOT / "benchmarks" / "copy_prompts.jsonl"
HELDOUT = {
    "gemma": ROOT / "models" / "gemma3-270m" / "heldout_prompts.jsonl",
    "tiny": ROOT / "models" / "tiny" / "heldout_prompts.jsonl",
}


def load_case(case: str, synthetic: Path) -> LoadedModels:
    """The case's target and drafter, loaded as `dflash` loads them (one thread, the block policy on)."""
    from dflash_local.catalog import resolve

    spec = LoadSpec(RuntimeConfig(threads=1), max_context=4096)
    if case == "gemma":
        from .bench_block import GEMMA, gemma_file

        return load_models(gemma_file(), GEMMA / "drafter", spec)
    if case == "tiny":
        tiny = resolve("tiny", None, fetch=None)
        return load_models(tiny.target, tiny.drafter, spec)
    if case == "synthetic":
        from .bench_synthetic import prepare

        target, drafter = prepare("llama3.2-1b", synthetic, "cpu", 1)
        return load_models(target, drafter, spec)
    raise SystemExit(f"unknown case {case}")


def prompts_of(kind: str, case: str, models: LoadedModels, count: int | None) -> list[list[int]]:
    """The prompt set as token ids: the copy-heavy prompts, or the case's held-out ones (gemma's for synthetic)."""
    path = COPY_PROMPTS if kind == "copy" else HELDOUT.get(case, HELDOUT["gemma"])
    lines = path.read_text().splitlines()[:count]
    return [models.tokenizer.encode(json.loads(line)["prompt"]) for line in lines]


def bench(models: LoadedModels, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Both modes on every prompt, `repeats` times each in a shuffled order; ratios, shares and identity."""
    modes = {"plain": Settings(new_tokens, draft=False), "default": Settings(new_tokens)}
    order = random.Random(0)
    rounds: list[dict[str, float]] = []
    tokens = dict.fromkeys(modes, 0)
    fastest = dict.fromkeys(modes, 0.0)
    sources: dict[str, int] = {}
    identical, per_prompt = 0, []
    for ids in prompts:
        outputs: dict[str, list[list[int]]] = {mode: [] for mode in modes}
        first = len(rounds)
        for _ in range(repeats):
            rounds.append({})
            for mode in order.sample(list(modes), len(modes)):
                policy = models.policy if mode == "default" else None
                out, stats = run(models.target, models.drafter, ids, modes[mode], policy, Session())
                outputs[mode].append(out)
                rounds[-1][mode] = stats.decode_s
                if mode == "default":
                    for source, count in stats.tokens_by_source.items():
                        sources[source] = sources.get(source, 0) + count
        best = {mode: min(r[mode] for r in rounds[first:]) for mode in modes}
        for mode in modes:
            tokens[mode] += len(outputs[mode][0]) - 1
            fastest[mode] += best[mode]
        same = all(out == outputs["plain"][0] for runs in outputs.values() for out in runs)
        identical += same
        per_prompt.append({"speedup": best["plain"] / best["default"], "identical": same})
    rate = {mode: tokens[mode] / fastest[mode] for mode in modes}
    total = sum(sources.values())
    return {
        "tokens_per_s": rate,
        "fastest": rate["default"] / rate["plain"],
        "paired": statistics.median(r["plain"] / r["default"] for r in rounds),
        "per_prompt": per_prompt,
        "identical": f"{identical}/{len(prompts)}",
        "source_shares": {source: count / total for source, count in sorted(sources.items())},
        "rounds": rounds,
    }


def index_cost(context: int, steps: int = 2000) -> dict:
    """Seconds per step of the suffix index at `context` tokens: a match of 15 tokens and an extension by the tokens
    a step makes (4, more than lookup's steps make on the mean), on text that repeats with changes."""
    rng = random.Random(0)
    vocab = [rng.randrange(262144) for _ in range(2000)]
    text = []
    while len(text) < context + steps * 4:  # copies of earlier spans with random edits
        begin = rng.randrange(len(vocab) - 64)
        text += vocab[begin : begin + rng.randrange(8, 64)] + [rng.randrange(262144)]
    index = SuffixIndex()
    began = time.perf_counter()
    index.extend(text[:context])
    build_s = time.perf_counter() - began
    began = time.perf_counter()
    for step in range(steps):
        index.match(15)
        index.extend(text[context + 4 * step : context + 4 * step + 4])
    return {"context": context, "build_s": build_s, "step_s": (time.perf_counter() - began) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gemma", help="gemma, tiny or synthetic")
    parser.add_argument("--prompts", default="copy", help="copy or heldout")
    parser.add_argument("--count", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--index-cost", type=int, default=0, help="only time the suffix index at this context")
    parser.add_argument("--synthetic", type=Path, default=Path("/tmp/dflash-synthetic-1b"))
    parser.add_argument("--out", type=Path, default=Path("bench_lookup.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.index_cost:
        print(json.dumps(index_cost(args.index_cost)))
        return
    models = load_case(args.case, args.synthetic)
    prompts = prompts_of(args.prompts, args.case, models, args.count)
    report = bench(models, prompts, args.max_new_tokens, args.repeats)
    report.update(case=args.case, prompts=args.prompts, count=len(prompts), max_new_tokens=args.max_new_tokens)
    args.out.write_text(json.dumps(report))
    shown = {k: v for k, v in report.items() if k not in ("rounds", "per_prompt")}
    shown["per_prompt_speedups"] = [round(p["speedup"], 2) for p in report["per_prompt"]]
    print(json.dumps(shown))


if __name__ == "__main__":
    main()
