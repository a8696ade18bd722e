"""The dflash CLI run in the test's own process (Typer's CliRunner): exit status, stdout and stderr apart."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub  # noqa: F401  its log handler binds to the stderr of the moment it is imported: not a runner's
import torch
from typer.testing import CliRunner, Result

from dflash_local import cli


def invoke(*args: str | Path, env: dict[str, str | None] | None = None, input: str | None = None) -> Result:
    """`dflash ARGS` in this process, with `env` over the environment (None removes a variable) and `input` on
    stdin. The process-wide choice a command makes (torch's threads) comes back afterwards."""
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})}, input=input)
    finally:
        torch.set_num_threads(threads)
