"""`dflash export`: a drafter for vLLM, SGLang (z-lab's layout) or llama-server (a drafter GGUF), with its serving
line."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import user_errors
from .options import Offline, Token


def export(
    drafter: str = typer.Argument(..., help="Drafter folder, Hub repo (owner/name) or catalog name (its drafter)."),
    to: str = typer.Option(..., "--to", help="vllm, sglang or gguf (llama-server's -md)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder (vllm, sglang) or .gguf file to write."),
    target: Optional[str] = typer.Option(
        None, "--target", help="The target it drafts for: named in the serving line; the GGUF target for --to gguf."
    ),
    offline: Offline = False,
    token: Token = None,
) -> None:
    """Export a drafter for vLLM, SGLang or llama-server and print the command that serves it there."""
    with user_errors():
        from ..export import export_drafter
        from .files import drafter_folder

        exported = export_drafter(drafter_folder(drafter, offline, token), to, out, target)
        typer.echo(f"wrote {exported.path}")
        typer.echo(exported.serve)
