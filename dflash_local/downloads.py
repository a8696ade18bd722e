"""Pulling Hub files for the CLI: rich progress bars per file, a summary line, and --offline refusal."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .errors import DFlashError
from .hub import HubSource, ProgressFactory, PullReport, human_size, pull


class Downloader:
    """Fetches Hub sources into the cache with progress bars; with offline=True it refuses instead."""

    def __init__(self, token: str | None = None, offline: bool = False, console: Console | None = None) -> None:
        self.token = token
        self.offline = offline
        self.console = console or Console(stderr=True)

    def __call__(self, source: HubSource) -> Path:
        """The local folder of source, pulling it first (the resolver calls this for files not cached yet)."""
        if self.offline:
            raise DFlashError(
                f"{source.repo} is not downloaded (or not completely) and --offline is set: "
                "run `dflash pull` while online first."
            )
        return self.pull(source).folder

    def pull(self, source: HubSource) -> PullReport:
        """Download what is missing from source, one progress bar per file, then say what happened."""
        self.console.print(f"pulling [bold]{source.repo}[/bold] ({', '.join(source.patterns)})")
        columns = (
            TextColumn("  {task.description}", justify="left"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console) as progress:
            report = pull(source, self.token, _bar_factory(progress))
        for name, copy in report.found.items():
            self.console.print(f"  {name}: already on this machine at {copy}, used in place", soft_wrap=True)
        for name in report.refetched:
            self.console.print(f"  {name}: was corrupted or truncated in the cache, fetched again")
        fresh = sum(f.size for f in report.files if f.name in report.downloaded)
        whole = len(report.files) - len(report.downloaded)
        self.console.print(
            f"  verified {len(report.files)} files (size + sha256): {len(report.downloaded)} downloaded "
            f"({human_size(fresh)}), {whole} already in the cache"
        )
        return report


def _bar_factory(progress: Progress) -> ProgressFactory:
    """Per file, a tqdm-shaped class that hub.download drives and rich draws; a retry resumes the file's one bar."""

    def factory(name: str) -> type:
        task: list[TaskID] = []

        class Bar:
            def __init__(self, *, total: int | None = None, initial: int = 0) -> None:
                if not task:
                    task.append(progress.add_task(name, total=total))
                progress.update(task[0], total=total, completed=initial)

            def update(self, n: int) -> None:
                progress.advance(task[0], n)

            def close(self) -> None:
                progress.refresh()

        return Bar

    return factory
