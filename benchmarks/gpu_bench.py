"""Per-step latency of the GPU path on random-weight models of real shapes; no downloads.

A Llama-3.1-8B-shaped target per weight format (bf16, NF4 through bitsandbytes, int4 groups through kernels.wq_matmul,
a Q4_K_M GGUF written as random quantized blocks and loaded into the torch target) and a 5-layer DFlash drafter of the
published shape. Measures target decode of 1 token and verify of k = 2..32 tokens, the drafter step and the greedy
acceptance step at a fixed context; the share of the memory-bandwidth bound each decode reaches (bytes it must read
over the measured copy bandwidth); the speedup projected at tau = 3, 5, 7 as tau * decode / (draft + verify + accept).
Also each int4 linear candidate (the Triton kernel, torch's _weight_int4pack_mm, a dense bf16 matmul) for 1..32 rows.

    .venv/bin/python -m benchmarks.gpu_bench                      # CUDA, real shapes -> results/<gpu>/
    .venv/bin/python -m benchmarks.gpu_bench --small --device cpu # tiny shapes, checks the script anywhere
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from dflash_local.kernels import dequantize, use_triton, wq_matmul
from torch import nn
from torch.nn import functional as F

from dflash_local.block_policy import median_ms
from dflash_local.dimensions import Dimensions
from dflash_local.drafters.config import DrafterConfig, default_target_layer_ids
from dflash_local.drafters.torch_drafter import DFlashDrafter, DFlashModel
from dflash_local.layers import rope_inv_freq
from dflash_local.quant import group_scale_dtype, install_4bit, install_int4, quantize_int4, quantize_linears
from dflash_local.runtime import LoadSpec, RuntimeConfig, pick_device
from dflash_local.shapes import SHAPES
from dflash_local.targets.torch_llama import LlamaModel, TargetConfig, TorchLlamaTarget

from .step_costs import measure_steps

TAUS = (3, 5, 7)
VERIFY_SIZES = tuple(range(1, 33))  # verify-k for k = 1..32
SHOWN_SIZES = (2, 4, 8, 16, 24, 32)  # the markdown's verify-k / decode-1 columns (the JSON has every k)
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32)
DEFAULT_CACHE = 4096  # the CLI's default context
FORMATS = ("bf16", "fp32", "nf4", "int4", "q4_k_m")
Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """The target's dimensions, the drafter's depth and block size, and the context cached before the steps."""

    dims: Dimensions
    draft_layers: int
    block: int
    context: int


LLAMA_8B = Shape(SHAPES["llama3.1-8b"].dims, 5, 16, 1024)
SMALL = Shape(Dimensions(256, 512, 4, 4, 2, 64, 512, False), 2, 16, 64)  # widths of whole K-quant super-blocks (256)


def target_config(shape: Shape) -> dict[str, Any]:
    """A Llama-3.1 config.json dict with the given sizes."""
    return {
        "model_type": "llama",
        "vocab_size": shape.dims.vocab,
        "hidden_size": shape.dims.hidden,
        "intermediate_size": shape.dims.intermediate,
        "num_hidden_layers": shape.dims.layers,
        "num_attention_heads": shape.dims.heads,
        "num_key_value_heads": shape.dims.kv_heads,
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
        "head_dim": shape.dims.head_dim,
        "block_size": shape.block,
        "num_target_layers": shape.dims.layers,
        "dflash_config": {
            "mask_token_id": shape.dims.vocab - 1,
            "target_layer_ids": default_target_layer_ids(shape.dims.layers, shape.draft_layers),
        },
    }


def random_target(
    shape: Shape, quantize: str | None, dtype: torch.dtype, device: str, gguf_dir: Path
) -> TorchLlamaTarget:
    """A random-weight target; with quantize (nf4, int4), each layer's linears are quantized one layer at a time;
    q4_k_m loads a GGUF of random quantized blocks written into gguf_dir."""
    max_context = max(DEFAULT_CACHE, shape.context + 4 * shape.block)
    if quantize == "q4_k_m":
        path = write_random_gguf(shape.dims, gguf_dir / "random-q4_k_m.gguf")
        runtime = RuntimeConfig(device, str(dtype).removeprefix("torch."))
        return TorchLlamaTarget.load(path, LoadSpec(runtime, max_context=max_context))
    cfg = TargetConfig.from_dict(target_config(shape), Path("<random>"))
    with torch.device("meta"):
        model = LlamaModel(cfg)
    install = install_int4 if quantize == "int4" else install_4bit
    if quantize:
        for index in range(cfg.dims.layers):
            scope = f"model.layers.{index}"
            generator = torch.Generator(device=device).manual_seed(index)
            weights = {
                f"{scope}.{name}.weight": torch.empty(m.weight.shape, dtype=dtype, device=device).normal_(
                    0.0, 0.02, generator=generator
                )
                for name, m in model.get_submodule(scope).named_modules()
                if isinstance(m, nn.Linear)
            }
            install(model, weights, scope, dtype, device, "<random>")
    materialize_rest(model, dtype, device)
    model.inv_freq = rope_inv_freq(cfg.raw, cfg.dims.head_dim).to(device)
    return TorchLlamaTarget(model.eval(), max_context=max_context)


def q4_k_m_type(name: str, layers: int) -> Q:
    """The type llama.cpp's Q4_K_M gives a tensor: Q6_K for the head and for attn_v / ffn_down in its "more bits"
    layers (the first and last eighth, every third between), Q4_K elsewhere."""
    if name == "output.weight":
        return Q.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        index = int(name.split(".")[1])
        if index < layers // 8 or index >= 7 * layers // 8 or (index - layers // 8) % 3 == 2:
            return Q.Q6_K
    return Q.Q4_K


def random_blocks(kind: Q, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Random quantized rows [rows, bytes per row] of a K-quant type with sane super-block scales (weights within
    about +-0.1): random codes and 6/8-bit sub-scales, one fp16 d (and dmin) for all blocks."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    count = rows * width // block
    blocks = np.frombuffer(rng.bytes(count * size), np.uint8).reshape(count, size).copy()
    if kind == Q.Q4_K:
        blocks[:, 0:4] = np.array([1e-4, 4e-4], np.float16).view(np.uint8)
    else:
        blocks[:, 208:210] = np.array([3e-5], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_random_gguf(dims: Dimensions, path: Path) -> Path:
    """A Llama-shaped GGUF of random Q4_K_M blocks (no conversion: seconds for 8B), its norms all ones."""
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = dims.head_dim
    writer.add_context_length(131072)
    writer.add_embedding_length(dims.hidden)
    writer.add_block_count(dims.layers)
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(dims.vocab)
    writer.add_file_type(15)  # llama.cpp's MOSTLY_Q4_K_M
    kv = dims.kv_heads * head_dim
    matrices = [("token_embd.weight", dims.vocab, dims.hidden), ("output.weight", dims.vocab, dims.hidden)]
    norms = ["output_norm.weight"]
    for i in range(dims.layers):
        for name, rows, width in (
            ("attn_q", dims.hidden, dims.hidden), ("attn_k", kv, dims.hidden), ("attn_v", kv, dims.hidden),
            ("attn_output", dims.hidden, dims.hidden), ("ffn_gate", dims.intermediate, dims.hidden),
            ("ffn_up", dims.intermediate, dims.hidden), ("ffn_down", dims.hidden, dims.intermediate),
        ):  # fmt: skip
            matrices.append((f"blk.{i}.{name}.weight", rows, width))
        norms += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
    for name, rows, width in matrices:
        kind = q4_k_m_type(name, dims.layers)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor_info(
            name, (rows, width // block * size), np.dtype(np.uint8), rows * width // block * size, kind
        )
    for name in norms:
        writer.add_tensor_info(name, (dims.hidden,), np.dtype(np.float32), dims.hidden * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, rows, width in matrices:
        writer.write_tensor_data(random_blocks(q4_k_m_type(name, dims.layers), rows, width, rng))
    for _ in norms:
        writer.write_tensor_data(np.ones(dims.hidden, np.float32))
    writer.close()
    return path


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
    model.inv_freq = rope_inv_freq(config, cfg.dims.head_dim).to("cpu" if quantize else device)
    if quantize:
        quantize_linears(model, "layers", quantize, dtype)
        model.to(device)
    return DFlashDrafter(model.eval(), max_context)


def copy_bandwidth(device: str, repeats: int, megabytes: int) -> float:
    """Bytes a second one device-to-device copy of `megabytes` moves (read plus write): the practical bound."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() / (ms / 1000)


def decode_bytes(target: TorchLlamaTarget, context: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row of it), once, plus the KV cache
    over the context."""
    model, cfg = target.model, target.cfg
    tensors = {}
    for name, module in model.named_modules(remove_duplicate=False):  # a tied head is lm_head too
        if name.startswith("model.embed_tokens"):
            continue
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            tensors[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        state = getattr(getattr(module, "weight", None), "quant_state", None)  # bitsandbytes NF4: its absmax
        if state is not None:
            tensors[state.absmax.data_ptr()] = state.absmax.numel() * state.absmax.element_size()
    kv = 2 * cfg.dims.layers * cfg.dims.kv_heads * cfg.dims.head_dim * context * target.cache[0].element_size()
    return sum(tensors.values()) + kv


def verify_costs(target: TorchLlamaTarget, context: int, device: str, repeats: int) -> dict[str, float]:
    """verify-k in ms for k in VERIFY_SIZES, at `context` cached tokens (the cache already holds them)."""
    ids = torch.randint(0, target.vocab_size, (max(VERIFY_SIZES),), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def verify(k: int) -> None:
        target.trim(context)
        target.forward(ids[:k])

    with torch.inference_mode():
        return {str(k): median_ms(lambda k=k: verify(k), device, repeats) for k in VERIFY_SIZES}


def measure(
    shape: Shape,
    quantize: str | None,
    drafter_quantize: str | None,
    dtype: torch.dtype,
    device: str,
    repeats: int,
    bandwidth: float,
    gguf_dir: Path,
) -> dict[str, Any]:
    """Per-step latencies (ms), the decode's share of the bandwidth bound and projected speedups for one format."""
    target = random_target(shape, quantize, dtype, device, gguf_dir)
    drafter = random_drafter(shape, dtype, device, target.max_context, drafter_quantize)
    drafter.check_target(target)
    target.set_feature_layers(drafter.target_layer_ids)
    block = shape.block
    costs = measure_steps(target, drafter, shape.dims.vocab, shape.context, [1, block], device, repeats)
    verify = verify_costs(target, shape.context, device, repeats)
    precision = str(dtype).removeprefix("torch.")
    row = {
        "target": f"{quantize} (compute {precision})" if quantize else precision,
        "drafter": drafter_quantize or precision,
        "decode_1_ms": costs["decode_1_ms"],
        f"verify_{block}_ms": verify[str(block)],
        "drafter_step_ms": costs["drafter_rows_ms"][str(block - 1)],
        "accept_ms": costs["accept_ms"],
        "verify_k_ms": verify,
        "decode_bytes": decode_bytes(target, shape.context),
    }
    row["bandwidth_share"] = row["decode_bytes"] / bandwidth / (row["decode_1_ms"] / 1000)
    step = row[f"verify_{block}_ms"] + row["drafter_step_ms"] + row["accept_ms"]
    row["verify_over_decode"] = {k: ms / row["decode_1_ms"] for k, ms in verify.items()}
    row["draft_over_decode"] = row["drafter_step_ms"] / row["decode_1_ms"]
    row["projected_speedup"] = {str(tau): tau * row["decode_1_ms"] / step for tau in TAUS}
    return row


def aten_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int):
    """torch's int4 kernel (gpt-fast's) on the same weight: its packing wants the even column in the high nibble and
    w = (nibble - 8) * scale + zero, so zero = min + 8 * scale; bf16 activations."""
    swapped = ((codes & 15) << 4) | (codes >> 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
    zeros = mins.float() + 8 * scales.float()
    scales_and_zeros = torch.stack((scales.float(), zeros), dim=-1).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)


def linear_candidates(dims: Dimensions, dtype: torch.dtype, device: str, repeats: int) -> dict[str, Any]:
    """ms per rows of the hidden -> intermediate linear for each int4 candidate, and each one's largest error against
    the reference (relative to the output's largest magnitude)."""
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.empty(dims.intermediate, dims.hidden, device=device).normal_(0, 0.02, generator=gen).to(dtype)
    codes, scales, mins = quantize_int4(weight, 128, group_scale_dtype(dtype))
    candidates = {"wq_matmul (" + ("Triton" if use_triton("auto", weight) else "torch reference") + ")": None}
    candidates[f"dense {str(dtype).removeprefix('torch.')}"] = lambda x: F.linear(x, weight)
    if device.startswith("cuda"):
        try:
            candidates["aten _weight_int4pack_mm"] = aten_int4(codes, scales, mins, 128)
        except (RuntimeError, AttributeError) as exc:
            candidates["aten _weight_int4pack_mm"] = str(exc).splitlines()[0]
    result: dict[str, Any] = {}
    restored = dequantize(codes, scales, mins, 4, 128).to(dtype)
    for name, fn in candidates.items():
        fn = fn or (lambda x: wq_matmul(x, codes, scales, mins, 4, 128))
        if isinstance(fn, str):
            result[name] = {"error": fn}
            continue
        entry: dict[str, Any] = {}
        with torch.inference_mode():
            for rows in CANDIDATE_ROWS:
                x = torch.randn(rows, dims.hidden, generator=gen, device=device).to(dtype)
                try:
                    entry[str(rows)] = median_ms(lambda x=x, fn=fn: fn(x), device, repeats)
                    want = (x.float() @ restored.float().T) if "dense" not in name else F.linear(x, weight).float()
                    error = ((fn(x).float() - want).abs().max() / want.abs().max()).item()
                    entry["max_error"] = max(entry.get("max_error", 0.0), error)
                except RuntimeError as exc:
                    entry = {"error": str(exc).splitlines()[0]}
                    break
        result[name] = entry
    return result


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: one row per target format, then verify-k / decode-1 per k, then the int4 linears."""
    block = report["shape"]["block"]
    head = f"| target | drafter | decode-1 ms | verify-{block} ms | drafter step ms | accept ms | bandwidth share | "
    head += " | ".join(f"speedup @ tau={tau}" for tau in TAUS)
    lines = [
        f"device: {report['device']}, kernels: {report['kernels']}, CUDA graphs: {report['cuda_graphs']}, "
        f"context: {report['shape']['context']} tokens, copy bandwidth: {report['bandwidth_gbps']:.0f} GB/s",
        "",
        head + " |",
        "|---" * (7 + len(TAUS)) + "|",
    ]
    for row in report["rows"]:
        cells = [row["target"], row["drafter"], row["decode_1_ms"], row[f"verify_{block}_ms"]]
        cells += [row["drafter_step_ms"], row["accept_ms"], f"{row['bandwidth_share']:.0%}"]
        cells += [row["projected_speedup"][str(tau)] for tau in TAUS]
        lines.append("| " + " | ".join(c if isinstance(c, str) else f"{c:.3f}" for c in cells) + " |")
    lines += ["", "| target | " + " | ".join(f"verify-{k} / decode-1" for k in SHOWN_SIZES) + " |"]
    lines.append("|---" * (1 + len(SHOWN_SIZES)) + "|")
    for row in report["rows"]:
        ratios = [f"{row['verify_over_decode'][str(k)]:.2f}x" for k in SHOWN_SIZES]
        lines.append(f"| {row['target']} | " + " | ".join(ratios) + " |")
    shape = report["shape"]
    dims = shape["dims"]
    lines += ["", f"int4 linear {dims['hidden']} -> {dims['intermediate']} (groups of 128), ms per rows:", ""]
    lines.append("| candidate | " + " | ".join(f"{rows} rows" for rows in CANDIDATE_ROWS) + " | max error |")
    lines.append("|---" * (2 + len(CANDIDATE_ROWS)) + "|")
    for name, entry in report["linear_candidates"].items():
        if "error" in entry:
            lines.append(f"| {name} | " + "failed: " + entry["error"] + " |")
            continue
        cells = [f"{entry[str(rows)]:.4f}" for rows in CANDIDATE_ROWS] + [f"{entry['max_error']:.1e}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def device_folder(name: str) -> str:
    """results/<this>: the device's name, lower case, the vendor dropped ("NVIDIA H200" -> "h200")."""
    name = name.lower().removeprefix("nvidia ").strip()
    return re.sub(r"[^a-z0-9.]+", "-", name).strip("-")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (runs anywhere, numbers mean nothing)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--targets", default="bf16,nf4,int4,q4_k_m", help=f"comma list of {', '.join(FORMATS)}")
    parser.add_argument("--drafters", default="plain", help="comma list of plain (target dtype), int8, nf4")
    parser.add_argument("--context", type=int, help="tokens already in the cache (default 1024, 64 with --small)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="folder of gpu_bench.json and .md (default results/<device>/)")
    parser.add_argument("--json", type=Path, help="the JSON report's path (default <out>/gpu_bench.json)")
    parser.add_argument("--markdown", type=Path, help="the markdown report's path (default <out>/gpu_bench.md)")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    shape = SMALL if args.small else LLAMA_8B
    if args.context:
        shape = replace(shape, context=args.context)
    names = args.targets.split(",")
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        parser.error(f"unknown target format {unknown[0]} (use {', '.join(FORMATS)})")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    cuda = device.startswith("cuda")
    bandwidth = copy_bandwidth(device, args.repeats, 2048 if cuda and not args.small else 64)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as gguf_dir:
        for target_name, drafter in itertools.product(names, args.drafters.split(",")):
            quantize = None if target_name in ("bf16", "fp32") else target_name
            dtype = torch.float32 if target_name == "fp32" or not cuda else torch.bfloat16
            drafter_quantize = None if drafter == "plain" else drafter
            rows.append(
                measure(shape, quantize, drafter_quantize, dtype, device, args.repeats, bandwidth, Path(gguf_dir))
            )
            if cuda:
                torch.cuda.empty_cache()
    linear_dtype = torch.bfloat16 if cuda else torch.float32
    report = {
        "device": name,
        "kernels": "auto",  # every model and call here runs the default mode
        "cuda_graphs": cuda,  # the default on CUDA
        "torch": torch.__version__,
        "shape": asdict(shape),
        "bandwidth_gbps": bandwidth / 1e9,
        "rows": rows,
        "linear_candidates": linear_candidates(shape.dims, linear_dtype, device, args.repeats),
    }
    out = args.out or Path(__file__).resolve().parent.parent / "results" / device_folder(name)
    json_path, markdown_path = args.json or out / "gpu_bench.json", args.markdown or out / "gpu_bench.md"
    for path in (json_path, markdown_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    markdown_path.write_text(markdown(report))
    print(markdown(report), end="")
    return report


if __name__ == "__main__":
    main()
