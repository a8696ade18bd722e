"""Benchmarks: autoregressive decoding vs the default mode (the DFlash drafter and lookup, as the block policy picks)
on the same target, side by side per prompt."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .block_policy import CostTable
from .decode import Settings, Stats, collect
from .defaults import block_limit
from .errors import DFlashError
from .generation import GenerationRequest, LoadedModels, block_policy, stream
from .session import Session
from .weights import read_jsonl


def read_prompts(path: Path, models: LoadedModels, limit: int | None = None) -> list[tuple[str, list[int]]]:
    """(label, ids) per JSONL line: {"prompt": text}, {"messages": [...]} or {"prompt_ids": [...]}."""
    if not path.is_file():
        raise DFlashError(f"Prompt file {path} does not exist.")
    prompts = []
    for number, record in read_jsonl(path):
        if "prompt_ids" in record:
            prompts.append((f"ids #{number}", [int(i) for i in record["prompt_ids"]]))
            continue
        if models.tokenizer is None:
            raise DFlashError(f"{path} holds text prompts but the model has no tokenizer.json.")
        if "messages" in record:
            label = str(record["messages"][-1].get("content", ""))
            prompts.append((label, models.tokenizer.encode_chat(record["messages"])))
        elif "prompt" in record:
            prompts.append((str(record["prompt"]), models.tokenizer.encode(record["prompt"])))
        else:
            raise DFlashError(f"{path} line {number} has none of prompt, messages, prompt_ids.")
    if not prompts:
        raise DFlashError(f"{path} holds no prompts.")
    return prompts[:limit] if limit else prompts


def acceptance_rates(stats: Stats) -> list[float]:
    """Share of steps that accepted at least j drafts, for j = 1..B-1."""
    steps = len(stats.acceptance_lengths) or 1
    return [sum(length > j for length in stats.acceptance_lengths) / steps for j in range(1, stats.block_size)]


def _summary(stats: Stats) -> dict:
    return {
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "tau": stats.tau,
        "new_tokens": stats.new_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "acceptance_histogram": stats.histogram(),
        "acceptance_rate_by_position": acceptance_rates(stats),
        "draft_time_share": stats.draft_s / stats.decode_s if stats.decode_s else 0.0,
        "block_histogram": stats.block_histogram(),
        "tokens_by_source": stats.tokens_by_source,
        "source_shares": stats.source_shares(),
    }


def run_bench(models: LoadedModels, prompts: list[tuple[str, list[int]]], settings: Settings) -> dict:
    """Per prompt: AR and the settings' drafting ("dflash": the drafter, lookup or both), one after the other; then
    means, and each source's share of the drafting mode's tokens."""
    if not settings.draft:
        raise DFlashError("The benchmark compares drafting with autoregressive decoding: drop --no-draft.")
    block = settings.block_size or block_limit(models.drafter)[0]
    methods = {
        "autoregressive": (models.drafter, replace(settings, draft=False)),
        "dflash": (models.drafter, settings),
    }
    warm_up = GenerationRequest(prompts[0][1], replace(settings, max_new_tokens=8, block_size=block))
    collect(chunk.step for chunk in stream(models, warm_up, session=Session()))
    rows = []
    for label, ids in prompts:
        outputs, row = {}, {"prompt": label[:80]}
        for name, (drafter, method_settings) in methods.items():
            request = GenerationRequest(ids, method_settings)
            chunks = stream(models, request, drafter, Session())  # empty caches for each
            outputs[name], stats = collect(chunk.step for chunk in chunks)
            row[name] = _summary(stats)
        row["identical"] = all(out == outputs["autoregressive"] for out in outputs.values())
        row["output_ids"] = outputs["autoregressive"]  # what other engines' plain decoding may be compared with
        row["speedup"] = row["dflash"]["decode_tokens_per_s"] / max(row["autoregressive"]["decode_tokens_per_s"], 1e-9)
        rows.append(row)
    mean = {
        name: {
            "decode_tokens_per_s": sum(r[name]["decode_tokens_per_s"] for r in rows) / len(rows),
            "tau": sum(r[name]["tau"] for r in rows) / len(rows),
        }
        for name in methods
    }
    mean["speedup"] = mean["dflash"]["decode_tokens_per_s"] / max(mean["autoregressive"]["decode_tokens_per_s"], 1e-9)
    by_source: dict[str, int] = {}
    for row in rows:
        for source, count in row["dflash"]["tokens_by_source"].items():
            by_source[source] = by_source.get(source, 0) + count
    histogram = {
        length: sum(r["dflash"]["acceptance_histogram"][length] for r in rows) for length in range(1, block + 1)
    }
    # steps that drafted: every step less auto's plain ones (block size 1, acceptance length 1, nothing drafted)
    drafting = sum(histogram.values()) - sum(r["dflash"]["block_histogram"].get(1, 0) for r in rows)
    by_position = [
        sum(count for length, count in histogram.items() if length > j) / max(drafting, 1) for j in range(1, block)
    ]
    return {
        "block_size": "auto" if block_policy(models, settings, models.drafter) is not None else block,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.sampling.temperature,
        "prompts": rows,
        "mean": mean,
        "dflash_acceptance_histogram": histogram,
        "dflash_acceptance_by_position": by_position,  # of drafting steps: share that accepted at least j drafts
        "all_identical": all(r["identical"] for r in rows),
        "source_shares": {source: count / max(sum(by_source.values()), 1) for source, count in by_source.items()},
    }


def plot(report: dict, path: Path) -> None:
    """Acceptance-length histogram and mean tokens/s bars in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install matplotlib.") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    histogram = report["dflash_acceptance_histogram"]
    left.bar([int(k) for k in histogram], list(histogram.values()), color="#4477aa")
    left.set(title="DFlash acceptance length per step", xlabel="accepted tokens (drafts + 1)", ylabel="steps")
    names = [name for name in report["mean"] if name != "speedup"]
    right.bar(names, [report["mean"][n]["decode_tokens_per_s"] for n in names], color=["#999999", "#4477aa", "#cc6677"])
    right.set(title=f"decode tokens/s (mean, {report['mean']['speedup']:.2f}x)", ylabel="tokens/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def calibration_report(costs: CostTable) -> dict:
    """The table behind --block-size auto: when it was measured, and per k (ms) the calibration's timings of the
    target and the drafter where it timed k (sorted), the fitted costs, the step's, and the tokens a step must make
    to beat a plain step."""
    plain = costs.step_s(1)
    sizes = [
        {
            "k": k,
            "target_samples_ms": sorted(s * 1000 for s in costs.target_samples.get(k, [])),
            "target_ms": costs.target_s[k] * 1000,
            "draft_samples_ms": sorted(s * 1000 for s in costs.draft_samples.get(k, [])),
            "draft_ms": costs.draft_s[k] * 1000 if k > 1 else 0.0,
            "step_ms": costs.step_s(k) * 1000,
            "break_even_tokens": costs.step_s(k) / plain,
        }
        for k in sorted(costs.target_s)
    ]
    return {"measured_at": costs.measured_at, "sizes": sizes}
