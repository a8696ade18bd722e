"""Prompt prefill through dflash's libllama beside stock llama-cpp-python's own library, side by side in one run.

Each measurement is a fresh process (a process loads one libllama), the two libraries taking turns round by round:
- stock: llama-cpp-python's bundled library through `Llama(...).eval` and its defaults (flash attention off, weights
  repacked for the CPU), or as dflash runs with --stock-flash-attn and --stock-unrepacked;
- dflash: the library dflash_local.llama_lib loads, through dflash's GGUF target (`LlamaCppTarget.forward`, its
  model options: unrepacked weights, flash attention on).
Both prefill the same random prompt in batches of 512 after a 16-token warm-up, on --threads threads. Prints each
run's tokens/s, the medians and the median of the rounds' dflash/stock ratios, then every run (with the process's
whole wall time) as JSON.

    .venv/bin/python -m benchmarks.prefill MODEL.gguf [MORE.gguf ...] --tokens 3000 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH = 512  # llama-cpp-python's default n_batch, and dflash's
WARM_UP = 16
LIBRARIES = ("stock", "dflash")


def prompt(vocab: int, tokens: int) -> list[int]:
    """The same random prompt in every process."""
    import numpy as np

    return np.random.default_rng(0).integers(5, vocab, WARM_UP + tokens).tolist()


def stock(path: str, args: argparse.Namespace) -> float:
    """Seconds of llama-cpp-python's own prefill (Llama.eval) of the prompt; --stock-unrepacked: its weights loaded
    without the CPU's extra buffer types (use_extra_bufts off); --stock-flash-attn: flash attention on (Llama's
    default is off, dflash's context takes llama.cpp's auto: on for the CPU)."""
    import llama_cpp

    if args.stock_unrepacked:
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            out = defaults()
            out.use_extra_bufts = False
            return out

        llama_cpp.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(
        path,
        n_ctx=args.tokens + 64,
        n_batch=BATCH,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=args.stock_flash_attn,
        verbose=False,
    )
    ids = prompt(llm.n_vocab(), args.tokens)
    llm.eval(ids[:WARM_UP])
    llm.reset()
    began = time.perf_counter()
    llm.eval(ids[WARM_UP:])
    return time.perf_counter() - began


def dflash(path: str, tokens: int, threads: int) -> float:
    """Seconds of dflash's prefill (LlamaCppTarget.forward, the last logits) of the prompt."""
    import torch

    from dflash_local.runtime import LoadSpec, RuntimeConfig
    from dflash_local.targets.llamacpp import LlamaCppTarget

    target = LlamaCppTarget.load(path, LoadSpec(RuntimeConfig(threads=threads), max_context=tokens + 64))
    ids = torch.tensor(prompt(target.vocab_size, tokens))
    target.forward(ids[:WARM_UP], all_logits=False, features=False)
    target.trim(0)
    began = time.perf_counter()
    target.forward(ids[WARM_UP:], all_logits=False, features=False)
    return time.perf_counter() - began


def measure(library: str, path: str, args: argparse.Namespace) -> dict:
    """One process's prefill: {"tok_s", "process_s"} (the child's whole wall time)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", "GGML_CPU_TILED_MM")}
    command = [sys.executable, "-m", "benchmarks.prefill", path, "--worker", library, "--tokens", str(args.tokens)]
    command += ["--threads", str(args.threads), *(["--stock-unrepacked"] if args.stock_unrepacked else [])]
    command += ["--stock-flash-attn"] if args.stock_flash_attn else []
    began = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    seconds = float(out.stdout.strip().splitlines()[-1])
    return {"tok_s": args.tokens / seconds, "process_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="GGUF files")
    parser.add_argument("--tokens", type=int, default=3000, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--stock-unrepacked", action="store_true", help="stock's weights unrepacked, as dflash's (use_extra_bufts off)"
    )
    parser.add_argument("--stock-flash-attn", action="store_true", help="stock with flash attention on, as dflash")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "stock":
        print(stock(args.models[0], args))
        return
    if args.worker:
        print(dflash(args.models[0], args.tokens, args.threads))
        return
    results: dict[str, dict[str, list[dict]]] = {m: {lib: [] for lib in LIBRARIES} for m in args.models}
    for round_ in range(args.rounds):
        for model in args.models:
            for library in LIBRARIES if round_ % 2 == 0 else LIBRARIES[::-1]:
                run = measure(library, model, args)
                results[model][library].append(run)
                print(f"round {round_ + 1} {Path(model).name} {library}: {run['tok_s']:.1f} tok/s", flush=True)
    for model, runs in results.items():
        median = {lib: statistics.median(r["tok_s"] for r in runs[lib]) for lib in LIBRARIES}
        paired = statistics.median(d["tok_s"] / s["tok_s"] for d, s in zip(runs["dflash"], runs["stock"], strict=True))
        print(
            f"{Path(model).name}: stock {median['stock']:.1f} tok/s, dflash {median['dflash']:.1f} tok/s (medians of "
            f"{args.rounds}); dflash/stock {paired:.3f} (median of each round's ratio)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
