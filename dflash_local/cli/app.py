"""The `dflash` Typer app, its --version, and the one way a user's mistake ends: `error: ...`, exit status 1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..errors import DFlashError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Lossless block-diffusion speculative decoding (DFlash) on your own machine.",
)


def _print_version(wanted: bool) -> None:
    """--version: print the version and exit while parsing, before click asks for a command."""
    if wanted:
        from .. import __version__

        typer.echo(f"dflash-local {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn DFlashError into one line on stderr and exit status 1."""
    try:
        yield
    except DFlashError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
