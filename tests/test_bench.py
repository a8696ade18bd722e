"""`dflash bench tiny --json`: the report's fields, and identical outputs checked rather than assumed."""

from __future__ import annotations

import json

from in_process import invoke


def test_bench_json_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    # a fixed block: auto's choices follow the machine's speed, and a busy one may give it no drafting step at all
    args = ("--limit", "2", "--max-new-tokens", "24", "--block-size", "16", "--json", "--plot", plot)
    result = invoke("bench", "tiny", *args)
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["block_size"] == 16 and len(report["prompts"]) == 2
    for row in report["prompts"]:
        for method in ("autoregressive", "dflash"):
            assert row[method]["new_tokens"] == 24
            assert row[method]["decode_tokens_per_s"] > 0
        assert len(row["dflash"]["acceptance_rate_by_position"]) == 15
        assert sum(row["dflash"]["acceptance_histogram"].values()) > 0
        steps = sum(row["dflash"]["acceptance_histogram"].values())
        assert sum(row["dflash"]["block_histogram"].values()) == steps  # a block size k for every step
        assert all(1 <= int(k) <= 16 for k in row["dflash"]["block_histogram"])
        assert row["identical"] is True
    assert report["all_identical"] is True
    histograms = [row["dflash"]["acceptance_histogram"] for row in report["prompts"]]
    plain = sum(row["dflash"]["block_histogram"].get("1", 0) for row in report["prompts"])  # the last, 1 token left
    drafting = sum(sum(h.values()) for h in histograms) - plain
    accepted_one = sum(count for h in histograms for length, count in h.items() if int(length) > 1)
    by_position = report["dflash_acceptance_by_position"]
    assert len(by_position) == 15 and by_position == sorted(by_position, reverse=True)
    assert by_position[0] == accepted_one / drafting
    assert set(report["mean"]) == {"autoregressive", "dflash", "speedup"}
    shares = report["source_shares"]  # the drafting mode's tokens by source: the target's and the drafters'
    assert set(shares) <= {"target", "dflash", "lookup"} and abs(sum(shares.values()) - 1) < 1e-9, shares
    assert shares.get("dflash", 0) > 0, shares
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_detects_differing_outputs(monkeypatch):
    from dataclasses import replace

    import dflash_local.bench as bench
    import dflash_local.generation as generation
    from dflash_local.catalog import resolve
    from dflash_local.decode import Settings
    from dflash_local.generation import load_models
    from dflash_local.runtime import LoadSpec, RuntimeConfig

    real_generate = generation.generate

    def corrupting_generate(target, drafter, ids, settings, policy=None, session=None):
        steps = list(real_generate(target, drafter, ids, settings, policy, session))
        if settings.draft:
            last = steps[-1]
            steps[-1] = replace(last, token_ids=last.token_ids[:-1] + [last.token_ids[-1] + 1])
        yield from steps

    monkeypatch.setattr(generation, "generate", corrupting_generate)
    tiny = resolve("tiny", None, fetch=None)
    models = load_models(tiny.target, tiny.drafter, LoadSpec(RuntimeConfig(device="cpu")))
    report = bench.run_bench(models, bench.read_prompts(tiny.prompts, models, 1), Settings(max_new_tokens=8))
    assert report["all_identical"] is False
