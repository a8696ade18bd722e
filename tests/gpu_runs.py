"""One process on a llama.cpp device, chosen before the library loads as the CLI chooses it: each GGUF target given,
with its drafter, decoded plainly, by lookup alone (block 16), and with DFlash at block 4, the drafter's block (16 for
the tests' DFlash drafters) and the auto policy (scripted costs), for each prompt; one JSON line per target: each
mode's ids per prompt, its steps' (verify size, acceptance length) pairs, each block's tau, and where the layers and
the drafter ran. A target given as its own drafter drafts with its MTP layer.

  python tests/gpu_runs.py [--cache-type KIND] [--max-context N] DEVICE GPU_LAYERS CPU_MOE NEW_TOKENS
      PROMPT_IDS[;PROMPT_IDS...] TARGET.gguf[:DRAFTER] ...

--cache-type: the targets' K and V cache type (f16, the default, q8_0 or q4_0); --max-context: the targets' context
(default 256).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_local.vulkan_probe import expose_software_devices


def load_library(device: str) -> None:
    """llama.cpp told which Vulkan devices it may use, then dflash's libllama loaded (before a test module imports
    llama_cpp itself)."""
    if device.lower().startswith("vulkan"):
        expose_software_devices()
    import dflash_local.llama_lib  # noqa: F401


def main(
    device: str,
    gpu_layers: str,
    cpu_moe: str,
    new_tokens: str,
    prompts: str,
    *pairs: str,
    cache: str = "f16",
    context: int = 256,
) -> None:
    load_library(device)
    from test_gguf_lossless import auto_policy

    from dflash_local.decode import Settings, generate
    from dflash_local.generation import load_models
    from dflash_local.kv_cache import KVCache
    from dflash_local.runtime import LoadSpec, RuntimeConfig

    prompt_ids = [[int(i) for i in prompt.split(",")] for prompt in prompts.split(";")]
    tokens = int(new_tokens)
    for pair in pairs:
        target_path, _, drafter_path = pair.partition(":")
        runtime = RuntimeConfig(device=device, threads=1)
        spec = LoadSpec(
            runtime, max_context=context, gpu_layers=gpu_layers, cpu_moe=cpu_moe == "1", kv_cache=KVCache(cache, cache)
        )
        drafter_file = Path(drafter_path) if drafter_path else None
        models = load_models(Path(target_path), drafter_file, spec, auto_block=False)
        target, drafter = models.target, models.drafter
        out = {"target": target_path, "devices": models.devices}

        def decode(mode: str, drafting, settings: Settings, policy=None, target=target, out=out) -> None:
            """Each prompt's ids under out[mode], the steps' (verify size, acceptance length) under out[mode_steps]."""
            out[mode], out[f"{mode}_steps"] = [], []
            for ids in prompt_ids:
                steps = list(generate(target, drafting, ids, settings, policy))
                out[mode].append([token for step in steps for token in step.token_ids])
                out[f"{mode}_steps"] += [(s.block_size, s.acceptance_length) for s in steps[1:]]

        decode("plain", None, Settings(max_new_tokens=tokens, draft=False))
        decode("lookup", None, Settings(max_new_tokens=tokens, block_size=16))
        if drafter is not None:
            for block in (4, drafter.block_size):
                decode(str(block), drafter, Settings(max_new_tokens=tokens, block_size=block, lookup=False))
                accepted = [length for _, length in out[f"{block}_steps"]]
                out[f"tau{block}"] = sum(accepted) / len(accepted)
            decode("auto", drafter, Settings(max_new_tokens=tokens), auto_policy(drafter.block_size))
            out["auto_blocks"] = sorted({size for size, _ in out["auto_steps"]})
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    args, options = sys.argv[1:], {}
    while args[0] in ("--cache-type", "--max-context"):
        options["cache" if args[0] == "--cache-type" else "context"] = args[1]
        args = args[2:]
    main(*args, cache=options.get("cache", "f16"), context=int(options.get("context", 256)))
