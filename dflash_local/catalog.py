"""Model names users type (models/catalog.toml), resolved to local target and drafter paths."""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError
from .hub import DRAFTER_FILES, MODEL_FILES, HubSource, cached_folder

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
REPO_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")

Source = Path | HubSource


@dataclass(frozen=True)
class ModelEntry:
    """One catalog name: where its target and drafter come from and what it runs on."""

    name: str
    summary: str
    backend: str
    target: Source
    drafter: Source | None
    prompts: Path | None = None
    quantize: str | None = None
    chat_template: str = ""
    hardware: str = ""
    memory_gb: float = 0.0

    def sources(self) -> list[Source]:
        return [s for s in (self.target, self.drafter) if s is not None]

    @property
    def bundled(self) -> bool:
        return isinstance(self.target, Path)


@dataclass(frozen=True)
class ResolvedModel:
    """Local paths for a target and its drafter, plus how to load the target."""

    target: Path
    drafter: Path | None
    backend: str = "auto"
    prompts: Path | None = None
    quantize: str | None = None


def catalog_paths() -> list[Path]:
    """The bundled catalog, then the user's own (DFLASH_CATALOG), whose names win."""
    extra = os.environ.get("DFLASH_CATALOG")
    return [MODELS_DIR / "catalog.toml", *([Path(extra)] if extra else [])]


def load_catalog() -> dict[str, ModelEntry]:
    """Every entry of the catalog files; bundled paths are relative to the file that names them."""
    entries = {}
    for path in catalog_paths():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise DFlashError(f"The model catalog {path} cannot be read ({exc}).") from None
        entries.update({name: _entry(name, table, path.parent) for name, table in data.items()})
    return entries


def _entry(name: str, table: dict, base: Path) -> ModelEntry:
    try:
        return ModelEntry(
            name=name,
            summary=table.get("summary", ""),
            backend=table.get("backend", "auto"),
            target=_source(table["target"], base, MODEL_FILES),
            drafter=_source(table["drafter"], base, DRAFTER_FILES) if "drafter" in table else None,
            prompts=_source(table["prompts"], base, ()) if "prompts" in table else None,
            quantize=table.get("quantize"),
            chat_template=table.get("chat_template", ""),
            hardware=table.get("hardware", ""),
            memory_gb=float(table.get("memory_gb", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DFlashError(f"Catalog entry '{name}' is malformed ({exc}).") from None


def _source(value: str | dict, base: Path, default_files: tuple[str, ...]) -> Source:
    if isinstance(value, str) and value.startswith("bundled:"):
        return base / value.removeprefix("bundled:")
    if isinstance(value, dict):
        files = tuple(value.get("files", default_files))
        return HubSource(value["repo"], files, value.get("revision", "main"))
    raise ValueError(f"unknown source {value!r}")


def repo_source(name: str, default_files: tuple[str, ...] = MODEL_FILES) -> HubSource:
    """owner/name, or owner/name:QUANT for one quantization out of a GGUF repo."""
    repo, _, quant = name.partition(":")
    return HubSource(repo, (f"*{quant}*.gguf",) if quant else default_files)


def lookup(name: str) -> ModelEntry | HubSource:
    """A catalog entry, or a Hub repo named owner/name[:QUANT]; unknown names suggest close ones."""
    catalog = load_catalog()
    if name in catalog:
        return catalog[name]
    if REPO_NAME.match(name) and not Path(name).exists():
        return repo_source(name)
    close = difflib.get_close_matches(name, list(catalog), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else f" Known models: {', '.join(catalog)}."
    raise DFlashError(f"'{name}' is neither a known model, a Hub repo (owner/name) nor a path.{hint}")


def local_path(source: Source, fetch) -> Path:
    """The local folder (or .gguf file) of a source: bundled, already pulled, or fetched now by fetch()."""
    if isinstance(source, Path):
        if not source.exists():
            raise DFlashError(f"The bundled model files are missing from {source}; reinstall dflash-local.")
        return source
    folder = cached_folder(source) or fetch(source)
    ggufs = sorted(p for p in folder.iterdir() if p.suffix == ".gguf" and source.wants(p.name))
    return ggufs[0] if ggufs else folder


def resolve(name: str, drafter: str | None, fetch) -> ResolvedModel:
    """Turn what the user typed (name, path or repo; optional --drafter path or repo) into local paths.

    fetch(HubSource) -> Path is called for Hub files not yet in the cache (it pulls, or refuses when offline).
    """
    path = Path(name).expanduser()
    if path.exists():
        entry = None
        target = path
    else:
        found = lookup(name)
        entry = found if isinstance(found, ModelEntry) else None
        target = local_path(entry.target if entry else found, fetch)
    if drafter is not None:
        drafter_path = _drafter_path(drafter, fetch)
    elif entry is not None and entry.drafter is not None:
        drafter_path = local_path(entry.drafter, fetch)
    else:
        drafter_path = None
    if entry is None:
        return ResolvedModel(target, drafter_path)
    return ResolvedModel(target, drafter_path, entry.backend, entry.prompts, entry.quantize)


def _drafter_path(drafter: str, fetch) -> Path:
    path = Path(drafter).expanduser()
    if path.exists():
        return path
    if REPO_NAME.match(drafter):
        return local_path(repo_source(drafter, DRAFTER_FILES), fetch)
    raise DFlashError(f"--drafter {drafter} is neither a folder nor a Hub repo (owner/name).")
