"""Reaching the Hugging Face Hub: its address, retries of failures that pass by themselves, and every failure
turned into one sentence a person can act on."""

from __future__ import annotations

import errno
import importlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TypeVar

from .errors import DFlashError
from .paths import cache_dir

ATTEMPTS = 5  # tries in a row (counted from the last one that brought new bytes) before a pull gives up
FIRST_DELAY = 0.2  # seconds before the first retry, doubling before each next one
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
T = TypeVar("T")


class HubUnreachable(DFlashError):
    """The Hub (HF_ENDPOINT) could not be reached."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


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

    A failed try after which progress() grew (bytes kept in an `.incomplete` file) starts the count and delay again.
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
def giving_up(what: str) -> Iterator[None]:
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
