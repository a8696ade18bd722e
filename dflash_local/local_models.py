"""GGUF models other tools already keep on this machine (Hugging Face cache, ollama, LM Studio, llama.cpp's cache),
found where they lie and read in place, never copied."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError
from .paths import cache_dir, state_dir

OLLAMA_PREFIX = "ollama:"
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_PROJECTOR_LAYER = "application/vnd.ollama.image.projector"  # a vision model's mmproj GGUF
NOT_TARGETS = ("clip", "dflash")  # vision projectors and llama.cpp's own DFlash drafters: GGUFs, but not targets
LATER_SPLIT = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")  # a split GGUF is loaded from its first part


@dataclass(frozen=True)
class LocalModel:
    """One GGUF target on disk: the name to type for it, where it lies, which tool keeps it, what it holds."""

    name: str
    path: Path
    store: str  # "hf-cache", "ollama", "lmstudio" or "llama.cpp"
    architecture: str
    size: int
    projector: Path | None = None  # the vision projector its store keeps with it (local_projector)


def ollama_dirs() -> list[Path]:
    """ollama's model folders: OLLAMA_MODELS, the user's, and the Linux service's."""
    folders = [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    if os.environ.get("OLLAMA_MODELS"):
        folders.insert(0, Path(os.environ["OLLAMA_MODELS"]).expanduser())
    return _existing(folders)


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: settings.json's downloadsFolder in its home (~/.lmstudio-home-pointer names a
    moved one), else that home's models/, and the older ~/.cache/lm-studio/models."""
    home = Path.home() / ".lmstudio"
    pointer = Path.home() / ".lmstudio-home-pointer"
    with contextlib.suppress(OSError):
        home = Path(pointer.read_text(errors="replace").strip() or home).expanduser()
    folders = [home / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    try:
        downloads = json.loads((home / "settings.json").read_text()).get("downloadsFolder")
    except (OSError, ValueError, AttributeError):
        downloads = None
    if isinstance(downloads, str) and downloads:
        folders.insert(0, Path(downloads).expanduser())
    return _existing(folders)


def llamacpp_cache_dirs() -> list[Path]:
    """llama.cpp's own download cache (LLAMA_CACHE, else the user cache's llama.cpp), used before it moved to the
    Hugging Face cache."""
    if os.environ.get("LLAMA_CACHE"):
        return _existing([Path(os.environ["LLAMA_CACHE"]).expanduser()])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return _existing([cache / "llama.cpp", Path.home() / "Library" / "Caches" / "llama.cpp"])


def _existing(folders: list[Path]) -> list[Path]:
    seen, out = set(), []
    for folder in folders:
        if folder.is_dir() and folder.resolve() not in seen:
            seen.add(folder.resolve())
            out.append(folder)
    return out


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """[HOST/][NAMESPACE/]MODEL[:TAG] as ollama reads it: (host, namespace, model, tag), defaults filled in."""
    rest, tag = name, "latest"
    if ":" in name.rsplit("/", 1)[-1]:
        rest, tag = name.rsplit(":", 1)
    parts = rest.split("/")
    if not (1 <= len(parts) <= 3) or not all(parts) or not tag or any(p in (".", "..") for p in (*parts, tag)):
        raise DFlashError(f"'{OLLAMA_PREFIX}{name}' is not an ollama model name (NAME[:TAG], e.g. ollama:qwen3:8b).")
    host, namespace = OLLAMA_HOST, OLLAMA_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts
    return host, namespace, model, tag


def ollama_short_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name ollama itself shows: the default host and namespace left out."""
    prefix = "" if host == OLLAMA_HOST else f"{host}/"
    if prefix or namespace != OLLAMA_NAMESPACE:
        prefix += f"{namespace}/"
    return f"{OLLAMA_PREFIX}{prefix}{model}:{tag}"


def _ollama_blob(folder: Path, manifest: Path, media_type: str = OLLAMA_MODEL_LAYER) -> Path | None:
    """The blob of a manifest's layer of media_type (the model's, or its projector's), or None if none is on disk."""
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == media_type:
            digest = str(layer.get("digest", ""))
            if re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
                blob = folder / "blobs" / digest.replace(":", "-")
                return blob if blob.is_file() else None
    return None


def gguf_link(blob: Path) -> Path:
    """A `.gguf` name for an ollama blob (which has none, and loaders go by it): a link in dflash's folder to the
    blob where it lies, made once, atomically."""
    link = state_dir() / "gguf-links" / f"{blob.name}.gguf"
    if link.resolve() != blob.resolve():
        partial = link.with_name(f"{link.name}.{os.getpid()}.partial")
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            partial.unlink(missing_ok=True)
            partial.symlink_to(blob.resolve())
            os.replace(partial, link)
        except OSError as exc:
            raise DFlashError(
                f"Cannot link {blob} into {link.parent} ({exc.strerror}): set DFLASH_HOME to a writable folder."
            ) from None
    return link


def _ollama_manifest(name: str) -> tuple[Path, Path]:
    """(ollama's models folder, the manifest) of `NAME[:TAG]`; one sentence when no store holds it."""
    host, namespace, model, tag = parse_ollama_name(name)
    folders = ollama_dirs()
    for folder in folders:
        manifest = folder / "manifests" / host / namespace / model / tag
        if manifest.is_file():
            return folder, manifest
    looked = ", ".join(str(f) for f in folders) or "no ollama folder exists (OLLAMA_MODELS, ~/.ollama/models)"
    shown = ollama_short_name(host, namespace, model, tag)
    raise DFlashError(f"{shown} is not in ollama's store (looked in: {looked}); `dflash models` lists what is.")


def ollama_model(name: str) -> Path:
    """The blob behind `ollama:NAME[:TAG]` (under a `.gguf` link), read where ollama keeps it; one sentence when
    it is not there."""
    folder, manifest = _ollama_manifest(name)
    blob = _ollama_blob(folder, manifest)
    if blob is None:
        raise DFlashError(f"ollama's manifest {manifest} names no model file that is on disk.")
    return gguf_link(blob)


def ollama_projector(name: str) -> Path | None:
    """The projector blob (an mmproj GGUF, read in place) that ollama keeps for `NAME[:TAG]` as a layer of its
    manifest; None for a model without one."""
    return _ollama_blob(*_ollama_manifest(name), OLLAMA_PROJECTOR_LAYER)


def beside_projector(model: Path) -> Path | None:
    """The projector LM Studio keeps beside a model's GGUF in its folder: an `mmproj*.gguf` file holding a vision
    encoder (GGUF architecture `clip`), the first by name where there are several; None where there is none."""
    from .gguf.file import read_header

    for path in sorted(model.parent.glob("*.gguf")):
        if "mmproj" not in path.name.lower() or path.resolve() == model.resolve():
            continue
        with contextlib.suppress(ValueError, KeyError, OSError, UnicodeDecodeError):
            if str(read_header(path.resolve()).fields.get("general.architecture", "")) == "clip":
                return path
    return None


def local_projector(name: str, path: Path) -> Path | None:
    """The vision projector a store keeps for a model named `name` (found at path): ollama's projector layer, or
    the mmproj GGUF beside a model in an LM Studio folder; None for other models."""
    if name.startswith(OLLAMA_PREFIX):
        return ollama_projector(name.removeprefix(OLLAMA_PREFIX))
    places = (path.resolve(), path.parent.resolve() / path.name)  # the file, or a link in LM Studio's folder
    folders = [folder.resolve() for folder in lmstudio_dirs()]
    if path.is_file() and any(place.is_relative_to(folder) for place in places for folder in folders):
        return beside_projector(path)
    return None


def _ollama_models() -> Iterator[tuple[str, Path]]:
    for folder in ollama_dirs():
        root = folder / "manifests"
        for manifest in sorted(p for p in root.glob("*/*/*/*") if p.is_file()):
            blob = _ollama_blob(folder, manifest)
            if blob is not None:
                yield ollama_short_name(*manifest.relative_to(root).parts), blob


def _gguf_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*.gguf")):
        match = LATER_SPLIT.search(path.name)
        if path.is_file() and not (match and int(match.group(1)) != 1):
            yield path


def _files() -> Iterator[tuple[str, str, Path]]:
    """(store, name, path) of every GGUF file the known tools keep; a path is its own name."""
    hub = cache_dir()
    for repo in sorted(hub.glob("models--*")) if hub.is_dir() else []:
        for path in _gguf_files(repo / "snapshots"):
            yield "hf-cache", str(path), path
    for name, blob in _ollama_models():
        yield "ollama", name, blob
    for folder in lmstudio_dirs():
        for path in _gguf_files(folder):
            yield "lmstudio", str(path), path
    for folder in llamacpp_cache_dirs():
        for path in _gguf_files(folder):
            yield "llama.cpp", str(path), path


def find_local_models() -> list[LocalModel]:
    """Every readable GGUF target on this machine, by the name to type for it."""
    from .gguf.file import read_header

    models = []
    for store, name, path in _files():
        real = path.resolve()
        try:
            architecture = str(read_header(real).fields.get("general.architecture", ""))
        except (ValueError, KeyError, OSError, UnicodeDecodeError):
            continue  # partial or not a GGUF: nothing that loads
        if architecture and architecture not in NOT_TARGETS:
            projector = None
            with contextlib.suppress(DFlashError):  # a listing names what it finds; loading the model says why not
                projector = local_projector(name, path) if store in ("ollama", "lmstudio") else None
            models.append(LocalModel(name, path, store, architecture, real.stat().st_size, projector))
    return models


def file_digest(path: Path, digest: hashlib._Hash) -> str:
    """The hex digest of a file's bytes fed to digest (a hashlib object, perhaps already holding a prefix)."""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def find_copy(size: int, sha256: str) -> Path | None:
    """A GGUF file on this machine with exactly this size and sha256 (hashing only the files of that size)."""
    for _, _, path in _files():
        real = path.resolve()
        if real.stat().st_size == size and file_digest(real, hashlib.sha256()) == sha256:
            return real
    return None


def llama_knows(architecture: str) -> bool:
    """Whether the loaded libllama names this architecture (llama.cpp keeps each name as a C string; a name it
    lacks cannot load, a name it has is left to llama.cpp's own checks)."""
    from .llama_lib import loaded_library

    return architecture.encode() + b"\0" in loaded_library().read_bytes()


def check_loadable(path: Path, name: str) -> None:
    """One sentence when the GGUF behind `name` holds an architecture this llama.cpp cannot load."""
    from .gguf.file import read_gguf

    architecture = read_gguf(path).architecture
    if not llama_knows(architecture):
        raise DFlashError(
            f"{name} ({path.resolve()}) holds a '{architecture}' model, an architecture this llama.cpp cannot load "
            "(ollama's own engine runs some that llama.cpp does not)."
        )
