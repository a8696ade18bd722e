"""One prepared check of the GPU path on a CUDA machine (a few minutes): kernels against their references on
CUDA (the int4/int8 weight-only matmul too), engine output ids with Triton vs torch kernels and CUDA graphs on vs off,
NF4, int4 and a Q4_K_M GGUF lossless, then gpu_bench (results/<gpu>/).

    .venv/bin/python -m benchmarks.gpu_check [--skip-bench] [--out results/<gpu>/gpu_check.json]

Exits non-zero when a hard check fails. bf16 engine runs are reported, not required to match: on a GPU,
verifying 16 tokens and decoding 1 round differently in bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from dflash_local.kernels.accept import greedy_accept_reference
from dflash_local.kernels.accept_triton import greedy_accept_triton
from dflash_local.kernels.attention import block_attention_reference
from dflash_local.kernels.attention_triton import block_attention_triton
from dflash_local.kernels.rmsnorm import rms_norm_reference
from dflash_local.kernels.rmsnorm_triton import rms_norm_triton
from dflash_local.kernels.wq_matmul import wq_matmul_reference
from dflash_local.kernels.wq_matmul_triton import wq_matmul_triton

from dflash_local.decode import Settings, run
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.targets.torch_llama import TorchLlamaTarget

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # bf16: about two units in the last place
MASKS = ((False, None), (True, None), (False, 5))
PROMPTS = [[10, 57, 300, 41, 12, 9, 77, 8], list(range(20, 60)), [5, 6, 7]]


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| / (1 + |want|): absolute near zero, relative for large values (bf16 rounds by ulps)."""
    want = want.float()
    return ((got.float() - want).abs() / (1 + want.abs())).max().item() if got.numel() else 0.0


def check_kernels(device: str) -> dict[str, Any]:
    """Largest error of each Triton kernel against its reference, over the test shapes, fp32 and bf16."""
    gen = torch.Generator(device=device).manual_seed(0)
    errors: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")

        def randn(*shape: int, dtype=dtype) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device).to(dtype)

        worst = 0.0
        shapes = itertools.product((0, 1, 17, 300, 2000), (2, 8, 16), ((1, 64), (4, 128)))
        for (context, block, (group, dim)), (causal, window) in itertools.product(shapes, MASKS):
            q, k, v = randn(1, 8 * group, block, dim), randn(1, 8, block, dim), randn(1, 8, block, dim)
            cache_k, cache_v = randn(1, 8, context + 9, dim), randn(1, 8, context + 9, dim)
            args = (q, cache_k[:, :, :context], cache_v[:, :, :context], k, v, causal, window)
            want = block_attention_reference(*args)
            worst = max(worst, max_error(block_attention_triton(*args), want))
            length = torch.tensor([context], device=device)
            fixed = (q, cache_k, cache_v, k, v, causal, window, length)
            worst = max(worst, max_error(block_attention_triton(*fixed), want))
        errors[f"attention {name}"] = worst
        worst = 0.0
        for shape in ((1, 4096), (16, 4096), (16, 32, 128), (3, 5, 96)):
            x, residual, weight = randn(*shape), randn(*shape), 1 + 0.1 * randn(shape[-1])
            for res in (None, residual):
                got, want = rms_norm_triton(x, weight, 1e-5, res), rms_norm_reference(x, weight, 1e-5, res)
                worst = max(worst, max_error(got[0], want[0]), max_error(got[1], want[1]))
        errors[f"rmsnorm {name}"] = worst
    mismatches = 0
    for rows, vocab in ((1, 50), (16, 128256), (8, 151936)):
        logits = torch.randn(rows, vocab, generator=gen, device=device)
        choice = logits.argmax(-1)
        for cut in range(rows):
            draft = choice[:-1].clone()
            if cut < rows - 1:
                draft[cut] = (draft[cut] + 1) % vocab
            got, want = greedy_accept_triton(draft, logits), greedy_accept_reference(draft, logits)
            mismatches += got.tolist() != want.tolist()
    errors.update(check_wq_matmul(device, gen))
    within = all(error <= TOLERANCE["float32" if "float32" in key else "bfloat16"] for key, error in errors.items())
    return {"passed": within and mismatches == 0, "max_errors": errors, "greedy_accept_mismatches": mismatches}


def check_wq_matmul(device: str, gen: torch.Generator) -> dict[str, float]:
    """Largest error of the int4/int8 weight-only Triton matmul against its reference per activation dtype: the
    groups GGUF and --quantize int4 use (int4: 32, 128; int8: 16, 32), 1-32 rows, with and without a min, split-K as
    chosen (each combination is a compile: kept to 16 per dtype). Errors relative to the output's largest magnitude:
    4096-long sums in another order move a bf16 output by an ulp or two wherever they fall."""
    errors = {}
    shapes = [(4, 32), (4, 128), (8, 16), (8, 32)]
    for dtype in (torch.float32, torch.bfloat16):
        worst = 0.0
        for (bits, group), has_min, rows in itertools.product(shapes, (False, True), (1, 7, 32)):
            out, width = 1000, 4096
            if bits == 4:
                codes = torch.randint(0, 256, (out, width // 2), generator=gen, device=device, dtype=torch.uint8)
            else:
                codes = torch.randint(-128, 128, (out, width), generator=gen, device=device, dtype=torch.int8)
            scale_dtype = torch.float32 if dtype == torch.float32 else torch.float16
            scales = (torch.rand(out, width // group, generator=gen, device=device) * 1e-3).to(scale_dtype)
            mins = (torch.randn(out, width // group, generator=gen, device=device) * 1e-3).to(scale_dtype)
            mins = mins if has_min else None
            x = torch.randn(rows, width, generator=gen, device=device).to(dtype)
            want = wq_matmul_reference(x, codes, scales, mins, bits, group).float()
            got = wq_matmul_triton(x, codes, scales, mins, bits, group).float()
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        errors[f"wq_matmul {str(dtype).removeprefix('torch.')}"] = worst
    return errors


def tiny_q4_k_m() -> Path:
    """The bundled target as a Q4_K_M GGUF (llama.cpp's CPU quantizer), converted once into the temp folder."""
    from dflash_local.gguf.convert import convert

    out = Path(tempfile.gettempdir()) / "dflash-gpu-check-tiny-q4_k_m.gguf"
    return out if out.is_file() else convert(TINY / "target", out, "q4_k_m")


def generate_all(
    device: str, dtype: torch.dtype, kernels: str, graphs: bool, quantize: str | None, draft: bool, path: Path
):
    """Greedy ids and acceptance lengths of the target at path with the bundled drafter, loaded afresh in kernel mode
    `kernels`."""
    runtime = RuntimeConfig(device, str(dtype).removeprefix("torch."), kernels, graphs)
    target = TorchLlamaTarget.load(path, LoadSpec(runtime, max_context=512, quantize=quantize))
    drafter = DFlashDrafter.load(TINY / "drafter", LoadSpec(runtime, max_context=512)) if draft else None
    results = []
    for prompt in PROMPTS:
        ids, stats = run(target, drafter, prompt, Settings(max_new_tokens=64, draft=draft))
        results.append((ids, stats.acceptance_lengths))
    return results


def check_engine(
    device: str, dtype: torch.dtype, quantize: str | None = None, path: Path = TINY / "target"
) -> dict[str, Any]:
    """Same ids for every kernel/graph setting, and the same as autoregressive decoding."""
    runs = {
        f"{kernels}, graphs {'on' if graphs else 'off'}": generate_all(
            device, dtype, kernels, graphs, quantize, True, path
        )
        for kernels, graphs in itertools.product(("torch", "triton"), (False, True))
    }
    autoregressive = [ids for ids, _ in generate_all(device, dtype, "triton", True, quantize, False, path)]
    baseline = next(iter(runs.values()))
    lengths = {name: [n for _, per_prompt in result for n in per_prompt] for name, result in runs.items()}
    return {
        "same_ids_all_settings": all(result == baseline for result in runs.values()),
        "lossless": {name: [ids for ids, _ in result] == autoregressive for name, result in runs.items()},
        "tau": {name: sum(values) / len(values) for name, values in lengths.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", type=Path, help="the report (default results/<device>/gpu_check.json)")
    parser.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1) only checks the script runs")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else device
    from . import gpu_bench

    folder = Path(__file__).resolve().parent.parent / "results" / gpu_bench.device_folder(name)
    args.out = args.out or folder / "gpu_check.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": name, "torch": torch.__version__}
    sections = {
        "engine_fp32": lambda: check_engine(device, torch.float32),
        "engine_nf4_fp32_compute": lambda: check_engine(device, torch.float32, quantize="nf4"),
        "engine_int4_fp32_compute": lambda: check_engine(device, torch.float32, quantize="int4"),
        "engine_gguf_q4_k_m_fp32_compute": lambda: check_engine(device, torch.float32, path=tiny_q4_k_m()),
        "kernels": lambda: check_kernels(device),
        "engine_bf16 (informational)": lambda: check_engine(device, torch.bfloat16),
        "engine_gguf_q4_k_m_bf16 (informational)": lambda: check_engine(device, torch.bfloat16, path=tiny_q4_k_m()),
    }
    for section, check in sections.items():
        began = time.perf_counter()
        report[section] = check()
        print(f"{section} ({time.perf_counter() - began:.0f} s): {json.dumps(report[section])}", flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    hard = [
        report["kernels"]["passed"],
        report["engine_fp32"]["same_ids_all_settings"],
        all(report["engine_fp32"]["lossless"].values()),
        all(report["engine_nf4_fp32_compute"]["lossless"].values()),
        all(report["engine_int4_fp32_compute"]["lossless"].values()),
        all(report["engine_gguf_q4_k_m_fp32_compute"]["lossless"].values()),
    ]
    report["passed"] = all(hard)
    if not args.skip_bench:
        argv = ["--device", device, "--out", str(args.out.parent)] + ([] if device == "cuda" else ["--small"])
        report["bench"] = gpu_bench.main(argv)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "bench"}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
