"""CI's check of a plain `./install.sh` (no --dev): the CLI answers, loads the batch-invariant libllama, chats through a
pipe, and pulls from a Hub.

    .venv/bin/python scripts/check_user_install.py      # after ./install.sh; uses the standard library only

`dflash pull` runs against tests/hub_server.py's loopback Hub serving the bundled drafter, then with that Hub
stopped, then against an address nothing listens on with an empty cache. Prints one line per check; exit 1 on any
failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DFLASH = REPO / ".venv" / "bin" / "dflash"
REPO_ID = "ci/tiny-drafter"
UNREACHABLE = "http://127.0.0.1:9"
sys.path.insert(0, str(REPO / "tests"))

from hub_server import FakeHub, repo_of  # noqa: E402


def dflash(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([str(DFLASH), *args], input=stdin, capture_output=True, text=True, timeout=600, env=full)


def expect(ok: bool, what: str, result: subprocess.CompletedProcess) -> bool:
    """Print one line for a check; on failure, also what the command printed."""
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        print(f"  exit {result.returncode}\n  stdout: {result.stdout[-2000:]!r}\n  stderr: {result.stderr[-2000:]!r}")
    return ok


def check_version() -> list[bool]:
    result = dflash("--version")
    return [expect(result.returncode == 0 and result.stdout.startswith("dflash-local "), "dflash --version", result)]


def check_pipe_chat() -> list[bool]:
    result = dflash("chat", stdin="hello\n", env={"OMP_NUM_THREADS": "1"})
    answered = result.returncode == 0 and result.stdout.strip() != ""
    return [expect(answered, "echo hello | dflash chat (bundled pair)", result)]


def check_doctor() -> list[bool]:
    """On a CPU-only llama.cpp, dflash loads the batch-invariant libllama install.sh built (lossless F16 GGUFs)."""
    result = dflash("doctor", env={"COLUMNS": "200"})  # one line per check
    ok = result.returncode == 0 and ("batch-invariant libllama" in result.stdout or "GPU offload" in result.stdout)
    return [expect(ok, "dflash doctor: llama.cpp's library is the batch-invariant build (or a GPU build)", result)]


def one_error_line(result: subprocess.CompletedProcess) -> bool:
    """Exit 1 with exactly one `error: ` line on stderr (progress lines may come first) and no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    return result.returncode == 1 and len(errors) == 1 and "Traceback" not in result.stderr


def check_pull(home: Path) -> list[bool]:
    """Pull from the loopback Hub, check the files, then pull again with that Hub gone."""
    env = {"HF_HOME": str(home / "hf"), "DFLASH_HOME": str(home / "dflash"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    served = repo_of(REPO / "models" / "tiny" / "drafter")
    with FakeHub({REPO_ID: served}) as hub:
        env["HF_ENDPOINT"] = hub.url
        first = dflash("pull", REPO_ID, env=env)
    snapshots = list((home / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots").glob("*"))
    landed = {p.name: p.read_bytes() for p in snapshots[0].iterdir()} if len(snapshots) == 1 else {}
    pulled = first.returncode == 0 and f"verified {len(served)} files (size + sha256)" in first.stderr
    ok = expect(pulled and landed == served, f"dflash pull {REPO_ID} from a loopback Hub: files land, verified", first)
    again = dflash("pull", REPO_ID, env=env)
    whole = f"{REPO_ID}: the Hub is unreachable, so no update check; the pulled copy is whole."
    return [ok, expect(again.returncode == 0 and whole in again.stdout, "dflash pull again, the Hub stopped", again)]


def check_unreachable(home: Path) -> list[bool]:
    env = {"HF_HOME": str(home / "empty-hf"), "DFLASH_HOME": str(home / "empty-dflash"), "HF_ENDPOINT": UNREACHABLE}
    result = dflash("pull", REPO_ID, env=env)
    return [
        expect(one_error_line(result), f"dflash pull with HF_ENDPOINT={UNREACHABLE}: one error line, exit 1", result)
    ]


def main() -> int:
    for inherited in ("HF_TOKEN", "HF_HUB_OFFLINE"):  # the checks need the anonymous, online Hub client
        os.environ.pop(inherited, None)
    with tempfile.TemporaryDirectory(prefix="dflash-user-check-") as home:
        results = (
            check_version()
            + check_doctor()
            + check_pipe_chat()
            + check_pull(Path(home))
            + check_unreachable(Path(home))
        )
    print(f"user install: {sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
