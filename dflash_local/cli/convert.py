"""`dflash convert`: an HF-layout target to one GGUF file, quantized by llama.cpp's own quantizer."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import DFlashError
from .app import user_errors


def convert(
    source: Path = typer.Argument(..., help="HF-layout Llama/Qwen3 target folder."),
    out: Path = typer.Option(..., "--out", help="The GGUF file to write."),
    kind: str = typer.Option("f16", "--type", help="f16, bf16, q8_0, q6_k, q5_k_m, q4_k_m or q4_0."),
) -> None:
    """Convert a target to one GGUF file, quantized by llama.cpp's own quantizer."""
    with user_errors():
        try:
            from ..gguf.convert import convert as convert_to_gguf
        except ImportError:
            raise DFlashError("dflash convert needs llama-cpp-python and gguf (dflash-local[gguf]).") from None

        path = convert_to_gguf(source, out, kind)
        typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {kind})")
