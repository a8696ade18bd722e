"""`dflash bench`: runs dflash_local/bench.py's report per model and renders it (its table, the cost table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..defaults import MAX_NEW_TOKENS
from ..errors import DFlashError
from . import values
from .app import user_errors
from .files import prompt_file, resolve
from .options import (
    BlockSize,
    CacheType,
    CacheTypeK,
    CacheTypeV,
    CpuMoe,
    CudaGraphs,
    DecodeOptions,
    Device,
    Drafter,
    DrafterKind,
    DrafterQuantize,
    DType,
    GpuLayers,
    Kernels,
    Lookup,
    MaxNewTokens,
    ModelOptions,
    Offline,
    Quantize,
    Temperature,
    Threads,
    Token,
    picked,
)

# bench's own options: llama-server beside dflash.
Peer = Annotated[
    Optional[str],
    typer.Option(
        "--peer",
        help="llama-server: also run llama.cpp's own server on the same GGUF, prompts and drafter, plain and "
        "speculative (draft-dflash; draft-mtp where the GGUF has MTP layers).",
    ),
]
PeerBinary = Annotated[
    Optional[Path],
    typer.Option(
        "--peer-binary",
        envvar="DFLASH_LLAMA_SERVER",
        help="The llama-server to run (default: the venv's, built by tools/build_llama_server.sh).",
    ),
]


def bench(
    ctx: typer.Context,
    names: Optional[list[str]] = typer.Argument(
        None, help="Model names (dflash models), Hub repos, folders or .gguf files; default: tiny.", show_default=False
    ),
    prompts: Optional[str] = typer.Option(
        None, "--prompts", help="A JSONL file, or a dataset: gsm8k, humaneval, mt-bench (default: the model's own set)."
    ),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts."),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="Measure this machine's cost per block size afresh and show the table first."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: histogram and tokens/s."),
    drafter: Drafter = None,
    max_new_tokens: MaxNewTokens = MAX_NEW_TOKENS,
    block_size: BlockSize = "auto",
    temperature: Temperature = 0.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos/--stop-at-eos", help="Generate all max-new-tokens.")] = True,
    lookup: Lookup = True,
    device: Device = "auto",
    dtype: DType = "auto",
    kernels: Kernels = "auto",
    cuda_graphs: CudaGraphs = True,
    drafter_kind: DrafterKind = "auto",
    threads: Threads = None,
    gpu_layers: GpuLayers = "auto",
    cpu_moe: CpuMoe = False,
    cache_type: CacheType = "f16",
    cache_type_k: CacheTypeK = None,
    cache_type_v: CacheTypeV = None,
    offline: Offline = False,
    quantize: Quantize = "auto",
    drafter_quantize: DrafterQuantize = "none",
    token: Token = None,
    peer: Peer = None,
    peer_binary: PeerBinary = None,
) -> None:
    """Autoregressive vs the default mode (the DFlash drafter and lookup, as the block policy picks) on the same target,
    prompt by prompt, with each source's share of the tokens; one table per model. With --peer llama-server, a second
    table: llama-server plain and speculative on the same GGUF, each output compared with its own plain one."""
    given = locals()
    with user_errors():
        decode, options = picked(DecodeOptions, given), picked(ModelOptions, given, progress=ctx.obj)
        values.check_numbers(decode.max_new_tokens, seed=decode.seed)
        block_size = decode.block()
        if limit is not None and limit < 1:
            raise DFlashError(f"--limit must be at least 1, got {limit}.")
        if calibrate and block_size is not None:
            raise DFlashError("--calibrate measures the costs behind --block-size auto; drop --block-size.")
        decode.sampling()  # checks them before anything loads
        from ..peer import check_peer

        check_peer(peer, decode.temperature)

        from ..vulkan_probe import expose_for

        expose_for(device)  # before llama.cpp loads: which Vulkan devices it may use
        reports = []
        for model in names or ["tiny"]:
            report = _bench_model(model, prompts, limit, calibrate, as_json, decode, options, peer, peer_binary)
            _show(report, model, len(names or []) > 1, plot_path, as_json)
            reports.append(report)
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports))


def _show(report: dict, model: str, several: bool, plot_path: Path | None, as_json: bool) -> None:
    """One model's report: its plot written where --plot says (the model's name added when there are several), and
    its tables unless the report is JSON."""
    if plot_path is not None:
        from ..bench import plot

        suffix = f"-{Path(model).name}" if several else ""
        plot(report, plot_path.with_name(f"{plot_path.stem}{suffix}{plot_path.suffix}"))
    if not as_json:
        print_bench(report)
        if "peer" in report:
            print_peer(report)


def _bench_model(
    model: str,
    prompts: str | None,
    limit: int | None,
    calibrate: bool,
    as_json: bool,
    decode: DecodeOptions,
    options: ModelOptions,
    peer: str | None = None,
    peer_binary: Path | None = None,
) -> dict:
    """One model's report: load it, calibrate first if asked (the cost table shown unless JSON), run the prompts; with
    a peer, llama-server's runs on the same ones (peer_binary, or the venv's)."""
    from ..bench import calibration_report, read_prompts, run_bench
    from ..generation import memory_guard, recalibrate

    resolved = resolve(model, decode.drafter, options.offline, options.token)
    if peer and not (resolved.target.suffix == ".gguf" and resolved.target.is_file()):
        raise DFlashError(f"--peer llama-server runs a GGUF target: '{model}' is not one (dflash convert makes one).")
    prompt_path = prompt_file(prompts, options.offline, options.token) if prompts else resolved.prompts
    if prompt_path is None:
        raise DFlashError(f"'{model}' has no built-in prompt set: pass --prompts FILE.jsonl or a dataset name.")
    if resolved.drafter is None and not decode.lookup:
        raise DFlashError(f"'{model}' has no drafter: pass --drafter DIR or a Hub repo, or drop --no-lookup.")
    models = options.load(resolved, resolved.drafter, resolved.backend, decode.block() is None)
    calibration = calibration_report(recalibrate(models).costs) if calibrate else None
    if calibration is not None and not as_json:
        print_costs(model, calibration)
    prompt_ids = read_prompts(prompt_path, models, limit)
    with memory_guard(f"A benchmark run of {model}", models.target.device.type):
        report = run_bench(models, prompt_ids, decode.settings(models))
    report["model"] = model
    if peer:
        from ..defaults import block_limit
        from ..peer import find_llama_server, run_peer

        binary = find_llama_server(peer_binary)
        block = block_limit(models.drafter)[0] if models.drafter is not None else None
        # dflash's plain outputs, for llama-server's plain ones, up to the first end of sequence: llama-server's
        # ignore_eos bans the end-of-generation tokens, dflash's --ignore-eos decodes on past them
        ours = [_until(row["output_ids"], models.stop_ids) for row in report["prompts"]]
        peer_args = (decode.max_new_tokens, decode.ignore_eos, options.threads, ours)
        report["peer"] = run_peer(binary, resolved.target, resolved.drafter, block, prompt_ids, *peer_args)
    if calibration is not None:
        report["calibration"] = calibration
    return report


def _until(ids: list[int], stops: frozenset[int]) -> list[int]:
    return next((ids[:at] for at, token in enumerate(ids) if token in stops), ids)


def print_bench(report: dict) -> None:
    """The bench table: per prompt tau, each method's tok/s, the speedup and whether outputs match; then the mean,
    the steps per block size and the acceptance by position."""
    from rich.console import Console
    from rich.table import Table

    names = [name for name in report["mean"] if name != "speedup"]
    labels = {"autoregressive": "AR", "dflash": "drafting"}
    table = Table(title=f"{report['model']}: {report['max_new_tokens']} new tokens, block {report['block_size']}")
    table.add_column("prompt", max_width=28, no_wrap=True)
    table.add_column("tau", justify="right")
    for name in names:
        table.add_column(f"{labels[name]} tok/s", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("identical")
    for row in report["prompts"]:
        rates = [f"{row[n]['decode_tokens_per_s']:.0f}" for n in names]
        table.add_row(
            row["prompt"].splitlines()[0],
            f"{row['dflash']['tau']:.2f}",
            *rates,
            f"{row['speedup']:.2f}x",
            "yes" if row["identical"] else "NO",
        )
    mean = report["mean"]
    table.add_row(
        "mean",
        f"{mean['dflash']['tau']:.2f}",
        *[f"{mean[n]['decode_tokens_per_s']:.0f}" for n in names],
        f"{mean['speedup']:.2f}x",
        "yes" if report["all_identical"] else "NO",
        style="bold",
    )
    used: dict[int, int] = {}
    for row in report["prompts"]:
        for k, count in row["dflash"]["block_histogram"].items():
            used[int(k)] = used.get(int(k), 0) + count
    rates = " ".join(f"{rate:.2f}" for rate in report["dflash_acceptance_by_position"])
    table.caption = (
        "steps by block size k (1 = plain): "
        + " ".join(f"{k}:{n}" for k, n in sorted(used.items()))
        + f"\ndrafting steps that accepted at least j = 1, 2, ... drafts: {rates}"
        + "\ntokens by source: "
        + " ".join(f"{source} {share:.0%}" for source, share in sorted(report["source_shares"].items()))
    )
    Console().print(table)


def print_peer(report: dict) -> None:
    """dflash beside llama-server on the same GGUF and prompts: per engine and mode the mean decode tok/s, tau, and how
    many outputs equal the same engine's plain decoding; a mode that failed shows why."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    count = len(report["prompts"])
    same = sum(row["identical"] for row in report["prompts"])
    table = Table(title=f"{report['model']}: dflash and llama-server, {report['max_new_tokens']} new tokens, T=0")
    for column in ("engine", "mode", "tok/s", "x its plain", "tau", "identical to its plain"):
        table.add_column(column, justify="left" if column in ("engine", "mode") else "right")
    table.add_column("note", max_width=60)
    mean = report["mean"]
    ours = mean["autoregressive"]["decode_tokens_per_s"]
    table.add_row("dflash", "plain", f"{ours:.1f}", "1.00x", "-", "-", "")
    rate, tau = mean["dflash"]["decode_tokens_per_s"], f"{mean['dflash']['tau']:.2f}"
    table.add_row("dflash", "drafting", f"{rate:.1f}", f"{mean['speedup']:.2f}x", tau, f"{same}/{count}", "")
    modes = report["peer"]["modes"]
    theirs = modes["plain"]["mean"]["decode_tokens_per_s"] if modes["plain"]["prompts"] else 0.0
    for name, mode in modes.items():
        done, rate = mode["prompts"], mode["mean"]["decode_tokens_per_s"]
        speedup = f"{rate / theirs:.2f}x" if done and theirs else "-"
        tau = f"{mode['mean']['tau']:.2f}" if done and name != "plain" else "-"
        identical = "-" if mode["identical"] is None else f"{mode['identical']}/{mode['compared']}"
        note = escape(f"failed: {mode['error']}") if mode["error"] else ""  # llama.cpp's words, not rich markup
        table.add_row("llama-server", name, f"{rate:.1f}" if done else "-", speedup, tau, identical, note)
    table.caption = (
        "tok/s: tokens after the first per second of decoding, mean over prompts; tau: mean accepted drafts + 1 per "
        f"drafting step; llama-server: {report['peer']['binary']}"
    )
    same_plain = report["peer"]["modes"]["plain"]["identical_to_dflash_plain"]
    if same_plain is not None:
        table.caption += f"\nllama-server's plain outputs equal to dflash's plain ones: {same_plain}/{count}"
    Console().print(table)


def print_costs(model: str, calibration: dict) -> None:
    """The cost table behind --block-size auto: when it was measured, and per k the calibration's timings (fastest,
    median, slowest, rounds), the fitted target and drafter costs, the step's, and the break-even tokens per step."""
    import statistics
    import time

    from rich.console import Console
    from rich.table import Table

    def timings(samples: list[float]) -> str:
        if not samples:
            return "-"
        return f"{samples[0]:.2f} / {statistics.median(samples):.2f} / {samples[-1]:.2f} ({len(samples)})"

    measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(calibration["measured_at"]))
    table = Table(
        title=f"{model}: cost per step on this machine (--block-size auto), measured {measured}",
        caption="timings: fastest / median / slowest (rounds); the fit: each size's fastest, never falling with k and "
        "at most doubling per doubling of k; sizes not timed are interpolated",
    )
    columns = (
        "k",
        "target timings ms",
        "target ms",
        "drafter timings ms",
        "drafter ms",
        "step ms",
        "tokens to beat plain",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in calibration["sizes"]:
        drafter = f"{row['draft_ms']:.2f}" if row["k"] > 1 else "-"
        table.add_row(
            str(row["k"]),
            timings(row["target_samples_ms"]),
            f"{row['target_ms']:.2f}",
            timings(row["draft_samples_ms"]),
            drafter,
            f"{row['step_ms']:.2f}",
            f"{row['break_even_tokens']:.2f}",
        )
    Console().print(table)
