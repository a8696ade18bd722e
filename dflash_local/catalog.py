"""Model names users type (models/catalog.toml), resolved to local target and drafter paths."""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import json
import os
import re
import tomllib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from .atomic import write_text_atomic
from .errors import DFlashError
from .hub import DRAFTER_FILES, MODEL_FILES, HubSource, cached_folder
from .local_models import OLLAMA_PREFIX, check_loadable, file_digest, local_projector, ollama_model
from .paths import cache_dir

MODELS_DIR = Path(str(files("dflash_local.models")))  # models/ in the source tree; package data in a wheel
MTP = "mtp"  # --drafter mtp: the target's own multi-token-prediction layers
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
    thinking: bool | None = None  # whether the drafter was trained with the template's thinking on (None: unsaid)
    mmproj: Source | None = None  # the target's vision projector (an mmproj GGUF): images in the prompt

    def sources(self) -> list[HubSource]:
        """What pull fetches: the Hub sources (bundled folders come with dflash-local)."""
        return [s for s in (self.target, self.drafter, self.mmproj) if isinstance(s, HubSource)]

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
    thinking: bool | None = None  # the catalog drafter's thinking mode; None with another drafter or none said
    mmproj: Path | None = None  # the target's vision projector: the catalog's, or the one its store keeps beside it


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
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise DFlashError(f"The model catalog {path} cannot be read ({exc}).") from None
        entries.update({name: _entry(name, table, path) for name, table in data.items()})
    return entries


ENTRY_KEYS = (
    "summary",
    "backend",
    "target",
    "drafter",
    "prompts",
    "quantize",
    "chat_template",
    "hardware",
    "memory_gb",
    "thinking",
    "shape",
    "weights",
    "mmproj",
)
SOURCE_KEYS = ("repo", "files", "revision", "package")
CATALOG_BACKENDS = ("auto", "torch", "llamacpp")
CATALOG_QUANTIZE = ("int4", "nf4")  # quant.QUANT_TYPES: a torch target's linears quantized when it loads


def _show(value: object) -> str:
    """A TOML value about as the user wrote it, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _entry(name: str, table: object, path: Path) -> ModelEntry:
    """One catalog table as a ModelEntry, or one sentence naming the file, the entry and what is wrong."""
    where = f"{path}: entry '{name}'"
    if not isinstance(table, dict):
        raise DFlashError(f"{where} must be a table ([{name}] with a target), got {_show(table)}.")
    _known_keys(table, ENTRY_KEYS, where)
    if "target" not in table:
        raise DFlashError(f"{where} has no target.")
    for key in ("summary", "chat_template", "hardware"):
        if not isinstance(table.get(key, ""), str):
            raise DFlashError(f"{where}: {key} must be a string, got {_show(table[key])}.")
    backend = table.get("backend", "auto")
    if backend not in CATALOG_BACKENDS:
        raise DFlashError(f"{where}: backend must be {', '.join(CATALOG_BACKENDS)}, got {_show(backend)}.")
    quantize = table.get("quantize")
    if quantize not in (None, *CATALOG_QUANTIZE):
        raise DFlashError(f"{where}: quantize must be 'int4', 'nf4' or left out, got {_show(quantize)}.")
    memory = _memory_gb(table, where)
    thinking = table.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise DFlashError(f"{where}: thinking must be true or false, got {_show(thinking)}.")
    base = path.parent
    mmproj = _projector(table["mmproj"], base, backend, f"{where}: mmproj") if "mmproj" in table else None
    return ModelEntry(
        name=name,
        summary=table.get("summary", ""),
        backend=backend,
        target=_source(table["target"], base, MODEL_FILES, f"{where}: target"),
        drafter=_source(table["drafter"], base, DRAFTER_FILES, f"{where}: drafter") if "drafter" in table else None,
        prompts=_bundled(table["prompts"], base, f"{where}: prompts") if "prompts" in table else None,
        quantize=quantize,
        chat_template=table.get("chat_template", ""),
        hardware=table.get("hardware", ""),
        memory_gb=float(memory),
        thinking=thinking,
        mmproj=mmproj,
    )


def _projector(value: object, base: Path, backend: str, where: str) -> Source:
    """An entry's mmproj: "bundled:FILE.gguf", or { repo, files = ["FILE.gguf"] } naming one GGUF file."""
    if backend == "torch":
        raise DFlashError(f"{where}: a projector needs a GGUF target (backend llamacpp), not backend torch.")
    if isinstance(value, dict) and "files" not in value:
        raise DFlashError(f'{where} must name its file: {{ repo = "owner/name", files = ["mmproj-....gguf"] }}.')
    source = _source(value, base, (), where)
    names = [source.name] if isinstance(source, Path) else list(source.patterns)
    if len(names) != 1 or not names[0].endswith(".gguf") or any(c in names[0] for c in "*?["):
        raise DFlashError(f"{where} must name one .gguf file, got {_show(value)}.")
    return source


def _memory_gb(table: dict, where: str) -> float:
    """memory_gb as written, or estimated from shape (a known architecture) and weights (how the target is stored)."""
    from .defaults import DEFAULT_CONTEXT
    from .memory_estimate import WEIGHT_KINDS, estimate_shape
    from .shapes import SHAPES

    if "shape" not in table and "weights" not in table:
        memory = table.get("memory_gb", 0.0)
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory < 0:
            raise DFlashError(f"{where}: memory_gb must be a number of GB (0 or more), got {_show(memory)}.")
        return float(memory)
    if "memory_gb" in table:
        raise DFlashError(f"{where}: give memory_gb or shape and weights, not both.")
    shape, weights = table.get("shape"), table.get("weights")
    if shape not in SHAPES:
        raise DFlashError(f"{where}: shape must be one of {', '.join(SHAPES)}, got {_show(shape)}.")
    if weights not in WEIGHT_KINDS:
        raise DFlashError(f"{where}: weights must be one of {', '.join(WEIGHT_KINDS)}, got {_show(weights)}.")
    return round(estimate_shape(shape, weights, DEFAULT_CONTEXT).total_gb, 1)


def _known_keys(table: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise DFlashError(f"{where} has an unknown key '{unknown[0]}' (known: {', '.join(known)}).")


def _bundled(value: object, base: Path, where: str) -> Path:
    if isinstance(value, str) and value.startswith("bundled:"):
        return base / value.removeprefix("bundled:")
    raise DFlashError(f'{where} must be "bundled:PATH", got {_show(value)}.')


def _source(value: object, base: Path, default_files: tuple[str, ...], where: str) -> Source:
    """A "bundled:PATH" string or a { repo, files, revision } table, checked."""
    if not isinstance(value, dict):
        if isinstance(value, str) and value.startswith("bundled:"):
            return _bundled(value, base, where)
        raise DFlashError(f'{where} must be "bundled:PATH" or {{ repo = "owner/name" }}, got {_show(value)}.')
    _known_keys(value, SOURCE_KEYS, where)
    if "repo" not in value:
        raise DFlashError(f"{where} has no repo.")
    repo = value["repo"]
    if not isinstance(repo, str) or not is_repo_name(repo):
        raise DFlashError(f"{where}: repo must be a valid Hub repo name (owner/name), got {_show(repo)}.")
    files = value.get("files", list(default_files))
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise DFlashError(f"{where}: files must be a non-empty list of file names or patterns, got {_show(files)}.")
    revision = value.get("revision", "main")
    if not isinstance(revision, str) or not revision:
        raise DFlashError(f"{where}: revision must be a branch, tag or commit name, got {_show(revision)}.")
    package = value.get("package")
    if package is not None and not (isinstance(package, str) and package.isidentifier()):
        raise DFlashError(f"{where}: package must be a Python package name, got {_show(package)}.")
    return HubSource(repo, tuple(files), revision, package)


def is_repo_name(name: str) -> bool:
    """Whether name is a Hub repo id of the form owner/name, by huggingface_hub's own rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def repo_source(name: str, default_files: tuple[str, ...] = MODEL_FILES) -> HubSource:
    """owner/name, or owner/name:QUANT for one quantization out of a GGUF repo."""
    repo, _, quant = name.partition(":")
    return HubSource(repo, (f"*{quant}*.gguf",) if quant else default_files)


def lookup(name: str) -> ModelEntry | HubSource:
    """A catalog entry, or a Hub repo named owner/name[:QUANT]; unknown names suggest close ones."""
    catalog = load_catalog()
    if name in catalog:
        return catalog[name]
    if REPO_NAME.match(name) and is_repo_name(name.partition(":")[0]) and not Path(name).exists():
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
    if source.package and (assembled := package_file(source.package)) is not None:
        return assembled
    folder = cached_folder(source) or fetch(source)
    ggufs = sorted(p for p in folder.iterdir() if p.suffix == ".gguf" and source.wants(p.name))
    return ggufs[0] if ggufs else folder


def package_file(package: str) -> Path | None:
    """The model file an installed package assembles (its `MODEL_NAME`, `EXPECTED_SHA256` and `assemble(path)`),
    written once into dflash's cache, atomically; None when the package is not installed. A file found there is
    used only if its sha256 is the package's: hashed in full unless its stamp (sha256, size, mtime, written after a
    check) still matches; a corrupted file is assembled again."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        return None
    path = cache_dir() / "packages" / package / str(module.MODEL_NAME)
    expected = str(module.EXPECTED_SHA256)
    if path.is_file() and _verified(path, expected):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        module.assemble(partial)  # which checks the sha256 of what it wrote
        os.replace(partial, path)
    except (OSError, ValueError) as exc:
        raise DFlashError(f"The package {package} could not assemble its model file ({exc}).") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    _stamp(path, expected)
    return path


def _stamp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.sha256.json")


def _stamp(path: Path, sha256: str) -> None:
    """Record that path, at its present size and mtime, was checked to hold sha256."""
    status = path.stat()
    record = {"sha256": sha256, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
    with contextlib.suppress(OSError):  # a stamp not written (another process writing it) costs one hash next time
        write_text_atomic(_stamp_path(path), json.dumps(record))


def _verified(path: Path, sha256: str) -> bool:
    """Whether path holds sha256: its stamp says so for its present size and mtime, or a full hash does (then
    stamped)."""
    status = path.stat()
    want = {"sha256": sha256, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(_stamp_path(path).read_text()) == want:
            return True
    if file_digest(path, hashlib.sha256()) != sha256:
        return False
    _stamp(path, sha256)
    return True


def resolve(name: str, drafter: str | None, fetch) -> ResolvedModel:
    """Turn what the user typed (name, path or repo; optional --drafter path or repo) into local paths.

    fetch(HubSource) -> Path is called for Hub files not yet in the cache (it pulls, or refuses when offline).
    """
    path = local_target(name)
    if path is not None:
        entry = None
        target = path
    else:
        found = lookup(name)
        entry = found if isinstance(found, ModelEntry) else None
        target = local_path(entry.target if entry else found, fetch)
    mmproj = local_projector(name, path) if path is not None else _entry_projector(entry, fetch)
    if drafter == MTP:
        drafter_path = target  # a GGUF drafting for itself: with its MTP layers (drafters.mtp)
    elif drafter is not None:
        drafter_path = _drafter_path(drafter, fetch)
    elif entry is not None and entry.drafter is not None:
        drafter_path = local_path(entry.drafter, fetch)
    else:
        drafter_path = None
    if entry is None:
        return ResolvedModel(target, drafter_path, mmproj=mmproj)
    thinking = entry.thinking if drafter is None else None
    return ResolvedModel(target, drafter_path, entry.backend, entry.prompts, entry.quantize, thinking, mmproj)


def _entry_projector(entry: ModelEntry | None, fetch) -> Path | None:
    """The local file of a catalog entry's projector (pulled now by fetch where it is not yet); None without one."""
    if entry is None or entry.mmproj is None:
        return None
    path = local_path(entry.mmproj, fetch)
    if not path.is_file():
        raise DFlashError(f"The projector of '{entry.name}' is missing from {path}: dflash pull {entry.name} again.")
    return path


def local_target(name: str) -> Path | None:
    """The file or folder a path or an `ollama:NAME[:TAG]` names, read in place; None for other names."""
    if name.startswith(OLLAMA_PREFIX):
        link = ollama_model(name.removeprefix(OLLAMA_PREFIX))
        check_loadable(link, name)
        return link
    path = Path(name).expanduser()
    return path if path.exists() else None


def resolve_drafter(name: str, fetch) -> Path:
    """The local drafter a path, Hub repo or catalog name (the entry's drafter) names."""
    catalog = load_catalog()
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name in catalog:
        if catalog[name].drafter is None:
            raise DFlashError(f"The catalog model '{name}' has no DFlash drafter.")
        return local_path(catalog[name].drafter, fetch)
    if REPO_NAME.match(name) and is_repo_name(name.partition(":")[0]):
        return local_path(repo_source(name, DRAFTER_FILES), fetch)
    raise DFlashError(f"'{name}' is neither a drafter folder, a Hub repo (owner/name) nor a catalog model.")


def _drafter_path(drafter: str, fetch) -> Path:
    path = Path(drafter).expanduser()
    if path.exists():
        return path
    if REPO_NAME.match(drafter) and is_repo_name(drafter.partition(":")[0]):
        return local_path(repo_source(drafter, DRAFTER_FILES), fetch)
    raise DFlashError(f"--drafter {drafter} is neither a folder nor a Hub repo (owner/name).")
