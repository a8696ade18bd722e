"""The `dflash` command line: parses arguments, calls the engine, renders results."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from .errors import DFlashError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Lossless block-diffusion speculative decoding (DFlash) on your own machine.",
)


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine."""
    if version:
        from . import __version__

        typer.echo(f"dflash-local {__version__}")
        raise typer.Exit()


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn DFlashError into one line on stderr and exit status 1."""
    try:
        yield
    except DFlashError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise DFlashError(f"--prompt-ids must be comma-separated integers, got '{text}'.") from None


@app.command()
def generate(
    target: Path = typer.Option(..., "--target", help="Target model: an HF-layout folder."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs the target's tokenizer)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Prompt as token ids: 1,2,3."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="2..the drafter's trained block size."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding (the baseline)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at end-of-sequence tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    backend: str = typer.Option("auto", "--backend", help="Target backend: auto or torch."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    max_context: int = typer.Option(4096, "--max-context", help="KV cache length in tokens."),
) -> None:
    """Generate one continuation of a prompt, with DFlash drafting or without."""
    with user_errors():
        from .generation import GenerationRequest, load_models, run_request

        if (prompt is None) == (prompt_ids is None):
            raise DFlashError("Give exactly one of --prompt or --prompt-ids.")
        if not no_draft and drafter is None:
            raise DFlashError("Pass --drafter DIR, or --no-draft for plain autoregressive decoding.")
        models = load_models(target, None if no_draft else drafter, backend, device, dtype, max_context)
        request = GenerationRequest(
            prompt=prompt,
            prompt_ids=_parse_ids(prompt_ids) if prompt_ids is not None else None,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            block_size=block_size,
            draft=not no_draft,
            ignore_eos=ignore_eos,
        )
        on_text = None if as_json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        result = run_request(models, request, on_text=on_text)
        if as_json:
            typer.echo(json.dumps(result))
            return
        if models.tokenizer is None:
            typer.echo(",".join(map(str, result["output_ids"])))
        else:
            typer.echo()
        typer.echo(
            f"[{result['new_tokens']} tokens · tau {result['tau']:.2f} · "
            f"{result['decode_tokens_per_s']:.1f} tok/s decode · prefill {result['prefill_s'] * 1000:.0f} ms]",
            err=True,
        )


def main() -> None:
    """Console-script entry point."""
    app()
