"""The dflash CLI run in the test's own process (Typer's CliRunner): exit status, stdout and stderr apart."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner, Result

from dflash_local import cli


def invoke(*args: str | Path, env: dict[str, str | None] | None = None) -> Result:
    """`dflash ARGS` in this process, with `env` over the environment (None removes a variable)."""
    return CliRunner().invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})
