"""One process on a llama.cpp device, as tests/gpu_runs.py: a GGUF vision target (every layer on the device) with its
projector and DFlash drafter, an image prompt per seed (test_vision's image_chunks) decoded plainly; the first seed's
also plainly with the image's rows fed causally (a broken feed), and with DFlash at block 4, the drafter's block and
the auto policy (scripted costs), that one also with lookup's drafts (auto_lookup); one JSON line: each mode's ids (a
list: per seed for plain), each DFlash mode's steps' (verify size, acceptance length) pairs and tau, and where the
target and the drafter ran.

  python tests/gpu_vision_runs.py DEVICE TARGET.gguf MMPROJ.gguf DRAFTER NEW_TOKENS SEED...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(device: str, target_path: str, mmproj: str, drafter_path: str, new_tokens: str, *seeds: str) -> None:
    from gpu_runs import load_library

    load_library(device)
    from test_gguf_lossless import auto_policy
    from test_vision import image_chunks

    from dflash_local.decode import Settings, run
    from dflash_local.generation import load_models
    from dflash_local.runtime import LoadSpec, RuntimeConfig
    from dflash_local.session import Session
    from dflash_local.vision import Chunk, load_projector, prefill

    spec = LoadSpec(RuntimeConfig(device=device, threads=1), max_context=256, gpu_layers="all")
    models = load_models(Path(target_path), Path(drafter_path), spec, auto_block=False)
    target, drafter = models.target, models.drafter
    projector = load_projector(models, Path(mmproj), 1)
    out: dict = {"target": target_path, "devices": models.devices}

    def decode(mode: str, chunks: list[Chunk], block: int | None, policy=None, lookup: bool = False) -> None:
        """The seed's new ids appended to out[mode]; a drafting mode's steps to out[mode_steps]."""
        session, drafting = Session(), drafter if block != 1 else None
        ids, _ = prefill(target, drafting, chunks, session)
        settings = Settings(max_new_tokens=int(new_tokens), block_size=block, draft=block != 1, lookup=lookup)
        new, stats = run(target, drafting, ids, settings, policy, session=session)
        out.setdefault(mode, []).append(new)
        if drafting is not None:
            out.setdefault(f"{mode}_steps", []).extend(zip(stats.block_sizes, stats.acceptance_lengths, strict=True))

    for seed in map(int, seeds):
        decode("plain", image_chunks(projector, seed), 1)
    chunks = image_chunks(projector, int(seeds[0]))
    decode("causal", [Chunk(c.ids, c.embeddings, False) for c in chunks], 1)
    for block in (4, drafter.block_size):
        decode(str(block), chunks, block)
    decode("auto", chunks, None, auto_policy(drafter.block_size))
    decode("auto_lookup", chunks, None, auto_policy(drafter.block_size), lookup=True)
    for mode in ("4", str(drafter.block_size), "auto", "auto_lookup"):
        drafted = [length for size, length in out[f"{mode}_steps"] if size > 1]
        out[f"tau_{mode}"] = sum(drafted) / len(drafted)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(*sys.argv[1:])
