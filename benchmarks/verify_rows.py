"""Whether a verify forward's rows equal one-token decodes, bitwise, on a llama.cpp device: after a random prefix,
the logits of one R-row forward against R one-row forwards from the same prefix, with verification as dflash runs it
on that device (fixed-width forwards on a GPU backend) and without (every forward as wide as its rows).

    .venv/bin/python -m benchmarks.verify_rows --device vulkan --target a.gguf,b.gguf [--prefix 40] [--rows 16] \
        [--gpu-layers auto|all|N] [--cache-type q8_0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_local.vulkan_probe import expose_software_devices


def compare(target, prefix: list[int], block: list[int]) -> dict:
    """Logits of the block as one forward and as one-token forwards, from the same cached prefix."""
    import torch

    target.trim(0)
    target.forward(torch.tensor(prefix), all_logits=False, features=False)
    whole = target.forward(torch.tensor(block), features=False).logits
    target.trim(len(prefix))
    single = torch.cat([target.forward(torch.tensor([token]), features=False).logits for token in block])
    same_rows = int((whole == single).all(dim=1).sum())
    same_argmax = int((whole.argmax(dim=1) == single.argmax(dim=1)).sum())
    return {"rows": len(block), "bitwise_equal_rows": same_rows, "argmax_equal_rows": same_argmax,
            "max_abs_diff": float((whole - single).abs().max())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--target", required=True, help="comma-separated GGUF files")
    parser.add_argument("--prefix", type=int, default=40)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--gpu-layers", default="auto")
    parser.add_argument("--cache-type", default="f16", help="the targets' K and V cache type (f16, q8_0 or q4_0)")
    args = parser.parse_args()
    if args.device.lower().startswith("vulkan"):
        expose_software_devices()
    import torch

    from dflash_local.kv_cache import KVCache
    from dflash_local.runtime import LoadSpec, RuntimeConfig, plan_load
    from dflash_local.targets.llamacpp import LlamaCppTarget

    for path in map(Path, args.target.split(",")):
        cache = KVCache(args.cache_type, args.cache_type)
        runtime = RuntimeConfig(device=args.device, threads=2)
        spec = LoadSpec(runtime, max_context=1024, gpu_layers=args.gpu_layers, kv_cache=cache)
        spec = plan_load(path, spec)
        target = LlamaCppTarget.load(path, spec)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, target.vocab_size, (args.prefix + args.rows,), generator=generator).tolist()
        prefix, block = ids[: args.prefix], ids[args.prefix :]
        placed = spec.placement.describe() if spec.placement else "torch"
        dflash_width = target.fixed_rows
        for name, width in (("as dflash runs it", dflash_width), ("every forward as wide as its rows", None)):
            target.fixed_rows = width
            result = {"target": path.name, "placed": placed, "cache": args.cache_type, "verification": name}
            result["fixed_rows"] = width
            print(json.dumps(result | compare(target, prefix, block)), flush=True)


if __name__ == "__main__":
    main()
