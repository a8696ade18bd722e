"""CI's check of a user install: the CLI answers, chats through a pipe, lists the catalog, trains a few steps on the
bundled pair, and pulls from a Hub. Run after `./install.sh` (which also built the batch-invariant libllama) or, with
--wheel, in a fresh venv holding the built wheel.

    .venv/bin/python -m tools.check_user_install                       # after ./install.sh
    python -m tools.check_user_install --venv /tmp/wheel-venv --wheel   # pip install 'dist/*.whl[gguf]' there

Run from the repository root; uses the standard library only. `dflash pull` runs against tools/hub_server.py's
loopback Hub serving the bundled drafter, then with that Hub stopped, then against an address nothing listens on with
an empty cache. Prints one line per check; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.hub_server import FakeHub, repo_of

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
REPO_ID = "ci/tiny-drafter"
UNREACHABLE = "http://127.0.0.1:9"


def dflash(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    command = [str(VENV / "bin" / "dflash"), *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=600, env=full)


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
    result = dflash("chat", stdin="def add(a, b):\n", env={"OMP_NUM_THREADS": "1"})
    answered = result.returncode == 0 and result.stdout.strip() != ""
    return [expect(answered, 'echo "def add(a, b):" | dflash chat (bundled pair)', result)]


def check_models() -> list[bool]:
    result = dflash("models", env={"COLUMNS": "200"})
    ok = result.returncode == 0 and "bundled" in result.stdout
    return [expect(ok, "dflash models: the catalog, with tiny bundled", result)]


def check_doctor(invariant: bool) -> list[bool]:
    """After install.sh, dflash loads the batch-invariant libllama it built (lossless F16); a wheel, the stock one."""
    result = dflash("doctor", env={"COLUMNS": "200"})  # one line per check
    if not invariant:
        ok = result.returncode == 0 and "llama-cpp-python" in result.stdout
        return [expect(ok, "dflash doctor: every check runs, llama-cpp-python found", result)]
    ok = result.returncode == 0 and ("batch-invariant libllama" in result.stdout or "GPU offload" in result.stdout)
    return [expect(ok, "dflash doctor: llama.cpp's library is the batch-invariant build (or a GPU build)", result)]


def check_train(home: Path) -> list[bool]:
    """A few steps of `dflash train` on the installed bundled pair (asked from the venv's Python, outside the repo)."""
    code = "from dflash_local.catalog import MODELS_DIR; print(MODELS_DIR / 'tiny')"
    found = subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=home)
    tiny, out = Path(found.stdout.strip()), home / "trained-drafter"
    data = ("--target", str(tiny / "target"), "--corpus", str(tiny / "heldout_prompts.jsonl"), "--out", str(out))
    small = ("--max-prompts", "4", "--new-tokens", "16", "--steps", "3", "--batch-size", "2", "--eval-every", "3")
    result = dflash("train", *data, *small, env={"OMP_NUM_THREADS": "1", "DFLASH_HOME": str(home / "dflash")})
    ok = result.returncode == 0 and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    return [expect(ok, "dflash train: 3 steps on the bundled pair write a drafter", result)]


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
    pulled = first.returncode == 0 and f"verified {len(served)} files (size + sha256)" in first.stdout
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
    global VENV
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=VENV, help="the venv whose dflash is checked (default: .venv)")
    parser.add_argument("--wheel", action="store_true", help="installed from the wheel: no batch-invariant libllama")
    args = parser.parse_args()
    VENV = args.venv.absolute()
    for inherited in ("HF_TOKEN", "HF_HUB_OFFLINE"):  # the checks need the anonymous, online Hub client
        os.environ.pop(inherited, None)
    with tempfile.TemporaryDirectory(prefix="dflash-user-check-") as home:
        results = (
            check_version()
            + check_doctor(invariant=not args.wheel)
            + check_pipe_chat()
            + check_models()
            + check_train(Path(home))
            + check_pull(Path(home))
            + check_unreachable(Path(home))
        )
    print(f"user install ({VENV}): {sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
