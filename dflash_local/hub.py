"""What a Hub source is (a repo and the files taken from it) and what the Hub cache holds of it: the files a
completed, verified pull recorded, their size on disk, and their removal."""

from __future__ import annotations

import fnmatch
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_text_atomic
from .paths import cache_dir, state_dir

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
DRAFTER_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


@dataclass(frozen=True)
class HubSource:
    """A Hub repo and the file patterns to take from it (never the whole repo, never code)."""

    repo: str
    patterns: tuple[str, ...] = MODEL_FILES
    revision: str = "main"
    package: str | None = None  # an installable Python package that assembles the same file offline (catalog)

    def wants(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name.lower(), pattern.lower()) for pattern in self.patterns)

    def required(self) -> tuple[str, ...]:
        """Patterns that must match at least one file: config and weights, or the explicit files asked for."""
        if self.patterns in (MODEL_FILES, DRAFTER_FILES):
            return ("config.json", "*.safetensors")
        return self.patterns


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo as the Hub describes it: size and content hash."""

    name: str
    size: int
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # git blob id (sha1) of small files


@dataclass
class PullReport:
    """What a pull did: where the files are and how many bytes came over the network."""

    folder: Path
    files: list[RemoteFile]
    downloaded: list[str] = field(default_factory=list)
    refetched: list[str] = field(default_factory=list)
    found: dict[str, Path] = field(default_factory=dict)  # files already on disk elsewhere, linked, not downloaded


def repo_folder(repo: str) -> Path:
    return cache_dir() / f"models--{repo.replace('/', '--')}"


def human_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _manifest_path(source: HubSource) -> Path:
    return state_dir() / "pulled" / f"{source.repo.replace('/', '--')}@{source.revision}.json"


def read_manifest(source: HubSource) -> dict:
    """What the last completed pull of source recorded: repo, revision, commit and files (name -> size)."""
    try:
        return json.loads(_manifest_path(source).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_manifest(source: HubSource, commit: str, files: dict[str, int]) -> None:
    """Record which files (name -> size) of source are whole in the cache, written atomically."""
    manifest = {"repo": source.repo, "revision": source.revision, "commit": commit, "files": files}
    write_text_atomic(_manifest_path(source), json.dumps(manifest))


def pulled_files(source: HubSource) -> dict[str, int]:
    """Names and sizes of source's files that a completed pull recorded (whole or not now)."""
    return {n: size for n, size in read_manifest(source).get("files", {}).items() if source.wants(n)}


def cached_folder(source: HubSource) -> Path | None:
    """The snapshot folder of a completed, verified pull of source, if its files are all still whole on disk."""
    manifest = read_manifest(source)
    if not manifest:
        return None
    folder = repo_folder(source.repo) / "snapshots" / manifest["commit"]
    wanted = pulled_files(source)
    if not all(any(fnmatch.fnmatch(n.lower(), p.lower()) for n in wanted) for p in source.required()):
        return None
    for name, size in wanted.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return folder


def forget(path: Path, repo: str) -> int:
    """Delete a cached file: the snapshot link and the blob it points to where that is repo's own (a copy found
    elsewhere on disk and linked, not downloaded, stays); the bytes freed."""
    if not path.is_symlink():
        size = path.stat().st_size if path.is_file() else 0
        path.unlink(missing_ok=True)
        return size
    blob = path.resolve()
    path.unlink()
    if blob.parent != (repo_folder(repo) / "blobs").resolve() or not blob.is_file():
        return 0
    size = blob.stat().st_size
    blob.unlink()
    return size


def remove(source: HubSource) -> int:
    """Delete source's files from the cache (blobs other repos' snapshots still use stay); return bytes freed."""
    manifest = read_manifest(source)
    folder = repo_folder(source.repo)
    freed = 0
    if manifest:
        snapshot = folder / "snapshots" / manifest["commit"]
        for name in manifest["files"]:
            if source.wants(name) and (snapshot / name).exists():
                freed += forget(snapshot / name, source.repo)
        remaining = {n: s for n, s in manifest["files"].items() if not source.wants(n)}
        if remaining:
            write_manifest(source, manifest["commit"], remaining)
        else:
            _manifest_path(source).unlink(missing_ok=True)
    if folder.is_dir() and not any(p.is_file() for p in (folder / "snapshots").rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def local_size(source: HubSource) -> int | None:
    """Bytes on disk of a completed pull of source, or None when it is not (fully) downloaded."""
    return sum(pulled_files(source).values()) if cached_folder(source) else None
