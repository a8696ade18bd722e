"""`dflash bench --peer llama-server`: llama.cpp's own llama-server on the same GGUF target, prompts and drafter, plain
and with its speculative types (draft-dflash with the drafter exported to GGUF; draft-mtp where the GGUF has MTP
layers), each server started on a free loopback port. Every speculative output is compared with the same server's
plain output, token by token; a mode whose server refuses to start or fails a request keeps its row, with the reason.

tok/s is llama-server's own generation timing read as dflash reads its own: the tokens after the first per second
from the first token to the last (`timings.predicted_n - 1` over `predicted_ms`). tau is its mean acceptance length
of the steps that drafted, 1 + accepted drafts / verify steps, from the counters of its /metrics before and after
each request (the same definition as dflash's, and the "mean len" llama-server logs)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import DFlashError

PEERS = ("llama-server",)
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "build_llama_server.sh"
READY_S = 300.0  # a server that answers /health in none of this is a failed mode
REQUEST_S = 3600.0


def check_peer(peer: str | None, temperature: float) -> None:
    if peer is not None and peer not in PEERS:
        raise DFlashError(f"--peer runs {' or '.join(PEERS)} beside dflash, not '{peer}'.")
    if peer is not None and temperature != 0:
        raise DFlashError("--peer compares greedy outputs with each engine's plain ones: drop --temperature.")


def find_llama_server(binary: Path | None) -> Path:
    """The llama-server to run: the one named (--peer-binary or DFLASH_LLAMA_SERVER), else the venv's build of the
    vendored llama.cpp (tools/build_llama_server.sh), built now where a source checkout has the script."""
    if binary is not None:
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise DFlashError(f"--peer-binary {binary} is not an executable file.")
        return binary
    built = Path(sys.prefix) / "lib" / "llama-server" / "llama-server"
    if built.is_file() and os.access(built, os.X_OK):
        return built
    if not BUILD_SCRIPT.is_file():
        raise DFlashError(
            f"No llama-server at {built}, and no tools/build_llama_server.sh to build one: pass --peer-binary PATH."
        )
    print(f"building llama-server into {built.parent} (stock llama.cpp, about 15 minutes)", file=sys.stderr)
    done = subprocess.run(["bash", str(BUILD_SCRIPT), sys.prefix], capture_output=True, text=True)
    if done.returncode != 0 or not built.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DFlashError(f"Building llama-server with {BUILD_SCRIPT} failed ({last}): pass --peer-binary PATH.")
    return built


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ModeFailed(Exception):
    """The server of one mode would not start, or failed a request: the reason goes into its row."""


class Server:
    """One llama-server process on a free loopback port, its output in a log file."""

    def __init__(self, command: list[str], log: Path):
        self.port, self.log = free_port(), log
        command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        with log.open("w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def reason(self) -> str:
        """The log's last error line in llama.cpp's own words (an assertion, an error; else a failure or its last
        line), source paths cut to the file's name."""
        text = re.sub(r"\S*/([\w.-]+\.(?:cpp|h):\d+)", r"\1", self.log.read_text(errors="replace"))
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]  # no frames
        strong = [line for line in lines if re.search(r"GGML_ASSERT|error|what\(\)|exception", line, re.IGNORECASE)]
        weak = [line for line in lines if re.search(r"failed|abort|invalid|unknown|not supported", line, re.IGNORECASE)]
        found = (strong or weak or lines or ["no output"])[-1]
        exited = self.process.poll()
        return (f"exited with {exited}: " if exited is not None else "") + found

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ModeFailed(self.reason())
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._call("GET", "/health", None, timeout=5)[0] == 200:
                    return
            time.sleep(0.25)
        raise ModeFailed(f"not ready in {timeout:.0f} s: {self.reason()}")

    def _call(self, method: str, path: str, body: dict | None, timeout: float = REQUEST_S) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            return answer.status, answer.read().decode(errors="replace")
        finally:
            connection.close()

    def counters(self) -> dict[str, float]:
        """/metrics' counters (llama-server started with --metrics), by name without the llamacpp: prefix."""
        status, text = self._call("GET", "/metrics", None, timeout=60)
        if status != 200:
            return {}
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("llamacpp:"):
                with contextlib.suppress(ValueError):
                    found[name.removeprefix("llamacpp:")] = float(value)
        return found

    def complete(self, ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict:
        """One greedy completion of the prompt ids: the generated ids, tok/s and tau (see the module's note)."""
        body = {
            "prompt": ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
            "ignore_eos": ignore_eos,
        }
        try:
            before = self.counters()
            status, text = self._call("POST", "/completion", body)
            after = self.counters()
        except (OSError, http.client.HTTPException) as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)  # a crash: its exit status and last words
            raise ModeFailed(self.reason() if self.process.poll() is not None else f"{exc}: {self.reason()}") from None
        if status != 200:
            raise ModeFailed(f"HTTP {status}: {text.strip()[:300]}")
        answer = json.loads(text)
        timings = answer.get("timings") or {}
        made, seconds = int(timings.get("predicted_n", 0)), float(timings.get("predicted_ms", 0.0)) / 1000
        steps = after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)
        accepted = after.get("spec_decode_num_accepted_tokens_total", 0) - before.get(
            "spec_decode_num_accepted_tokens_total", 0
        )
        return {
            "ids": [int(i) for i in answer.get("tokens") or []],
            "decode_tokens_per_s": (made - 1) / seconds if made > 1 and seconds > 0 else 0.0,
            "tau": 1 + accepted / steps if steps else 0.0,
            "draft_n": int(timings.get("draft_n", 0)),
            "draft_n_accepted": int(timings.get("draft_n_accepted", 0)),
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def modes(target: Path, drafter_gguf: Path | None, block_size: int | None) -> dict[str, list[str]]:
    """llama-server's arguments per mode: plain, draft-dflash with the drafter (its whole block: block size - 1
    drafts, the default being 3), draft-mtp where the target GGUF carries MTP (nextn) layers."""
    from .gguf.file import read_gguf

    found: dict[str, list[str]] = {"plain": []}
    if drafter_gguf is not None:
        found["draft-dflash"] = ["--spec-type", "draft-dflash", "-md", str(drafter_gguf)]
        found["draft-dflash"] += ["--spec-draft-n-max", str(block_size - 1)] if block_size else []
    if read_gguf(target).mtp_layers > 0:
        found["draft-mtp"] = ["--spec-type", "draft-mtp"]
    return found


@contextlib.contextmanager
def exported_drafter(drafter: Path | None, target: Path) -> Iterator[Path | None]:
    """The drafter as the GGUF llama-server's -md takes: as it is where it is one already, else exported (dflash
    export --to gguf) into a temporary folder for the run; None with no DFlash drafter."""
    from .drafters.gguf_drafter import is_drafter_gguf
    from .export import export_drafter

    if drafter is None or drafter.resolve() == target.resolve():  # none, or the target's own MTP layers
        yield None
    elif is_drafter_gguf(drafter):
        yield drafter
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-peer-") as folder:
            out = Path(folder) / "drafter.gguf"
            export_drafter(drafter, "gguf", out, str(target))
            yield out


def run_peer(
    binary: Path,
    target: Path,
    drafter: Path | None,
    block_size: int | None,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    ignore_eos: bool,
    threads: int | None,
    reference: list[list[int]],
) -> dict:
    """Every mode's server at once (so that other load on the machine falls on all alike), a warm-up each, then per
    prompt each mode in turn; per mode its rows, means and how many outputs equal its plain one, and for plain how
    many begin with reference (dflash's plain outputs, cut at their end of sequence)."""
    longest = max(len(ids) for _, ids in prompts)
    # as dflash loads the model: the weights unrepacked (--no-repack; llama-server's default AMX repacking also
    # crashed it here, docs/benchmarks.md), window-sized caches for sliding-window layers (both engines' default), and
    # each prompt prefilled as dflash does, in batches of up to 512 rows: no context checkpoints (with a window-sized
    # cache llama-server prefills a prompt's last 4 and 4 + 512 rows apart to checkpoint them, and other batches
    # meet other kernels: docs/benchmarks.md), which serve nothing here (each prompt is sent once, uncached)
    common = [str(binary), "-m", str(target), "-np", "1", "--metrics", "--no-webui", "--cache-ram", "0"]
    common += ["--no-repack", "--ctx-checkpoints", "0"]
    common += ["-c", str(longest + max_new_tokens + 2 * (block_size or 16) + 64)]
    common += ["-t", str(threads), "-tb", str(threads)] if threads else []
    with exported_drafter(drafter, target) as drafter_gguf, tempfile.TemporaryDirectory(prefix="dflash-peer-") as logs:
        arguments = modes(target, drafter_gguf, block_size)
        servers: dict[str, Server] = {}
        results: dict[str, dict] = {name: {"error": None, "prompts": []} for name in arguments}
        try:
            for name, extra in arguments.items():
                servers[name] = Server(common + extra, Path(logs) / f"{name}.log")
            for name, server in servers.items():
                try:
                    server.wait_ready()
                    server.complete(prompts[0][1], 8, True)  # warm-up
                except ModeFailed as exc:
                    results[name]["error"] = str(exc)
            for _, ids in prompts:
                for name, server in servers.items():
                    if results[name]["error"] is None:
                        try:
                            results[name]["prompts"].append(server.complete(ids, max_new_tokens, ignore_eos))
                        except ModeFailed as exc:
                            results[name]["error"] = str(exc)
        finally:
            for server in servers.values():
                server.stop()
    return {"engine": "llama-server", "binary": str(binary), "modes": _summarise(results, reference)}


def _summarise(results: dict[str, dict], reference: list[list[int]]) -> dict[str, dict]:
    """Per mode: means over its prompts, and how many of its outputs equal plain's (None where either failed); for
    plain, how many begin with the reference's."""
    plain = results["plain"]["prompts"] if results["plain"]["error"] is None else None
    same = None
    if plain is not None:
        same = sum(row["ids"][: len(ids)] == ids for row, ids in zip(plain, reference, strict=True))
    results["plain"]["identical_to_dflash_plain"] = same
    for name, result in results.items():
        rows = result["prompts"]
        result["mean"] = {
            key: sum(row[key] for row in rows) / len(rows) if rows else 0.0 for key in ("decode_tokens_per_s", "tau")
        }
        if name == "plain" or plain is None or result["error"] is not None:
            result["identical"] = None
        else:
            result["identical"] = sum(row["ids"] == base["ids"] for row, base in zip(rows, plain, strict=True))
        result["compared"] = len(reference)
    return results
