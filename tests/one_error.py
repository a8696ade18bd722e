"""The one way a user's mistake ends, as the tests check it: exit status 1 and a whole stderr of one `error:` line."""

from __future__ import annotations

import subprocess

from typer.testing import Result


def assert_one_error(result: subprocess.CompletedProcess | Result, *fragments: str) -> str:
    """Exit status 1, no exception escaped the CLI (a traceback in a process), and stderr exactly one line
    `error: ...` holding each fragment; that line, without its newline."""
    if isinstance(result, Result):
        assert isinstance(result.exception, SystemExit), repr(result.exception)
        code = result.exit_code
    else:
        code = result.returncode
    assert code == 1, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.endswith("\n"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    return result.stderr.removesuffix("\n")
