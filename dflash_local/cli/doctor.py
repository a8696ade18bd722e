"""`dflash doctor`: renders dflash_local/doctor.py's checks of this machine (and of a model) as one table."""

from __future__ import annotations

from typing import Optional

import typer

from .app import user_errors


def doctor(
    model: Optional[str] = typer.Argument(
        None, help="A model name, Hub repo, folder or .gguf file: also whether it is downloaded and fits (no download)."
    ),
) -> None:
    """What this machine offers: torch, CUDA/GPU and VRAM, Triton, bitsandbytes, llama.cpp, huggingface_hub, disk."""
    with user_errors():
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        from ..doctor import model_checks, run_checks
        from ..vulkan_probe import expose_software_devices

        expose_software_devices()  # listed, marked as software; only an explicit --device vulkan runs on one

        about_model = model_checks(model) if model is not None else []
        table = Table(show_header=False, box=None)
        marks = {True: "[green]ok[/green]", False: "[red]!![/red]", None: "[dim]--[/dim]"}
        for check in run_checks() + about_model:
            table.add_row(marks[check.ok], check.name, escape(check.found))
        Console().print(table)
