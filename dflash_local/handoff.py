"""Launch commands that move the same target/drafter pair to a multi-user GPU engine (vLLM or SGLang)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .catalog import REPO_NAME, ModelEntry, Source, is_repo_name, load_catalog, lookup
from .drafters.config import DrafterConfig
from .errors import DFlashError
from .hub import HubSource

Fetch = Callable[[HubSource], Path]


@dataclass(frozen=True)
class EnginePair:
    """What an engine loads: the target and drafter as Hub repo ids or local folders, and the verify block size."""

    target: str
    drafter: str
    block_size: int


def vllm_command(pair: EnginePair) -> list[str]:
    """`vllm serve` with a DFlash speculative config: the drafter drafts block - 1 tokens per step."""
    config = {"method": "dflash", "model": pair.drafter, "num_speculative_tokens": pair.block_size - 1}
    return ["vllm", "serve", pair.target, "--speculative-config", json.dumps(config)]


def sglang_command(pair: EnginePair) -> list[str]:
    """SGLang's server with the DFLASH algorithm: the draft token count is the verify block size."""
    return [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        pair.target,
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        pair.drafter,
        "--speculative-num-draft-tokens",
        str(pair.block_size),
    ]


ENGINES: dict[str, Callable[[EnginePair], list[str]]] = {"vllm": vllm_command, "sglang": sglang_command}


def launch_command(engine: str, pair: EnginePair) -> list[str]:
    """The engine's (a key of ENGINES) server command for the pair with DFlash speculative decoding on."""
    return ENGINES[engine](pair)


def engine_pair(model: str, drafter: str | None, block_size: int | None, fetch: Fetch) -> EnginePair:
    """The pair `dflash serve MODEL` would run, as an engine names it; the block size is the drafter's trained one
    unless given (reading it may fetch the drafter's config.json)."""
    path = Path(model).expanduser()
    entry = None
    if path.exists():
        target = _local_target(path)
    else:
        found = lookup(model)
        entry = found if isinstance(found, ModelEntry) else None
        target = _hf_target(entry, model) if entry else _hub_target(found)
    if drafter is not None:
        drafter_source: Source = _drafter_source(drafter)
    elif entry is not None and entry.drafter is not None:
        drafter_source = entry.drafter
    else:
        raise DFlashError(f"'{model}' has no drafter: pass --drafter DIR or a Hub repo.")
    name = str(drafter_source.resolve()) if isinstance(drafter_source, Path) else drafter_source.repo
    size = block_size if block_size is not None else _trained_block_size(drafter_source, fetch)
    return EnginePair(target, name, size)


def _local_target(path: Path) -> str:
    if path.suffix == ".gguf":
        raise DFlashError(f"{path} is a GGUF file: vLLM and SGLang need the target as an HF-layout folder or repo.")
    return str(path.resolve())


def _hub_target(source: HubSource) -> str:
    if _is_gguf(source):
        raise DFlashError(f"{source.repo} names a GGUF quantization: vLLM and SGLang need an HF-layout target repo.")
    return source.repo


def _hf_target(entry: ModelEntry, name: str) -> str:
    """The entry's target as an engine loads it; for a GGUF entry, the HF-layout target of a catalog entry that
    shares its drafter (the unquantized model the drafter was trained for)."""
    if isinstance(entry.target, Path):
        return _local_target(entry.target)
    if not _is_gguf(entry.target):
        return entry.target.repo
    for other in load_catalog().values():
        if isinstance(other.target, HubSource) and not _is_gguf(other.target) and other.drafter == entry.drafter:
            return other.target.repo
    raise DFlashError(
        f"'{name}' is a GGUF target and the catalog has no HF-layout version of it: vLLM and SGLang need an HF "
        "target, so pass the HF repo (owner/name) of the unquantized model instead."
    )


def _is_gguf(source: HubSource) -> bool:
    return any(pattern.endswith(".gguf") for pattern in source.patterns)


def _drafter_source(drafter: str) -> Source:
    path = Path(drafter).expanduser()
    if path.exists():
        return path
    if REPO_NAME.match(drafter) and is_repo_name(drafter.partition(":")[0]):
        return HubSource(drafter.partition(":")[0], ("config.json",))
    raise DFlashError(f"--drafter {drafter} is neither a folder nor a Hub repo (owner/name).")


def _trained_block_size(source: Source, fetch: Fetch) -> int:
    """The block size in the drafter's config.json (only that file is fetched for a Hub drafter)."""
    folder = source if isinstance(source, Path) else fetch(replace(source, patterns=("config.json",)))
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashError(f"The drafter config {config} cannot be read ({exc}).") from None
    if not isinstance(data, dict):
        raise DFlashError(f"{config} is not a JSON object.")
    return DrafterConfig.from_dict(data, folder).block_size
