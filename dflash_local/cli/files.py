"""From what the user named to files on disk: writable storage checked first, pulls with progress unless offline."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DFlashError

if TYPE_CHECKING:
    from ..catalog import ResolvedModel
    from ..hub import HubSource


def check_storage(hub_cache: bool = True) -> None:
    """Before anything is downloaded: the Hub cache and dflash's own folder must take files (one sentence if not)."""
    from ..atomic import unwritable_reason
    from ..paths import cache_dir, state_dir

    folders = [("The dflash folder", state_dir(), ("DFLASH_HOME",))]
    if hub_cache:
        folders.insert(0, ("The Hugging Face cache", cache_dir(), ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")))
    for what, folder, variables in folders:
        reason = unwritable_reason(folder)
        if reason is not None:
            variable = next((v for v in variables if os.environ.get(v)), None)
            source = f" (from {variable}={os.environ[variable]})" if variable else ""
            fix = f"point {variable} at a writable folder" if variable else f"make it writable or set {variables[0]}"
            raise DFlashError(f"{what} {folder}{source} is not writable ({reason}): {fix}.")


def fetcher(offline: bool, token: str | None, cached_first: bool = False) -> Callable[[HubSource], Path]:
    """How a command gets a Hub file set: downloaded with progress (the storage checked first), or only from the cache
    when offline; cached_first: a complete cached copy as it is, without asking the Hub."""
    from ..downloads import Downloader
    from ..hub import cached_folder

    downloader = Downloader(token, offline)

    def fetch(source: HubSource) -> Path:
        if not offline:
            check_storage()
        found = cached_folder(source) if cached_first else None
        return found or downloader(source)

    return fetch


def resolve(model: str, drafter: str | None, offline: bool, token: str | None) -> ResolvedModel:
    """Local paths for what the user named, pulling from the Hub (with progress) unless offline."""
    from ..catalog import resolve as resolve_names

    return resolve_names(model, drafter, fetcher(offline, token))


def prompt_file(prompts: str, offline: bool, token: str | None) -> Path:
    """A JSONL path as given, or a named Hugging Face prompt set fetched and converted to JSONL."""
    from ..prompt_sets import PROMPT_SETS
    from ..prompt_sets import prompt_file as fetch_prompt_set

    if prompts in PROMPT_SETS and not Path(prompts).exists():
        check_storage(hub_cache=not offline)
        return fetch_prompt_set(prompts, token, offline)
    return Path(prompts)


def drafter_folder(name: str, offline: bool, token: str | None) -> Path:
    """The local drafter a path, Hub repo or catalog name (its drafter) names, pulling it unless offline."""
    from ..catalog import resolve_drafter

    return resolve_drafter(name, fetcher(offline, token))
