"""Pulling a Hub source into the standard cache through huggingface_hub: only the files needed, each verified by
size and sha256, resumable from its partial file, named `<etag>.incomplete` as huggingface_hub names them (one a
killed `hf download` left, `<etag>.<8 hex>.incomplete`, is taken over)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol
from urllib.parse import urlsplit

from .errors import DFlashError
from .hub import HubSource, PullReport, RemoteFile, forget, human_size, read_manifest, repo_folder, write_manifest
from .hub_access import endpoint, giving_up, hub_errors, with_retries
from .local_models import file_digest, find_copy
from .paths import cache_dir

if TYPE_CHECKING:
    from huggingface_hub import HfFileMetadata

DISK_MARGIN = 1.02  # keep 2% headroom over the bytes still to download


class ProgressBar(Protocol):
    """What a download drives while bytes arrive (ours, or hf-xet's as its tqdm_class): a tqdm-shaped bar, used as a
    context manager."""

    def __enter__(self) -> ProgressBar: ...

    def __exit__(self, *_: object) -> None: ...

    def update(self, n: int) -> object: ...


ProgressFactory = Callable[[str], Callable[..., ProgressBar]]  # file name -> a tqdm_class (total=, initial=, ...)


def remote_files(source: HubSource, token: str | None) -> tuple[str, list[RemoteFile]]:
    """The commit the revision points at and the repo files source wants, with sizes and hashes."""
    from huggingface_hub import HfApi, constants

    api = HfApi(endpoint=endpoint())
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with hub_errors(source.repo, token):
        info = with_retries(
            lambda: api.model_info(
                source.repo, revision=source.revision, files_metadata=True, token=token, timeout=timeout
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
    for pattern in source.required():
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


def _link_local_copies(folder: Path, missing: list[RemoteFile], repo: str) -> dict[str, Path]:
    """For each missing GGUF whose size and sha256 match a file already on this machine (ollama, LM Studio, another
    repo...), a snapshot link to that file instead of a download: {name: the file linked to}."""
    found = {}
    for remote in missing:
        copy = find_copy(remote.size, remote.sha256) if remote.sha256 and remote.name.endswith(".gguf") else None
        if copy is not None:
            path = folder / remote.name
            forget(path, repo)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(copy)
            found[remote.name] = copy
    return found


def _partial_bytes(repo: str) -> int:
    blobs = repo_folder(repo) / "blobs"
    return sum(p.stat().st_size for p in blobs.glob("*.incomplete")) if blobs.is_dir() else 0


def check_disk_space(needed: int, folder: Path) -> None:
    """Fail before downloading when the cache's disk cannot hold what is still to come."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if needed * DISK_MARGIN > free:
        raise DFlashError(
            f"Not enough disk space in {folder}: {human_size(needed)} to download, {human_size(free)} free."
        )


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
            forget(path, source.repo)
            report.refetched.append(remote.name)
        bar = progress(remote.name) if progress else None
        for attempt in range(2):
            with hub_errors(source.repo, token), giving_up(f"{source.repo}/{remote.name}"):
                with_retries(
                    partial(download, source.repo, remote.name, commit, token, bar),
                    partial(_partial_bytes, source.repo),
                )
            if file_is_whole(path, remote):
                break
            forget(path, source.repo)
            if attempt == 1:
                raise DFlashError(f"{source.repo}/{remote.name} failed verification twice (size or sha256 differ).")
        report.downloaded.append(remote.name)
    refs = repo_folder(source.repo) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / source.revision).write_text(commit)
    old = read_manifest(source)
    known = old.get("files", {}) if old.get("commit") == commit else {}
    write_manifest(source, commit, known | {f.name: f.size for f in files})
    return report


def download(repo: str, name: str, commit: str, token: str | None, bar: Callable[..., ProgressBar] | None) -> Path:
    """Fetch one file into the Hub cache layout (blobs/ + snapshots/ link) under the lock huggingface_hub takes for
    the blob, resuming its `.incomplete` partial."""
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
            part = _partial(blob)
            _fetch(url, meta, part, token, bar)
            os.replace(part, blob)
    pointer = folder / "snapshots" / commit / name
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    return pointer


def _partial(blob: Path) -> Path:
    """The blob's partial file, `<etag>.incomplete`; when there is none, the largest one a killed `hf download` left
    (`<etag>.<8 hex>.incomplete`) becomes it."""
    part = blob.with_name(f"{blob.name}.incomplete")
    if not part.exists():
        theirs = sorted(blob.parent.glob(f"{blob.name}.*.incomplete"), key=lambda p: p.stat().st_size)
        if theirs:
            os.replace(theirs[-1], part)
    return part


def _fetch(
    url: str, meta: HfFileMetadata, part: Path, token: str | None, bar: Callable[..., ProgressBar] | None
) -> None:
    """Bring part up to the whole file: through hf-xet where the repo keeps the file in Xet, else by a GET of the
    bytes part lacks (a CDN the Hub redirects to gets no token: its URL is signed)."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.file_download import xet_get
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = build_hf_headers(token=token)
    if meta.xet_file_data is not None and not constants.HF_HUB_DISABLE_XET and find_spec("hf_xet") is not None:
        xet_get(
            incomplete_path=part,
            xet_file_data=meta.xet_file_data,
            headers=headers,
            expected_size=meta.size,
            displayed_filename=part.name,
            tqdm_class=bar,
        )
        return
    headers["Accept-Encoding"] = "identity"  # ranges count the bytes as stored
    if urlsplit(meta.location)[:2] != urlsplit(url)[:2]:
        headers.pop("authorization", None)
    have = part.stat().st_size if part.exists() else 0
    if meta.size is not None and have > meta.size:
        part.unlink()
        have = 0
    if meta.size is not None and have == meta.size:
        return
    if have:
        headers["Range"] = f"bytes={have}-"
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with get_session().stream("GET", meta.location, headers=headers, timeout=timeout, follow_redirects=True) as reply:
        if reply.status_code >= 400:
            reply.read()
            hf_raise_for_status(reply)
        if reply.status_code != 206:
            have = 0  # the server ignored the range and sends the whole file
        with open(part, "ab" if have else "wb") as handle:
            _append(reply.iter_bytes(), handle, bar(total=meta.size, initial=have) if bar else nullcontext())


def _append(chunks: Iterable[bytes], handle: BinaryIO, bar: ProgressBar | nullcontext) -> None:
    """Write chunks to handle as they arrive (each kept on disk at once), advancing the progress bar."""
    with bar as progress:
        for chunk in chunks:
            handle.write(chunk)
            if progress is not None:
                progress.update(len(chunk))
