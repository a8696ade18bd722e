"""The `dflash` command line: parses arguments, calls the engine, renders results; one module per command."""

from __future__ import annotations

from . import bench, chat, convert, doctor, export, generate, models, serve, train
from .app import app
from .status import StartupStatus

__all__ = ["app", "main"]

# The commands, in the order `dflash --help` lists them.
for command in (generate.generate, chat.chat, serve.serve, bench.bench, convert.convert, models.pull):
    app.command()(command)
app.command(name="models")(models.list_models)
for command in (models.rm, doctor.doctor, train.train, export.export):
    app.command()(command)


def main() -> None:
    """Console-script entry point: a status line on a terminal until the command's first output; loading reports
    its phases to it through the command's context."""
    status = StartupStatus()
    status.start("starting: importing libraries")
    try:
        app(obj=status.show)
    finally:
        status.stop()
