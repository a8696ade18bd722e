"""The commands that manage models on disk: `dflash pull`, `dflash models` and `dflash rm`."""

from __future__ import annotations

import json

import typer

from ..errors import DFlashError
from .app import user_errors
from .files import check_storage
from .options import Offline, Token


def _hub_sources(name: str) -> tuple[list, bool]:
    """The Hub sources behind a model name or repo, and whether the name is a bundled model."""
    from ..catalog import ModelEntry, lookup
    from ..hub import HubSource

    found = lookup(name)
    sources = found.sources() if isinstance(found, ModelEntry) else [found]
    hub = [s for s in sources if isinstance(s, HubSource)]
    return hub, isinstance(found, ModelEntry) and found.bundled


def pull(
    name: str = typer.Argument(..., help="A model name (dflash models) or a Hub repo: owner/name[:QUANT]."),
    offline: Offline = False,
    token: Token = None,
) -> None:
    """Download a model (target + drafter) into the Hugging Face cache: resumable, verified, only needed files."""
    with user_errors():
        from rich.console import Console

        from ..downloads import Downloader
        from ..hub import cached_folder, human_size, local_size
        from ..hub_access import HubUnreachable

        sources, bundled = _hub_sources(name)
        if bundled:
            typer.echo(f"{name} is bundled with dflash-local: nothing to download.")
            return
        if not offline:
            check_storage()
        downloader = Downloader(token, offline, report=Console())  # what was pulled is this command's output
        for source in sources:
            if offline:
                folder = cached_folder(source) or downloader(source)  # refuses: nothing is fetched offline
                typer.echo(f"{source.repo}: pulled, {human_size(local_size(source) or 0)} in {folder}")
            else:
                try:
                    downloader.pull(source)
                except HubUnreachable:
                    if cached_folder(source) is None:
                        raise
                    typer.echo(f"{source.repo}: the Hub is unreachable, so no update check; the pulled copy is whole.")
        typer.echo(f"{name} is ready: dflash chat {name}")


def list_models(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON array instead of the list."),
) -> None:
    """The model catalog and the GGUF models other tools keep here: what each name is, needs, and has on disk."""
    with user_errors():
        from rich.console import Console

        from ..model_list import model_rows, plain_line, render, rows_as_json

        rows = model_rows()
        console = Console()
        if as_json:
            typer.echo(json.dumps(rows_as_json(rows)))
        elif console.is_terminal:
            render(rows, console)
        else:
            for row in rows:
                typer.echo(plain_line(row))


def rm(name: str = typer.Argument(..., help="A model name or Hub repo pulled before.")) -> None:
    """Delete a pulled model's files from the cache (files another downloaded model uses are kept)."""
    with user_errors():
        from ..catalog import load_catalog
        from ..hub import cached_folder, human_size, pulled_files, remove

        sources, bundled = _hub_sources(name)
        if bundled:
            raise DFlashError(f"{name} is bundled with dflash-local; there is nothing to remove.")
        pulled = [s for s in sources if pulled_files(s)]
        if not pulled:
            raise DFlashError(f"{name} is not downloaded.")
        shared = {
            s
            for other in load_catalog().values()
            if other.name != name and not other.bundled and all(cached_folder(x) for x in other.sources())
            for s in other.sources()
        }
        freed = sum(remove(s) for s in pulled if s not in shared)
        kept = [s.repo for s in pulled if s in shared]
        note = f" (kept {', '.join(kept)}: another downloaded model uses it)" if kept else ""
        typer.echo(f"removed {name}: freed {human_size(freed)}{note}")
