"""Per-step latency of the GPU path on random-weight models of real shapes; no downloads.

Llama-3.1-8B-shaped target (NF4 and bf16) and a 5-layer DFlash drafter of the published shape. Measures target
decode of 1 token, target verify of a block, the drafter step and the greedy acceptance step at a fixed context,
then projects the speedup at tau = 3, 5, 7 as tau * decode / (draft + verify + accept). Also the per-k curve:
verify of k tokens and the drafter step returning k-1 rows, for the sizes the block-size policy calibrates.

    .venv/bin/python scripts/gpu_bench.py                      # CUDA, real shapes
    .venv/bin/python scripts/gpu_bench.py --small --device cpu # tiny shapes, checks the script anywhere
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from dflash_local.kernels import kernel_mode
from torch import nn

from dflash_local.drafter import DFlashDrafter, DFlashModel, DrafterConfig, default_target_layer_ids
from dflash_local.layers import rope_inv_freq
from dflash_local.quant import install_4bit, quantize_linears
from dflash_local.runtime import pick_device
from dflash_local.step_costs import measure_steps
from dflash_local.targets.torch_llama import LlamaModel, TargetConfig, TorchLlamaTarget

TAUS = (3, 5, 7)
SWEEP = (1, 2, 3, 4, 6, 8, 12, 16)  # verify sizes of the per-k cost curve (the block-size policy's table)
DEFAULT_CACHE = 4096  # the CLI's default context


@dataclass(frozen=True)
class Shape:
    """Model sizes: the target's, then the drafter's depth and block size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    draft_layers: int
    block: int
    context: int


LLAMA_8B = Shape(4096, 14336, 32, 32, 8, 128256, 5, 16, 1024)
SMALL = Shape(128, 384, 4, 4, 2, 512, 2, 16, 64)


def target_config(shape: Shape) -> dict[str, Any]:
    """A Llama-3.1 config.json dict with the given sizes."""
    return {
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rope_theta": 500000.0,
    }


def drafter_config(shape: Shape) -> dict[str, Any]:
    """The published drafter shape: the target's layer sizes, draft_layers deep, default target_layer_ids."""
    return {
        **target_config(shape),
        "model_type": "qwen3",
        "num_hidden_layers": shape.draft_layers,
        "head_dim": shape.hidden // shape.heads,
        "block_size": shape.block,
        "num_target_layers": shape.layers,
        "dflash_config": {
            "mask_token_id": shape.vocab - 1,
            "target_layer_ids": default_target_layer_ids(shape.layers, shape.draft_layers),
        },
    }


def random_target(shape: Shape, quantize: str | None, dtype: torch.dtype, device: str) -> TorchLlamaTarget:
    """A random-weight target; with quantize, each layer's linears become NF4 one layer at a time."""
    cfg = TargetConfig.from_dict(target_config(shape), Path("<random>"))
    with torch.device("meta"):
        model = LlamaModel(cfg)
    if quantize:
        for index in range(cfg.num_layers):
            scope = f"model.layers.{index}"
            generator = torch.Generator(device=device).manual_seed(index)
            weights = {
                f"{scope}.{name}.weight": torch.empty(m.weight.shape, dtype=dtype, device=device).normal_(
                    0.0, 0.02, generator=generator
                )
                for name, m in model.get_submodule(scope).named_modules()
                if isinstance(m, nn.Linear)
            }
            install_4bit(model, weights, scope, dtype, device, "<random>")
    materialize_rest(model, dtype, device)
    model.inv_freq = rope_inv_freq(cfg.raw, cfg.head_dim).to(device)
    return TorchLlamaTarget(model.eval(), max_context=max(DEFAULT_CACHE, shape.context + 4 * shape.block))


def materialize_rest(model: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Random weights for every parameter still on the meta device (all of them for an unquantized model)."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not param.is_meta:
                    continue
                value = torch.empty(param.shape, dtype=dtype, device=device)
                if name == "weight" and module_name.endswith("norm"):
                    value.fill_(1.0)
                else:
                    value.normal_(0.0, 0.02, generator=generator)
                setattr(module, name, nn.Parameter(value, requires_grad=False))


def random_drafter(
    shape: Shape, dtype: torch.dtype, device: str, max_context: int, quantize: str | None
) -> DFlashDrafter:
    """A random-weight drafter of the published layout; quantized (int8, nf4) on the CPU, then moved."""
    config = drafter_config(shape)
    cfg = DrafterConfig.from_dict(config, Path("<random>"))
    with torch.device("meta"):
        model = DFlashModel(cfg)
    materialize_rest(model, dtype, "cpu" if quantize else device)
    model.inv_freq = rope_inv_freq(config, cfg.head_dim).to("cpu" if quantize else device)
    if quantize:
        quantize_linears(model, "layers", quantize, dtype)
        model.to(device)
    return DFlashDrafter(model.eval(), max_context)


def measure(
    shape: Shape, quantize: str | None, drafter_quantize: str | None, dtype: torch.dtype, device: str, repeats: int
) -> dict[str, Any]:
    """Per-step latencies (ms) and projected speedups for one target precision."""
    target = random_target(shape, quantize, dtype, device)
    drafter = random_drafter(shape, dtype, device, target.max_context, drafter_quantize)
    drafter.check_target(target)
    target.set_feature_layers(drafter.target_layer_ids)
    block = shape.block
    sizes = sorted({k for k in SWEEP if k <= block} | {block})
    costs = measure_steps(target, drafter, shape.vocab, shape.context, sizes, device, repeats)
    precision = str(dtype).removeprefix("torch.")
    row = {
        "target": f"{quantize} (compute {precision})" if quantize else precision,
        "drafter": drafter_quantize or precision,
        "decode_1_ms": costs["decode_1_ms"],
        f"verify_{block}_ms": costs["verify_k_ms"][str(block)],
        "drafter_step_ms": costs["drafter_rows_ms"][str(block - 1)],
        "accept_ms": costs["accept_ms"],
        "verify_k_ms": costs["verify_k_ms"],
        "drafter_rows_ms": costs["drafter_rows_ms"],
    }
    step = row[f"verify_{block}_ms"] + row["drafter_step_ms"] + row["accept_ms"]
    row["verify_over_decode"] = row[f"verify_{block}_ms"] / row["decode_1_ms"]
    row["draft_over_decode"] = row["drafter_step_ms"] / row["decode_1_ms"]
    row["projected_speedup"] = {str(tau): tau * row["decode_1_ms"] / step for tau in TAUS}
    return row


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table, one row per target precision."""
    block = report["shape"]["block"]
    head = f"| target | drafter | decode-1 ms | verify-{block} ms | drafter step ms | accept ms | " + " | ".join(
        f"speedup @ tau={tau}" for tau in TAUS
    )
    lines = [
        f"device: {report['device']}, kernels: {report['kernels']}, CUDA graphs: {report['cuda_graphs']}, "
        f"context: {report['shape']['context']} tokens",
        "",
        head + " |",
        "|---" * (6 + len(TAUS)) + "|",
    ]
    for row in report["rows"]:
        cells = [row["target"], row["drafter"], row["decode_1_ms"], row[f"verify_{block}_ms"]]
        cells += [row["drafter_step_ms"], row["accept_ms"]]
        cells += [row["projected_speedup"][str(tau)] for tau in TAUS]
        lines.append("| " + " | ".join(c if isinstance(c, str) else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs anywhere, numbers mean nothing)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--targets", default="nf4,bf16", help="comma list of nf4, bf16, fp32")
    parser.add_argument("--drafters", default="plain", help="comma list of plain (target dtype), int8, nf4")
    parser.add_argument("--context", type=int, help="tokens already in the cache (default 1024, 64 with --small)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("gpu_bench.json"))
    parser.add_argument("--markdown", type=Path, default=Path("gpu_bench.md"))
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    shape = SMALL if args.small else LLAMA_8B
    if args.context:
        shape = Shape(**{**asdict(shape), "context": args.context})
    rows = []
    for name, drafter in itertools.product(args.targets.split(","), args.drafters.split(",")):
        quantize = "nf4" if name == "nf4" else None
        dtype = torch.float32 if name == "fp32" or not device.startswith("cuda") else torch.bfloat16
        rows.append(measure(shape, quantize, None if drafter == "plain" else drafter, dtype, device, args.repeats))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "kernels": kernel_mode(),
        "cuda_graphs": device.startswith("cuda"),  # the default on CUDA
        "torch": torch.__version__,
        "shape": asdict(shape),
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.markdown.write_text(markdown(report))
    print(markdown(report), end="")
    return report


if __name__ == "__main__":
    main()
