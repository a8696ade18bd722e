"""Pulling Hub files for the CLI: progress bars while a terminal watches, a report once a pull is whole, and
--offline refusal. A pull that fails leaves nothing on the terminal but its one error line."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from .errors import DFlashError
from .hub import HubSource, PullReport, human_size
from .hub_pull import ProgressFactory, pull


class Downloader:
    """Fetches Hub sources into the cache; with offline=True it refuses instead. Bars are drawn on `console` only
    when it is a terminal, and cleared when the pull ends, whole or not; what a whole pull did goes to `report`
    (default: the console)."""

    def __init__(
        self,
        token: str | None = None,
        offline: bool = False,
        console: Console | None = None,
        report: Console | None = None,
    ) -> None:
        self.token = token
        self.offline = offline
        self.console = console or Console(stderr=True)
        self.report = report or self.console

    def __call__(self, source: HubSource) -> Path:
        """The local folder of source, pulling it first (the resolver calls this for files not cached yet)."""
        if self.offline:
            raise DFlashError(
                f"{source.repo} is not downloaded (or not completely) and --offline is set: "
                "run `dflash pull` while online first."
            )
        return self.pull(source).folder

    def pull(self, source: HubSource) -> PullReport:
        """Download what is missing from source (one bar per file on a terminal), then say what happened."""
        heading = f"{source.repo} ({', '.join(source.patterns)})"
        columns = (
            TextColumn("  {task.description}", justify="left"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        progress = Progress(*columns, console=self.console)
        display = Group(Text(f"pulling {heading}"), progress)
        with Live(display, console=self.console, transient=True) if self.console.is_terminal else nullcontext():
            report = pull(source, self.token, _bar_factory(progress))
        lines = [f"pulled {heading}"]
        lines += [f"  {name}: already on this machine at {copy}, used in place" for name, copy in report.found.items()]
        lines += [f"  {name}: was corrupted or truncated in the cache, fetched again" for name in report.refetched]
        fresh = sum(f.size for f in report.files if f.name in report.downloaded)
        whole = len(report.files) - len(report.downloaded)
        lines.append(
            f"  verified {len(report.files)} files (size + sha256): {len(report.downloaded)} downloaded "
            f"({human_size(fresh)}), {whole} already in the cache"
        )
        for line in lines:
            self.report.print(line, soft_wrap=True, highlight=False, markup=False)
        return report


def _bar_factory(progress: Progress) -> ProgressFactory:
    """Per file, a tqdm-shaped class that a download (ours or hf-xet's) drives and rich draws; a retry resumes the
    file's one bar."""

    def factory(name: str) -> type:
        task: list[TaskID] = []

        class Bar:
            def __init__(self, *, total: int | None = None, initial: int = 0, **_: object) -> None:
                if not task:
                    task.append(progress.add_task(name, total=total))
                progress.update(task[0], total=total, completed=initial)

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *_: object) -> None:
                """Nothing to release: the live display redraws the bar's last state on its own."""

            def update(self, n: int) -> None:
                progress.advance(task[0], n)

        return Bar

    return factory
