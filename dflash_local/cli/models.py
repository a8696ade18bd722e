"""The commands that manage models on disk: `dflash pull`, `dflash models` and `dflash rm`."""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import DFlashError
from .app import user_errors
from .files import check_storage


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
    offline: bool = typer.Option(False, "--offline", help="Do not download: check what is already pulled."),
    token: Optional[str] = typer.Option(
        None, "--token", help="Hugging Face token for gated repos (default: HF_TOKEN)."
    ),
) -> None:
    """Download a model (target + drafter) into the Hugging Face cache: resumable, verified, only needed files."""
    with user_errors():
        from ..downloads import Downloader
        from ..hub import HubUnreachable, cached_folder, human_size, local_size

        sources, bundled = _hub_sources(name)
        if bundled:
            typer.echo(f"{name} is bundled with dflash-local: nothing to download.")
            return
        if not offline:
            check_storage()
        downloader = Downloader(token, offline)
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


def list_models() -> None:
    """The model catalog: what each name is, what it needs, and what is downloaded."""
    with user_errors():
        import importlib.util

        from rich.console import Console
        from rich.table import Table

        from ..catalog import load_catalog
        from ..hub import HubSource, human_size, local_size, pulled_files

        table = Table(title="dflash models (pull with: dflash pull NAME)")
        for column in ("name", "backend", "on disk", "needs", "runs on", "what"):
            table.add_column(column, overflow="fold")
        for entry in load_catalog().values():
            package = entry.target.package if isinstance(entry.target, HubSource) else None
            if entry.bundled:
                disk = "bundled"
            elif package and importlib.util.find_spec(package) and not any(pulled_files(s) for s in entry.sources()):
                disk = "package"  # the installed package assembles the target offline
            else:
                sizes = [local_size(s) for s in entry.sources()]
                partial = any(pulled_files(s) for s in entry.sources())
                disk = human_size(sum(sizes)) if None not in sizes else ("partial" if partial else "-")
            needs = f"{entry.memory_gb:g} GB" + (f" ({entry.quantize})" if entry.quantize else "")
            table.add_row(entry.name, entry.backend, disk, needs, entry.hardware, entry.summary)
        Console().print(table)


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
