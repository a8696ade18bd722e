"""Benchmark of the bundled pair with GGUF targets through llama.cpp: AR vs DFlash, per quantization and drafter.

    .venv/bin/python scripts/bench_gguf.py [--types f16,q8_0,q4_k_m] [--prompts 10] [--max-new-tokens 128]

Converts models/tiny/target to each GGUF type (into --work), then runs the held-out prompts with
llama.cpp's own autoregressive decoding (the baseline) and with DFlash, once with the torch drafter
and once with llama.cpp's native `dflash` drafter, all in this one process with --threads threads
(torch and llama.cpp alike). Prints a markdown table of mean decode tokens/s, speedup and tau, and
the torch backend's tau on the same prompts for comparison.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from dflash_local.decode import Settings
from dflash_local.drafters import load_drafter
from dflash_local.generation import GenerationRequest, LoadedModels, load_models, run_request
from dflash_local.gguf.convert import convert
from dflash_local.runtime import RuntimeConfig
from dflash_local.tokenizer import TextTokenizer

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "models" / "tiny"


def measure(models: LoadedModels, prompts: list[list[int]], args, draft: bool) -> tuple[float, float, list]:
    """Mean tau, mean decode tokens/s, and the output ids per prompt."""
    taus, rates, outputs = [], [], []
    for ids in prompts:
        settings = Settings(args.max_new_tokens, block_size=args.block_size if draft else None, draft=draft)
        request = GenerationRequest(ids, settings)
        result = run_request(models, request)
        taus.append(result["tau"])
        rates.append(result["decode_tokens_per_s"])
        outputs.append(result["output_ids"])
    return sum(taus) / len(taus), sum(rates) / len(rates), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="f16,q8_0,q4_k_m")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash-gguf-bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = TextTokenizer.load(TINY / "target")
    lines = (TINY / "heldout_prompts.jsonl").read_text().splitlines()[: args.prompts]
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]

    torch_models = load_models(TINY / "target", TINY / "drafter", RuntimeConfig(device="cpu"))
    torch_tau, _, _ = measure(torch_models, prompts, args, draft=True)
    print(
        f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, block {args.block_size}, "
        f"{args.threads} thread(s), {platform.processor() or platform.machine()} CPU\n"
    )
    print("| target | drafter | AR tok/s (llama.cpp) | DFlash tok/s | speedup | tau | prompts identical to AR |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.types.split(","):
        path = args.work / f"tiny-{kind}.gguf"
        if not path.is_file():
            convert(TINY / "target", path, kind)
        base = load_models(path, None, RuntimeConfig(device="cpu"))
        _, slow, expected = measure(base, prompts, args, draft=False)
        for drafter_kind in ("torch", "native"):
            drafter = load_drafter(TINY / "drafter", base.target, kind=drafter_kind)
            models = LoadedModels(base.target, drafter, base.tokenizer, base.stop_ids)
            tau, fast, got = measure(models, prompts, args, draft=True)
            same = f"{sum(a == b for a, b in zip(got, expected, strict=True))}/{len(expected)}"
            print(
                f"| GGUF {kind.upper()} | {drafter_kind} | {slow:.0f} | {fast:.0f} | {fast / slow:.2f}x "
                f"| {tau:.2f} | {same} |"
            )
    print(f"\ntorch backend (fp32 safetensors) tau on the same prompts: {torch_tau:.2f}")


if __name__ == "__main__":
    main()
