"""Downloads from the Hugging Face Hub into its standard cache: only the files needed, verified, resumable."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import importlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Protocol, TypeVar
from urllib.parse import urlsplit

from .atomic import write_text_atomic
from .errors import DFlashError
from .local_models import file_digest, find_copy
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
DISK_MARGIN = 1.02  # keep 2% headroom over the bytes still to download
ATTEMPTS = 5  # tries in a row (counted from the last one that brought new bytes) before a pull gives up
FIRST_DELAY = 0.2  # seconds before the first retry, doubling before each next one
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
T = TypeVar("T")


class HubUnreachable(DFlashError):
    """The Hub (HF_ENDPOINT) could not be reached."""


@dataclass(frozen=True)
class HubSource:
    """A Hub repo and the file patterns to take from it (never the whole repo, never code)."""

    repo: str
    patterns: tuple[str, ...] = MODEL_FILES
    revision: str = "main"
    package: str | None = None  # an installable Python package that assembles the same file offline (catalog)

    def wants(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name.lower(), pattern.lower()) for pattern in self.patterns)


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


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


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


def _read_manifest(source: HubSource) -> dict:
    path = _manifest_path(source)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_manifest(source: HubSource, commit: str, files: dict[str, int]) -> None:
    """Record which files (name -> size) of source are whole in the cache, written atomically."""
    manifest = {"repo": source.repo, "revision": source.revision, "commit": commit, "files": files}
    write_text_atomic(_manifest_path(source), json.dumps(manifest))


def pulled_files(source: HubSource) -> dict[str, int]:
    """Names and sizes of source's files that a completed pull recorded (whole or not now)."""
    return {n: size for n, size in _read_manifest(source).get("files", {}).items() if source.wants(n)}


def cached_folder(source: HubSource) -> Path | None:
    """The snapshot folder of a completed, verified pull of source, if its files are all still whole on disk."""
    manifest = _read_manifest(source)
    if not manifest:
        return None
    folder = repo_folder(source.repo) / "snapshots" / manifest["commit"]
    wanted = {name: size for name, size in manifest["files"].items() if source.wants(name)}
    if not all(any(fnmatch.fnmatch(n.lower(), p.lower()) for n in wanted) for p in _required(source)):
        return None
    for name, size in wanted.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return folder


def _required(source: HubSource) -> tuple[str, ...]:
    """Patterns that must match at least one file: config and weights, or the explicit files asked for."""
    if source.patterns in (MODEL_FILES, DRAFTER_FILES):
        return ("config.json", "*.safetensors")
    return source.patterns


def remote_files(source: HubSource, token: str | None) -> tuple[str, list[RemoteFile]]:
    """The commit the revision points at and the repo files source wants, with sizes and hashes."""
    from huggingface_hub import HfApi, constants

    api = HfApi(endpoint=endpoint())
    with hub_errors(source.repo, token):
        info = with_retries(
            lambda: api.model_info(
                source.repo,
                revision=source.revision,
                files_metadata=True,
                token=token,
                timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
            )
        )
    files = [
        RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
        for s in info.siblings or []
        if source.wants(s.rfilename)
    ]
    unsafe = [f.name for f in files if f.name.startswith("/") or ".." in Path(f.name).parts]
    if unsafe:
        raise DFlashError(f"{source.repo} lists a file outside the repo ({unsafe[0]}); refusing to download.")
    all_names = sorted(s.rfilename for s in info.siblings or [])
    for pattern in _required(source):
        if not any(fnmatch.fnmatch(f.name.lower(), pattern.lower()) for f in files):
            quants = sorted({n.removesuffix(".gguf").rsplit("-", 1)[-1] for n in all_names if n.endswith(".gguf")})
            if quants and not pattern.endswith(".gguf"):
                raise DFlashError(
                    f"{source.repo} holds GGUF files: name one, e.g. {source.repo}:{quants[0]} ({', '.join(quants)})."
                )
            raise DFlashError(f"{source.repo} has no file matching '{pattern}' (it has: {', '.join(all_names[:12])}).")
    return info.sha, files


def file_is_whole(path: Path, remote: RemoteFile) -> bool:
    """Size and content hash of a downloaded file match what the Hub says."""
    if not path.is_file() or path.stat().st_size != remote.size:
        return False
    if remote.sha256:
        digest = hashlib.sha256()
        expected = remote.sha256
    elif remote.blob_id:
        digest = hashlib.sha1(f"blob {remote.size}\0".encode())
        expected = remote.blob_id
    else:
        return True
    return file_digest(path, digest) == expected


def _forget(path: Path, repo: str) -> int:
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


def _link_local_copies(folder: Path, missing: list[RemoteFile], repo: str) -> dict[str, Path]:
    """For each missing GGUF whose size and sha256 match a file already on this machine (ollama, LM Studio, another
    repo...), a snapshot link to that file instead of a download: {name: the file linked to}."""
    found = {}
    for remote in missing:
        copy = find_copy(remote.size, remote.sha256) if remote.sha256 and remote.name.endswith(".gguf") else None
        if copy is not None:
            path = folder / remote.name
            _forget(path, repo)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(copy)
            found[remote.name] = copy
    return found


def _partial_bytes(repo: str) -> int:
    blobs = repo_folder(repo) / "blobs"
    return sum(p.stat().st_size for p in blobs.glob("*.part")) if blobs.is_dir() else 0


def check_disk_space(needed: int, folder: Path) -> None:
    """Fail before downloading when the cache's disk cannot hold what is still to come."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed * DISK_MARGIN > free:
        raise DFlashError(
            f"Not enough disk space in {folder}: {human_size(needed)} to download, {human_size(free)} free."
        )


class ProgressBar(Protocol):
    """What a download drives: a tqdm-shaped bar, made with total= and initial= byte counts."""

    def update(self, n: int) -> object: ...

    def close(self) -> object: ...


ProgressFactory = Callable[[str], Callable[..., ProgressBar]]


def pull(source: HubSource, token: str | None = None, progress: ProgressFactory | None = None) -> PullReport:
    """Download what source needs that is not already whole in the cache; verify every file."""
    commit, files = remote_files(source, token)
    folder = repo_folder(source.repo) / "snapshots" / commit
    missing = [f for f in files if not file_is_whole(folder / f.name, f)]
    report = PullReport(folder, files)
    report.found = _link_local_copies(folder, missing, source.repo)
    missing = [f for f in missing if f.name not in report.found]
    check_disk_space(sum(f.size for f in missing) - _partial_bytes(source.repo), cache_dir())
    for remote in missing:
        path = folder / remote.name
        if path.exists():
            _forget(path, source.repo)
            report.refetched.append(remote.name)
        bar = progress(remote.name) if progress else None
        for attempt in range(2):
            with hub_errors(source.repo, token), _giving_up(f"{source.repo}/{remote.name}"):
                with_retries(
                    partial(download, source.repo, remote.name, commit, token, bar),
                    partial(_partial_bytes, source.repo),
                )
            if file_is_whole(path, remote):
                break
            _forget(path, source.repo)
            if attempt == 1:
                raise DFlashError(f"{source.repo}/{remote.name} failed verification twice (size or sha256 differ).")
        report.downloaded.append(remote.name)
    refs = repo_folder(source.repo) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / source.revision).write_text(commit)
    old = _read_manifest(source)
    known = old.get("files", {}) if old.get("commit") == commit else {}
    _write_manifest(source, commit, known | {f.name: f.size for f in files})
    return report


def http_client() -> ModuleType:
    """The package of the HTTP client huggingface_hub runs on (httpx2 for 2.x), for its error classes.

    Taken from huggingface_hub's own session, so dflash never names (or depends on) a transport package itself.
    """
    from huggingface_hub import get_session

    return importlib.import_module(type(get_session()).__module__.partition(".")[0])


def _transient(exc: BaseException) -> bool:
    """Whether a failure may pass by itself: a network error, a timeout, or a 408/429/5xx answer."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in RETRY_STATUSES
    return isinstance(exc, http_client().TransportError)


def with_retries(action: Callable[[], T], progress: Callable[[], int] = lambda: 0) -> T:
    """Run action, retrying transient failures after 0.2 s, 0.4 s, ...; give up after ATTEMPTS in a row.

    A failed try after which progress() grew (bytes kept in a `.part` file) starts the count and the delay again.
    """
    failures, delay = 0, FIRST_DELAY
    while True:
        before = progress()
        try:
            return action()
        except Exception as exc:
            if not _transient(exc):
                raise
            if progress() > before:
                failures, delay = 0, FIRST_DELAY
            failures += 1
            if failures >= ATTEMPTS:
                raise
        time.sleep(delay)
        delay *= 2


@contextmanager
def _giving_up(what: str) -> Iterator[None]:
    """Turn a download's last transient failure into one sentence that says the next pull resumes."""
    try:
        yield
    except Exception as exc:
        if not _transient(exc):
            raise
        status = getattr(getattr(exc, "response", None), "status_code", None)
        timed_out = isinstance(exc, http_client().TimeoutException)
        reason = f"the server answered {status}" if status else "timed out" if timed_out else "the connection failed"
        raise HubUnreachable(
            f"{what}: the download failed {ATTEMPTS} times in a row ({reason}); "
            "pull again and it resumes where it stopped."
        ) from None


def download(
    repo: str, name: str, commit: str, token: str | None, bar: Callable[..., ProgressBar] | None = None
) -> Path:
    """Fetch one file into the Hub cache layout (blobs/ + snapshots/ link), resuming a part `.part` blob."""
    from filelock import FileLock
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo, name, revision=commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, endpoint=endpoint())
    folder = repo_folder(repo)
    blob = folder / "blobs" / meta.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = cache_dir() / ".locks" / folder.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if not blob.exists():
            part = blob.with_name(blob.name + ".part")
            _fetch(meta.location, part, meta.size, _file_headers(url, meta.location, token), bar)
            os.replace(part, blob)
    pointer = folder / "snapshots" / commit / name
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    return pointer


def _file_headers(url: str, location: str, token: str | None) -> dict[str, str]:
    """Headers for a file GET: uncompressed bytes (so ranges line up), and the token only for the Hub's own host."""
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"
    if urlsplit(location)[:2] != urlsplit(url)[:2]:  # a CDN the Hub redirected to: signed URL, no token
        headers.pop("authorization", None)
    return headers


def _fetch(
    url: str, part: Path, size: int | None, headers: dict[str, str], bar: Callable[..., ProgressBar] | None
) -> None:
    """Stream url onto the end of part, asking (with a Range header) only for the bytes it lacks."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.utils import hf_raise_for_status

    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if size is not None and have == size:
        return
    if have:
        headers = {**headers, "Range": f"bytes={have}-"}
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with get_session().stream("GET", url, headers=headers, timeout=timeout, follow_redirects=True) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        if response.status_code != 206:
            have = 0  # the server ignored the range and sends the whole file
        with open(part, "ab" if have else "wb") as handle:
            _append(response.iter_bytes(), handle, bar(total=size, initial=have) if bar else None)


def _append(chunks: Iterable[bytes], handle: BinaryIO, bar: ProgressBar | None) -> None:
    """Write chunks to handle as they arrive, advancing the progress bar."""
    try:
        for chunk in chunks:
            handle.write(chunk)
            if bar:
                bar.update(len(chunk))
    finally:
        if bar:
            bar.close()


@contextmanager
def hub_errors(repo: str, token: str | None) -> Iterator[None]:
    """Turn huggingface_hub and network failures into one sentence a person can act on."""
    from huggingface_hub import errors as hub

    try:
        yield
    except hub.GatedRepoError:
        page = f"{endpoint()}/{repo}"
        if token or os.environ.get("HF_TOKEN"):
            raise DFlashError(
                f"Your Hugging Face token has no access to the gated repo {repo}: accept its terms at {page}."
            ) from None
        raise DFlashError(f"{repo} is gated: accept its terms at {page}, then set HF_TOKEN or pass --token.") from None
    except hub.RepositoryNotFoundError:
        raise DFlashError(f"No model repo '{repo}' at {endpoint()} (if it is private, set HF_TOKEN).") from None
    except hub.RevisionNotFoundError:
        raise DFlashError(f"{repo} has no such revision.") from None
    except hub.RemoteEntryNotFoundError as exc:
        raise DFlashError(f"A file is missing from {repo} on the Hub ({exc.response.url}).") from None
    except (hub.OfflineModeIsEnabled, hub.LocalEntryNotFoundError, http_client().TransportError):
        raise HubUnreachable(
            f"Cannot reach the Hugging Face Hub at {endpoint()}: check the network (or HF_ENDPOINT), "
            "or use --offline with models already pulled."
        ) from None
    except hub.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise DFlashError(f"The Hub answered {status} for {repo}; try again later.") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DFlashError(
                f"The disk holding {cache_dir()} is full: free some space and pull again (the download resumes)."
            ) from None
        raise


def remove(source: HubSource) -> int:
    """Delete source's files from the cache (blobs other repos' snapshots still use stay); return bytes freed."""
    manifest = _read_manifest(source)
    folder = repo_folder(source.repo)
    freed = 0
    if manifest:
        snapshot = folder / "snapshots" / manifest["commit"]
        for name in manifest["files"]:
            if source.wants(name) and (snapshot / name).exists():
                freed += _forget(snapshot / name, source.repo)
        remaining = {n: s for n, s in manifest["files"].items() if not source.wants(n)}
        if remaining:
            _write_manifest(source, manifest["commit"], remaining)
        else:
            _manifest_path(source).unlink(missing_ok=True)
    if folder.is_dir() and not any(p.is_file() for p in (folder / "snapshots").rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def local_size(source: HubSource) -> int | None:
    """Bytes on disk of a completed pull of source, or None when it is not (fully) downloaded."""
    return sum(pulled_files(source).values()) if cached_folder(source) else None
