"""--block-size auto on the bundled torch pair after a bad calibration, side by side with block 16 or a clean one.

    .venv/bin/python scripts/bench_calibration.py poisoned --table issue     # the issue's table (inconsistent)
    .venv/bin/python scripts/bench_calibration.py poisoned --table linear    # verify-k = k plain steps (consistent)
    .venv/bin/python scripts/bench_calibration.py poisoned --table linear --unchecked   # no timings at load
    .venv/bin/python scripts/bench_calibration.py contended                  # first load beside a CPU hog
    .venv/bin/python scripts/bench_calibration.py simulate                   # scripted machines, no models

poisoned: the pair's cached table (in a temporary DFLASH_HOME) is overwritten with a poisoned one, the pair loaded
as `dflash generate` loads it, then auto and block 16 generate 128 tokens on each held-out prompt, alternating, in a
random order each round; the first auto generation's block sizes, and each later round's auto / block 16 speed.
contended: a first load (calibration) with --hogs busy processes on the cores, a second home calibrated quietly;
then both loaded again (a later run) and auto from each alternating: contended-first / clean speed per round.
simulate: the policy alone on scripted machines (verifying cheap or dear; a quiet, a wrong or a drifted table; a
share of the steps stalled 1-40x), 3000 steps, the last 2000 scored against the best speed there is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_local.block_policy import (  # noqa: E402
    HISTORY_DECAY,
    AcceptanceEstimate,
    BlockPolicy,
    CostTable,
    expected_tokens,
    load_policy,
)
from dflash_local.decode import Settings  # noqa: E402
from dflash_local.generation import GenerationRequest, LoadedModels, load_models, run_request  # noqa: E402
from dflash_local.tokenizer import TextTokenizer  # noqa: E402

TINY = ROOT / "models" / "tiny"
HOG = "import time\nend = time.time() + 600\nwhile time.time() < end: sum(i * i for i in range(10000))"


def prompts(count: int) -> list[list[int]]:
    tokenizer = TextTokenizer.load(TINY / "target")
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[:count]
    return [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]


def load(home: Path, unchecked: bool = False) -> LoadedModels:
    """The pair as `dflash generate` loads it, its cost table under `home`; unchecked: no timings at load."""
    os.environ["DFLASH_HOME"] = str(home)
    if not unchecked:
        return load_models(TINY / "target", TINY / "drafter")
    from dflash_local import generation

    plain = generation.load_policy
    generation.load_policy = lambda path, block, calibrate, check: plain(path, block, calibrate)
    try:
        return load_models(TINY / "target", TINY / "drafter")
    finally:
        generation.load_policy = plain


def poison(policy: BlockPolicy, table: str) -> None:
    """Overwrite the pair's cached costs: `issue` as found in the issue (verify-2 13x decode-1, verify-8 31x), or
    `linear` (verify-k k decode-1s: consistent in itself)."""
    plain = policy.costs.target_s[1]
    if table == "issue":
        target = {k: plain * (1 if k == 1 else 13 + 3 * (k - 2)) for k in policy.costs.target_s}
    else:
        target = {k: plain * k for k in policy.costs.target_s}
    policy.costs = CostTable(target, dict(policy.costs.draft_s))
    policy.save()


def shape(costs: CostTable) -> dict:
    """Each step's cost over a plain step's, at a few sizes."""
    return {k: round(costs.step_s(k) / costs.step_s(1), 2) for k in (2, 4, 8, 16)}


def generate(models: LoadedModels, ids: list[int], block: int | None, tokens: int) -> dict:
    request = GenerationRequest(ids, Settings(tokens, block_size=block))
    return run_request(models, request)


def poisoned(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="dflash-poisoned-"))
    poison(load(home).policy, args.table)
    models = load(home, args.unchecked)
    at_load = shape(models.policy.costs)
    texts = prompts(args.prompts)
    order = random.Random(0)
    first = generate(models, texts[0], None, args.max_new_tokens)
    rounds, used = [], {}
    for _ in range(args.rounds):
        for ids in texts:
            speeds = {}
            for mode in order.sample(["auto", "block 16"], 2):
                result = generate(models, ids, None if mode == "auto" else 16, args.max_new_tokens)
                speeds[mode] = result["decode_tokens_per_s"]
                if mode == "auto":
                    for k, count in result["block_histogram"].items():
                        used[k] = used.get(k, 0) + count
            rounds.append(speeds["auto"] / speeds["block 16"])
    return {
        "case": f"poisoned {args.table}" + (" unchecked" if args.unchecked else ""),
        "at_load": models.policy.costs.check or "kept",
        "table_after_load_step_over_plain": at_load,
        "table_at_end_step_over_plain": shape(models.policy.costs),
        "later_auto_block_histogram": dict(sorted(used.items())),
        "first_auto_block_histogram": first["block_histogram"],
        "first_auto_first_drafting_step": next((i for i, k in enumerate(first["block_sizes"]) if k > 1), None),
        "auto_vs_block16_median": statistics.median(rounds),
        "auto_vs_block16_quartiles": statistics.quantiles(rounds, n=4),
        "generations_per_mode": len(rounds),
    }


def contended(args) -> dict:
    busy, clean = (Path(tempfile.mkdtemp(prefix=f"dflash-{name}-")) for name in ("busy", "clean"))
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    try:
        busy_table = load(busy).policy.costs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    clean_table = load(clean).policy.costs
    later = {"contended first": load(busy), "clean": load(clean)}  # a later run: each loads (and checks) its table
    texts = prompts(args.prompts)
    order = random.Random(0)
    rounds = []
    for _ in range(args.rounds):
        for ids in texts:
            speeds = {}
            for name in order.sample(list(later), 2):
                speeds[name] = generate(later[name], ids, None, args.max_new_tokens)["decode_tokens_per_s"]
            rounds.append(speeds["contended first"] / speeds["clean"])

    return {
        "case": f"first load beside {args.hogs} busy processes",
        "busy_table_step_over_plain": shape(busy_table),
        "busy_table_rounds": len(busy_table.target_samples[1]),
        "clean_table_step_over_plain": shape(clean_table),
        "later_load_of_busy_table": later["contended first"].policy.costs.check or "kept",
        "busy_table_after_later_load_step_over_plain": shape(later["contended first"].policy.costs),
        "contended_vs_clean_median": statistics.median(rounds),
        "contended_vs_clean_quartiles": statistics.quantiles(rounds, n=4),
        "generations_per_mode": len(rounds),
    }


MACHINES = {  # target forward of k tokens, drafter step (s)
    "cheap": (lambda k: 0.010 + 0.0003 * (k - 1), 0.0025),  # the bundled pair's shape
    "dear": (lambda k: 0.010 + 0.006 * (k - 1), 0.015),  # a big model on a CPU
}


def simulated_share(machine: str, table: str, stalled: float, rate: float = 0.8, block: int = 16) -> float:
    """The policy on a scripted machine from a `table` (quiet, wrong: verify-k = k plain steps, loaded unchecked;
    drifted: calibrated at twice the plain cost), a share `stalled` of the steps 1-40x slower: the mean speed of the
    sizes it chose over steps 1000-3000, over the best speed there is."""
    target, draft = MACHINES[machine]
    history = AcceptanceEstimate([1000.0] * (block - 1), [1000.0 * rate] * (block - 1), HISTORY_DECAY)
    sizes = range(1, block + 1)
    if table == "wrong":
        path = Path(tempfile.mkdtemp()) / "costs.json"
        wrong = CostTable({k: target(1) * k for k in sizes}, dict.fromkeys(sizes[1:], draft))
        BlockPolicy(block, wrong, history, path).save()
        policy = load_policy(path, block, lambda: wrong)
    else:
        scale = 2.0 if table == "drifted" else 1.0
        costs = CostTable(
            {k: scale * (target(1) * k if scale > 1 else target(k)) for k in sizes},
            dict.fromkeys(sizes[1:], scale * draft),
        )
        policy = BlockPolicy(block, costs, history)
    tokens = expected_tokens([rate] * (block - 1), block)
    speed = {k: tokens[k] / (target(k) + (draft if k > 1 else 0.0)) for k in sizes}
    chance, chosen = random.Random(0), []
    for _ in range(3000):
        k = policy.choose(10_000)
        accepted = next((i for i in range(k - 1) if chance.random() >= rate), k - 1)
        stall = chance.uniform(1, 40) if chance.random() < stalled else 1.0
        policy.observe(k, accepted, stall * draft if k > 1 else 0.0, stall * target(k))
        chosen.append(k)
    return sum(speed[k] for k in chosen[1000:]) / 2000 / max(speed.values())


def simulate(args) -> dict:
    return {
        f"{machine} {table} stalled {stalled}": round(simulated_share(machine, table, stalled), 3)
        for machine in MACHINES
        for table in ("quiet", "wrong", "drifted")
        for stalled in (0.0, 0.05, 0.2, 0.5, 0.8)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["poisoned", "contended", "simulate"])
    parser.add_argument("--table", choices=["issue", "linear"], default="issue")
    parser.add_argument("--unchecked", action="store_true", help="load the poisoned table without timings at load")
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    print(json.dumps({"poisoned": poisoned, "contended": contended, "simulate": simulate}[args.case](args)))


if __name__ == "__main__":
    main()
