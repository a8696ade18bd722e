"""The status line a command shows on stderr while it starts (imports, model loading, calibration), so a terminal is
never blank; it clears itself before the command's first output. cli.main starts one; loading reports its phases to
it through the load spec's progress callable (show)."""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.live import Live
    from rich.spinner import Spinner

DELAY_S = 0.2  # commands done sooner (--version, --help) never draw it


class _ClearOnWrite:
    """A stream that ends the status line before the first text written to it."""

    def __init__(self, stream: TextIO, status: StartupStatus) -> None:
        self._stream = stream
        self._status = status

    def write(self, text: str) -> int:
        self._status.stop()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


class StartupStatus:
    """One rich spinner line on stderr saying what runs; shown only where stderr is a terminal, so pipes, JSON
    output and logs never see it. Ends for good at stop() or at the first write to stdout or stderr."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._text = ""
        self._ended = False
        self._streams: tuple[TextIO, TextIO] | None = None
        self._timer: threading.Timer | None = None
        self._live: Live | None = None
        self._spinner: Spinner | None = None

    def start(self, text: str) -> None:
        """Arm the line with what runs first (drawn after DELAY_S), unless stderr is not a terminal."""
        with self._lock:
            if self._ended or self._streams is not None:
                return
            if not sys.stderr.isatty() or os.environ.get("TERM") == "dumb":
                self._ended = True
                return
            self._text = text
            self._streams = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = _ClearOnWrite(sys.stdout, self), _ClearOnWrite(sys.stderr, self)
            self._timer = threading.Timer(DELAY_S, self._draw)
            self._timer.daemon = True
            self._timer.start()

    def show(self, text: str) -> None:
        """Say what runs now, if the line is armed or drawn."""
        with self._lock:
            if self._ended or self._streams is None:
                return
            self._text = text
            if self._spinner is not None and self._live is not None:
                self._spinner.update(text=text)
                self._live.refresh()  # every phase drawn at least once, however short

    def _draw(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.spinner import Spinner

        with self._lock:
            if self._ended or self._streams is None:
                return
            self._spinner = Spinner("dots", text=self._text, style="cyan")
            console = Console(file=self._streams[1], stderr=True)
            self._live = Live(
                self._spinner, console=console, transient=True, redirect_stdout=False, redirect_stderr=False
            )
            self._live.start()

    def stop(self) -> None:
        """Clear the line and give the streams back; nothing is shown after this."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if self._timer is not None:
                self._timer.cancel()
            if self._live is not None:
                self._live.stop()
            if self._streams is not None:
                if isinstance(sys.stdout, _ClearOnWrite):
                    sys.stdout = self._streams[0]
                if isinstance(sys.stderr, _ClearOnWrite):
                    sys.stderr = self._streams[1]
