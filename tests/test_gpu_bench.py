"""scripts/gpu_bench.py runs end to end with tiny shapes on CPU and writes its JSON and markdown reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_bench.py"


def test_gpu_bench_small_on_cpu(tmp_path: Path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_bench", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["--small", "--device", "cpu", "--targets", "nf4,fp32", "--drafters", "plain,int8", "--repeats", "1"]
    argv += ["--context", "24"]
    bench.main(argv + ["--json", str(out_json), "--markdown", str(out_md)])
    report = json.loads(out_json.read_text())
    assert report["device"] == "cpu" and report["shape"]["context"] == 24
    targets = [(row["target"], row["drafter"]) for row in report["rows"]]
    assert targets == [(t, d) for t in ("nf4 (compute float32)", "float32") for d in ("float32", "int8")]
    for row in report["rows"]:
        assert all(row[key] > 0 for key in ("decode_1_ms", "verify_16_ms", "drafter_step_ms", "accept_ms"))
        assert set(row["projected_speedup"]) == {"3", "5", "7"}
    table = out_md.read_text().splitlines()
    assert table[2].startswith("| target | drafter | decode-1 ms | verify-16 ms") and len(table) == 8
