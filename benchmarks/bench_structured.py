"""What a JSON schema costs: `dflash generate` with and without `--json-schema`, plain and drafting, interleaved and
repeated in one run; then the grammar's mask cost per token, replayed on the constrained outputs.

    python -m benchmarks.bench_structured --target tiny --blocks 16,auto --rounds 3
    python -m benchmarks.bench_structured --target gemma3-270m --blocks 16,auto --rounds 3 --max-new-tokens 64

tok/s is per decoded token (constrained outputs end when the JSON does). Each run is its own process, as a user's
is; the drafting modes reuse the costs calibrated by one unmeasured run first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .compare_trees import HERE, run_once

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
PROMPTS = [
    "A person record as JSON: ",
    "The customer, as a JSON object: ",
    "Employee data in JSON format:\n",
    "Profile (JSON): ",
]


def mask_cost_us(target: str, outputs: list[list[int]], threads: int) -> float:
    """Mean microseconds per token to compute the grammar's forbidden-ids mask along the given constrained outputs."""
    from dflash_local.cli.files import resolve
    from dflash_local.generation import load_models
    from dflash_local.grammar import compile_grammar, json_schema_grammar
    from dflash_local.runtime import LoadSpec, RuntimeConfig

    models = load_models(
        resolve(target, None, True, None).target, None, LoadSpec(RuntimeConfig(threads=threads)), auto_block=False
    )
    stops = models.stop_ids
    grammar = compile_grammar(json_schema_grammar(SCHEMA), models.tokenizer, models.target.vocab_size, stops)
    spent, tokens = 0.0, 0
    for ids in outputs:
        matcher = grammar.matcher()
        for token in ids:
            if token in stops:
                break
            began = time.perf_counter()
            matcher.forbidden("cpu")
            spent += time.perf_counter() - began
            matcher.consume(token)
            tokens += 1
    return 1e6 * spent / max(tokens, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter")
    parser.add_argument("--blocks", default="16,auto", help="drafting modes beside plain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-structured"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    schema_file = args.work / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    common = ["--target", args.target, "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    common += ["--drafter", args.drafter] if args.drafter else []
    home = args.work / "home"
    modes = ["plain", *args.blocks.split(",")]
    if "auto" in modes:
        run_once(HERE, home, [*common, "--prompt", PROMPTS[0]], "auto")  # calibrate, unmeasured
    runs: dict[tuple[str, bool], list[dict]] = {(m, s): [] for m in modes for s in (False, True)}
    for round_ in range(args.rounds):
        for prompt in PROMPTS:
            for mode in modes:
                for constrained in (False, True) if round_ % 2 == 0 else (True, False):
                    extra = ["--json-schema", str(schema_file)] if constrained else []
                    runs[mode, constrained].append(run_once(HERE, home, [*common, "--prompt", prompt, *extra], mode))
    summary = {mode: _row(runs[mode, False], runs[mode, True]) for mode in modes}
    outputs = [r["output_ids"] for r in runs["plain", True]]
    summary["mask_us_per_token"] = mask_cost_us(args.target, outputs, args.threads)
    _print(summary, modes)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}))
    return summary


def _row(free: list[dict], constrained: list[dict]) -> dict:
    """Median tok/s without and with the schema, the median of paired ratios, mean tau, and how many constrained
    outputs that ended (not cut by --max-new-tokens) parse as JSON."""
    ratios = [c["decode_tokens_per_s"] / f["decode_tokens_per_s"] for f, c in zip(free, constrained, strict=True)]
    ended = [r for r in constrained if r.get("finish_reason") != "length"]
    valid = sum(_parses(r["text"]) for r in ended)
    return {
        "tok_s": statistics.median(r["decode_tokens_per_s"] for r in free),
        "tok_s_schema": statistics.median(r["decode_tokens_per_s"] for r in constrained),
        "ratio": statistics.median(ratios),
        "tau": statistics.mean(r.get("tau", 1.0) for r in free),
        "tau_schema": statistics.mean(r.get("tau", 1.0) for r in constrained),
        "valid_json": f"{valid}/{len(ended)} ({len(constrained) - len(ended)} cut)",
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _print(summary: dict, modes: list[str]) -> None:
    print(f"{'mode':6} {'tok/s':>7} {'+schema':>8} {'ratio':>6} {'tau':>5} {'+schema':>8} valid")
    for mode in modes:
        row = summary[mode]
        print(
            f"{mode:6} {row['tok_s']:7.1f} {row['tok_s_schema']:8.1f} {row['ratio']:6.2f} {row['tau']:5.2f} "
            f"{row['tau_schema']:8.2f} {row['valid_json']}"
        )
    print(f"mask cost: {summary['mask_us_per_token']:.0f} us per token")


if __name__ == "__main__":
    main()
