"""`dflash export`: a drafter dflash loads, written for another engine: z-lab's folder layout for vLLM and SGLang, or
the `dflash` GGUF llama-server's `-md` takes (the native drafter's writer), with the line that serves it there."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from .atomic import unwritable_reason
from .drafters.config import DrafterConfig
from .drafters.gguf_drafter import is_drafter_gguf
from .errors import DFlashError
from .weights import load_weights, read_config

ENGINES = ("vllm", "sglang", "gguf")
# DFlash fields a config may hold at its top level; z-lab's layout keeps them in dflash_config
MOVED_FIELDS = ("mask_token_id", "target_layer_ids")
HEAD_TENSORS = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")  # borrowed from the target


@dataclass(frozen=True)
class Exported:
    """What an export wrote and the command that serves it on its engine."""

    path: Path
    serve: str


def zlab_config(cfg: DrafterConfig, num_target_layers: int | None) -> dict[str, Any]:
    """The drafter's config.json in z-lab's layout: the Qwen3 layer fields as they were, `DFlashDraftModel`, and
    block_size, mask_token_id and target_layer_ids in dflash_config (block_size also at the top, as older loaders
    read it)."""
    raw = {key: value for key, value in cfg.raw.items() if key not in MOVED_FIELDS}
    layers = num_target_layers or raw.get("num_target_layers") or max(cfg.target_layer_ids) + 1
    return raw | {
        "architectures": ["DFlashDraftModel"],
        "model_type": raw.get("model_type", "qwen3"),
        "block_size": cfg.block_size,
        "num_target_layers": int(layers),
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
        },
    }


def _check_portable(cfg: DrafterConfig, engine: str) -> None:
    """Raise one sentence when the drafter uses a field the engine's DFlash loader ignores, or is DFlash2's."""
    if cfg.dflash2 is not None:
        raise DFlashError(f"{cfg.source} is a DFlash2 drafter; {engine}'s DFlash loader runs DFlash drafters only.")
    unread = {  # fields vLLM's and SGLang's DFlash loaders do not read, and whether this drafter uses each
        "input_embedding_scale": cfg.input_embedding_scale != 1.0,
        "output_multiplier": cfg.output_multiplier != 1.0,
        "final_logit_softcapping": cfg.final_logit_softcapping is not None,
        "draft_vocab_size": cfg.draft_vocab_size is not None,
    }
    for field, used in unread.items():
        if used:
            raise DFlashError(
                f"{cfg.source} uses {field}, which {engine}'s DFlash loader does not read, so it would draft "
                "differently there; export it with --to gguf for llama.cpp instead."
            )


def _staging(out: Path, folder: bool) -> Path:
    """The working path beside out that becomes out by a rename, once out is known to be replaceable: a new or empty
    folder (folder=True), else a file."""
    if folder and out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise DFlashError(f"--out {out} exists and is not an empty folder; name a new folder.")
    if not folder and out.is_dir():
        raise DFlashError(f"--out {out} is an existing folder; name the GGUF file to write.")
    reason = unwritable_reason(out.parent)
    if reason is not None:
        raise DFlashError(f"Cannot write {out}: its folder {out.parent} is not writable ({reason}).")
    return out.with_name(f"{out.name}.{os.getpid()}.partial")


def write_zlab(folder: Path, cfg: DrafterConfig, out: Path, num_target_layers: int | None) -> None:
    """config.json and model.safetensors (the layers, fc and norms as stored; no embedding or head) at out, which
    appears whole or not at all."""
    tensors = {name: t.contiguous() for name, t in load_weights(folder, None).items() if name not in HEAD_TENSORS}
    partial = _staging(out, folder=True)
    try:
        partial.mkdir()
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        config = zlab_config(cfg, num_target_layers)
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        with contextlib.suppress(OSError):
            out.rmdir()  # an empty folder the user named
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def write_gguf(folder: Path, cfg: DrafterConfig, out: Path, target: Path) -> None:
    """The drafter as llama.cpp's `dflash` GGUF for the GGUF target (its vocabulary, and its head rows for a draft
    vocabulary), through the native drafter's writer; out appears whole or not at all."""
    from .drafters.config import check_fits
    from .drafters.native import write_drafter_gguf
    from .runtime import LoadSpec, RuntimeConfig
    from .targets.llamacpp import LlamaCppTarget

    if target.suffix != ".gguf" or not target.is_file():
        raise DFlashError(f"--to gguf needs --target TARGET.gguf, the GGUF target llama-server will run; got {target}.")
    loaded = LlamaCppTarget.load(target, LoadSpec(RuntimeConfig(threads=1), max_context=cfg.block_size * 2))
    check_fits(cfg, loaded)
    partial = _staging(out, folder=False)
    try:
        write_drafter_gguf(folder, cfg, loaded, partial, key=None)
        os.replace(partial, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


def serve_line(engine: str, out: Path, target: str | None, block_size: int) -> str:
    """The command that serves the exported drafter beside its target on the engine (TARGET where none was named):
    `dflash serve --engine`'s commands for vLLM and SGLang, llama-server's draft-dflash speculative type."""
    from .handoff import EnginePair, launch_command

    if engine == "gguf":
        return shlex.join(["llama-server", "-m", str(target), "-md", str(out), "--spec-type", "draft-dflash"])
    return shlex.join(launch_command(engine, EnginePair(target or "TARGET", str(out), block_size)))


def export_drafter(folder: Path, engine: str, out: Path | None, target: str | None) -> Exported:
    """Write the drafter folder for engine (vllm, sglang or gguf) at out (default: beside the current folder, named
    after the drafter) and return it with its serving line."""
    if engine not in ENGINES:
        raise DFlashError(f"Unknown export target '{engine}' (use {', '.join(ENGINES)}).")
    folder = Path(folder)
    if is_drafter_gguf(folder):
        raise DFlashError(f"{folder} is already a llama.cpp drafter GGUF; export reads a drafter folder.")
    cfg = DrafterConfig.from_dict(read_config(folder), folder)
    if engine == "gguf":
        out = Path(out or f"{folder.resolve().name}.gguf")
        if out.suffix != ".gguf":
            raise DFlashError(f"The output file name must end in .gguf, not '{out.name}'.")
        if target is None:
            raise DFlashError("--to gguf needs --target TARGET.gguf: the drafter GGUF carries its target's vocabulary.")
        write_gguf(folder, cfg, out, Path(target))
    else:
        _check_portable(cfg, engine)
        out = Path(out or f"{folder.resolve().name}-{engine}")
        write_zlab(folder, cfg, out, _target_layers(target))
    return Exported(out, serve_line(engine, out, target, cfg.block_size))


def _target_layers(target: str | None) -> int | None:
    """The number of layers of a target folder named by --target (None for a name, a repo or a GGUF file)."""
    path = Path(target).expanduser() if target else None
    if path is None or not (path / "config.json").is_file():
        return None
    layers = read_config(path).get("num_hidden_layers")
    return layers if isinstance(layers, int) else None
