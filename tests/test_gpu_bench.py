"""benchmarks.gpu_bench runs end to end with tiny shapes on CPU and writes its JSON and markdown reports."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_bench as bench


def test_gpu_bench_small_on_cpu(tmp_path: Path) -> None:
    """fp32, int4 and a random Q4_K_M GGUF (written as blocks, loaded into the torch target), two drafter kinds:
    decode-1, verify-k for k = 1..32, the bandwidth share, projected speedups and the int4 linear candidates."""
    argv = ["--small", "--device", "cpu", "--targets", "fp32,int4,q4_k_m", "--drafters", "plain,int8"]
    bench.main(argv + ["--repeats", "1", "--context", "24", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["device"] == "cpu" and report["shape"]["context"] == 24 and report["bandwidth_gbps"] > 0
    targets = [(row["target"], row["drafter"]) for row in report["rows"]]
    formats = ("float32", "int4 (compute float32)", "q4_k_m (compute float32)")
    assert targets == [(t, d) for t in formats for d in ("float32", "int8")]
    for row in report["rows"]:
        assert all(row[key] > 0 for key in ("decode_1_ms", "verify_16_ms", "drafter_step_ms", "accept_ms"))
        assert set(row["verify_k_ms"]) == {str(k) for k in range(1, 33)} and 0 < row["bandwidth_share"]
        assert set(row["projected_speedup"]) == {"3", "5", "7"}
    assert report["rows"][2]["decode_bytes"] < report["rows"][0]["decode_bytes"] / 3  # int4 layers: 4.25 bits
    assert all(entry["max_error"] < 1e-5 for entry in report["linear_candidates"].values())
    table = (tmp_path / "gpu_bench.md").read_text().splitlines()
    assert table[2].startswith("| target | drafter | decode-1 ms | verify-16 ms") and len(table) == 26
