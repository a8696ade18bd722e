"""What `dflash models` shows: the catalog's names and the GGUF targets already on this machine, each name whole."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from .catalog import ModelEntry, load_catalog
from .hub import HubSource, human_size, local_size, pulled_files
from .local_models import LocalModel, find_local_models


@dataclass(frozen=True)
class ModelRow:
    """One model as listed: the name to type and what to know about it."""

    name: str
    source: str  # "catalog", or the tool that keeps a local GGUF: "hf-cache", "ollama", "lmstudio", "llama.cpp"
    on_disk: str
    needs: str
    runs_on: str
    about: str
    path: str = ""  # local GGUFs: the file read in place
    projector: str = ""  # the vision projector loaded with it (it takes images): a Hub file, a bundled or local path


SEES_IMAGES = "sees images"


def _about(row: ModelRow) -> str:
    """What to know about a model, marked where it takes images."""
    return " · ".join(part for part in (row.about, SEES_IMAGES if row.projector else "") if part)


def _on_disk(entry: ModelEntry) -> str:
    """bundled, package (assembled offline by an installed package), a size when whole, partial, or -."""
    package = entry.target.package if isinstance(entry.target, HubSource) else None
    if entry.bundled:
        return "bundled"
    pulled = any(pulled_files(s) for s in entry.sources())
    if package and importlib.util.find_spec(package) and not pulled:
        return "package"
    sizes = [local_size(s) for s in entry.sources()]
    return human_size(sum(sizes)) if None not in sizes else ("partial" if pulled else "-")


def _projector(entry: ModelEntry) -> str:
    """Where an entry's projector comes from: repo/FILE on the Hub, or the bundled file; "" for none."""
    if isinstance(entry.mmproj, HubSource):
        return f"{entry.mmproj.repo}/{entry.mmproj.patterns[0]}"
    return str(entry.mmproj or "")


def catalog_rows() -> list[ModelRow]:
    rows = []
    for entry in load_catalog().values():
        needs = f"{entry.memory_gb:g} GB" + (f" ({entry.quantize})" if entry.quantize else "")
        on_disk, projector = _on_disk(entry), _projector(entry)
        rows.append(ModelRow(entry.name, "catalog", on_disk, needs, entry.hardware, entry.summary, projector=projector))
    return rows


def local_row(model: LocalModel) -> ModelRow:
    about = f"{model.architecture} GGUF (plain decoding; pass --drafter to draft)"
    projector = str(model.projector or "")
    return ModelRow(model.name, model.store, human_size(model.size), "", "", about, str(model.path), projector)


def model_rows() -> list[ModelRow]:
    """The catalog's names, then every GGUF target found on disk."""
    return [*catalog_rows(), *(local_row(m) for m in find_local_models())]


def rows_as_json(rows: list[ModelRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def plain_line(row: ModelRow) -> str:
    """One model on one line, tab-separated (name first), for pipes and scripts."""
    fields = (row.name, row.source, row.on_disk, row.needs, _about(row))
    return "\t".join(field.replace("\t", " ") for field in fields)


def render(rows: list[ModelRow], console: Console) -> None:
    """For a terminal: each name on a line of its own, never wrapped, its details indented below."""
    catalog = [r for r in rows if r.source == "catalog"]
    local = [r for r in rows if r.source != "catalog"]
    console.print(Text("dflash models (pull with: dflash pull NAME)", style="bold underline"))
    for row in catalog:
        details = " · ".join(d for d in (f"on disk: {row.on_disk}", f"needs {row.needs}", row.runs_on) if d)
        _entry(console, row.name, [details, _about(row)])
    console.print()
    if not local:
        console.print("No GGUF models found from other tools (Hugging Face cache, ollama, LM Studio, llama.cpp).")
        return
    console.print(Text("GGUF models on this machine (use the name wherever a model name goes)", style="bold underline"))
    for row in local:
        _entry(console, row.name, [f"{row.source} · {row.on_disk} · {_about(row)}"])


def _entry(console: Console, name: str, details: list[str]) -> None:
    console.print(Text(name, style="bold cyan"), soft_wrap=True)  # soft_wrap: rich never breaks the name
    for detail in details:
        if detail:
            console.print(Padding(Text(detail, style="dim", overflow="fold"), (0, 0, 0, 2), expand=False))
