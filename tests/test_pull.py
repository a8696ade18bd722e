"""`dflash pull/models/rm` against a loopback Hub (HF_ENDPOINT): progress, resume, verification, clear errors."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import invoke
from one_error import assert_one_error

from dflash_local import hub as hub_module
from dflash_local import hub_access, hub_pull
from dflash_local.hub import human_size
from tools.hub_server import FakeHub, Fault, repo_of

MODELS = Path(__file__).resolve().parent.parent / "models" / "tiny"
TARGET_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
PULLED = [("target", n) for n in TARGET_FILES] + [("drafter", "config.json"), ("drafter", "model.safetensors")]
CATALOG = """
[tiny-hub]
summary = "the bundled pair, served by a loopback hub"
backend = "torch"
target = { repo = "test/tiny" }
drafter = { repo = "test/tiny-drafter" }
memory_gb = 0.1

[tiny-gguf-hub]
summary = "the bundled target as a Q8_0 GGUF in a multi-quant repo, and its drafter"
backend = "llamacpp"
target = { repo = "test/tiny-gguf", files = ["tiny-Q8_0.gguf"] }
drafter = { repo = "test/tiny-drafter" }
"""


def _repos() -> dict[str, dict[str, bytes]]:
    drafter = repo_of(MODELS / "drafter", {"dflash.py": b"raise SystemExit('code from a repo must never run')\n"})
    config = json.loads(drafter["config.json"])
    config["dflash_config"]["target_layer_ids"] = [1, 3, 20]
    return {
        "test/tiny": repo_of(MODELS / "target", {"modeling_tiny.py": b"import os\n", "README.md": b"# tiny\n"}),
        "test/tiny-drafter": drafter,
        "test/gated-drafter": drafter,
        "test/bad-drafter": drafter | {"config.json": json.dumps(config).encode()},
        "test/tiny-gguf": {"tiny-Q8_0.gguf": b"q8" * 5000, "tiny-F16.gguf": b"16" * 9000, "README.md": b"#\n"},
        "openai/gsm8k": {"main/test-00000-of-00001.parquet": _parquet({"question": GSM8K, "answer": ["4", "2"]})},
        "HuggingFaceH4/mt_bench_prompts": {"raw/question.jsonl": b'{"turns": ["Write a haiku.", "Another."]}\n'},
    }


GSM8K = ["What is 2 + 2?", "Tom has 3 apples and eats one. How many are left?"]


def _parquet(columns: dict[str, list]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A running loopback hub and an environment (in-process and for subprocesses) that points at it; in-process
    pulls wait 10 ms before their first retry, not 200 ms (as many tries, 0.3 s instead of 3 s before giving up)."""
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG)
    with FakeHub(_repos(), gated={"test/gated-drafter"}) as server:
        env = {
            "HF_ENDPOINT": server.url,
            "HF_HOME": str(tmp_path / "hf"),
            "DFLASH_HOME": str(tmp_path / "dflash"),
            "DFLASH_CATALOG": str(catalog),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(hub_access, "FIRST_DELAY", 0.01)  # in this process, retries as many, waits shorter
        server.env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
        yield server


def dflash(hub: FakeHub, *args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """`dflash ARGS` in this process (CliRunner), `env` over the hub fixture's environment: exit status, stdout and
    stderr as a process's. An exception that escapes the CLI (a traceback in a real process) fails the test."""
    result = invoke(*args, env=env, input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def dflash_process(hub: FakeHub, *args: str, input: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """`dflash ARGS` in a process of its own: for settings huggingface_hub reads once, at import
    (HF_HUB_DOWNLOAD_TIMEOUT), the process's logging of failed connections, and a chat reading a real pipe."""
    command = [sys.executable, "-m", "dflash_local", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**hub.env, **env}, input=input)


TARGET_WEIGHTS = r"^/test/tiny/resolve/[^/]+/model\.safetensors$"


def weight_ranges(hub: FakeHub) -> list[int]:
    """The byte offset each GET of the target's weights asked to start from (0: no Range header)."""
    gets = [r for r in hub.downloads() if re.search(TARGET_WEIGHTS, r.path)]
    return [int(r.range.removeprefix("bytes=").rstrip("-")) if r.range else 0 for r in gets]


def part_files(tmp_path: Path, repo: str) -> list[Path]:
    return list((tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "blobs").glob("*.incomplete"))


def manifests(tmp_path: Path) -> list[str]:
    """Repos a completed, verified pull recorded."""
    pulled = tmp_path / "dflash" / "pulled"
    return sorted(p.name for p in pulled.glob("*.json")) if pulled.is_dir() else []


def snapshot(tmp_path: Path, repo: str) -> Path:
    folders = list((tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir())
    assert len(folders) == 1
    return folders[0]


def generate(hub: FakeHub, *extra: str) -> subprocess.CompletedProcess:
    return dflash(
        hub, "generate", "--target", "tiny-hub", "--prompt", "def main", "--max-new-tokens", "8", "--json", *extra
    )


def test_pull_fetches_only_needed_files_verifies_and_second_pull_downloads_nothing(hub, tmp_path):
    first = dflash(hub, "pull", "tiny-hub")
    assert first.returncode == 0, first.stderr
    assert "verified 6 files (size + sha256): 6 downloaded" in first.stdout  # the report is pull's output
    assert "verified 2 files (size + sha256): 2 downloaded" in first.stdout
    assert first.stderr == ""  # no terminal, so no bars
    assert {p.name for p in snapshot(tmp_path, "test/tiny").iterdir()} == TARGET_FILES
    assert {p.name for p in snapshot(tmp_path, "test/tiny-drafter").iterdir()} == {"config.json", "model.safetensors"}
    for name in TARGET_FILES:
        assert (snapshot(tmp_path, "test/tiny") / name).read_bytes() == (MODELS / "target" / name).read_bytes()
    assert len(hub.downloads()) == 8

    second = dflash(hub, "pull", "tiny-hub")
    assert second.returncode == 0, second.stderr
    assert "0 downloaded (0 B), 6 already in the cache" in second.stdout
    assert len(hub.downloads()) == 8  # nothing fetched again
    unreachable = dflash(hub, "pull", "tiny-hub", HF_ENDPOINT="http://127.0.0.1:9")
    assert unreachable.returncode == 0, unreachable.stderr
    assert "test/tiny: the Hub is unreachable, so no update check; the pulled copy is whole." in unreachable.stdout

    result = generate(hub, "--offline")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["output_ids"]) == 8

    size = human_size(sum((MODELS / f / n).stat().st_size for f, n in PULLED))
    listed = dflash(hub, "models")
    assert "tiny-hub" in listed.stdout and size in listed.stdout
    removed = dflash(hub, "rm", "tiny-hub")
    assert removed.returncode == 0 and f"freed {size}" in removed.stdout
    assert_one_error(generate(hub, "--offline"), "is not downloaded", "--offline")
    assert_one_error(dflash(hub, "rm", "tiny-hub"), "tiny-hub is not downloaded.")


def test_generate_pulls_on_first_use(hub, tmp_path):
    result = generate(hub)
    assert result.returncode == 0, result.stderr
    assert "pulled test/tiny (" in result.stderr and "pulled test/tiny-drafter (" in result.stderr
    assert json.loads(result.stdout)["tau"] >= 1.0


def killed_midway(hub: FakeHub, tmp_path: Path, command: list[str], partial: str) -> Path:
    """Run command (a download from the hub, slowed down), SIGKILL it once the target's blobs hold a `partial`
    (a glob) over 2 MB, and return that partial file."""
    hub.delay_per_chunk = 0.02  # ~5 s for the 15 MB weights file
    process = subprocess.Popen(command, env=hub.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    blobs = tmp_path / "hf" / "hub" / "models--test--tiny" / "blobs"
    deadline = time.time() + 120
    while time.time() < deadline:
        found = list(blobs.glob(partial)) if blobs.is_dir() else []
        if found and found[0].stat().st_size > 2_000_000:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    hub.delay_per_chunk = 0.0
    assert found and found[0].stat().st_size > 2_000_000
    return found[0]


def test_interrupted_pull_resumes_where_it_stopped(hub, tmp_path):
    killed_midway(hub, tmp_path, [sys.executable, "-m", "dflash_local", "pull", "tiny-hub"], "*.incomplete")

    assert_one_error(generate(hub, "--offline"), "is not downloaded (or not completely)")  # half a pull never loads

    resumed = dflash(hub, "pull", "tiny-hub")
    assert resumed.returncode == 0, resumed.stderr
    ranges = [r.range for r in hub.downloads() if r.path.endswith("/model.safetensors") and "drafter" not in r.path]
    assert ranges[-1] is not None and int(ranges[-1].removeprefix("bytes=").rstrip("-")) > 2_000_000
    weights = snapshot(tmp_path, "test/tiny") / "model.safetensors"
    assert weights.read_bytes() == (MODELS / "target" / "model.safetensors").read_bytes()


HF_DOWNLOAD = "from huggingface_hub import hf_hub_download; hf_hub_download('test/tiny', 'model.safetensors')"


def test_pull_resumes_the_partial_file_a_killed_hf_download_left(hub, tmp_path):
    """huggingface_hub writes `<etag>.<8 hex>.incomplete` and keeps it only when killed: pull resumes from it."""
    theirs = killed_midway(hub, tmp_path, [sys.executable, "-c", HF_DOWNLOAD], "*.*.incomplete")
    kept = theirs.stat().st_size
    resumed = dflash(hub, "pull", "test/tiny")
    assert resumed.returncode == 0, resumed.stderr
    assert weight_ranges(hub)[-1] == kept
    weights = snapshot(tmp_path, "test/tiny") / "model.safetensors"
    assert weights.read_bytes() == (MODELS / "target" / "model.safetensors").read_bytes()
    assert part_files(tmp_path, "test/tiny") == []


def test_huggingface_hub_sees_and_finishes_what_a_killed_pull_left(hub, tmp_path):
    """A pull's partial is an incomplete download to huggingface_hub's cache tools (`hf cache prune` clears it), and
    hf_hub_download completes the file in the same cache (2.4.0 starts over: it resumes no partial, its own
    included), after which pull finds the weights whole and downloads nothing."""
    from huggingface_hub import hf_hub_download, scan_cache_dir

    ours = killed_midway(hub, tmp_path, [sys.executable, "-m", "dflash_local", "pull", "test/tiny"], "*.incomplete")
    cache = tmp_path / "hf" / "hub"  # huggingface_hub read HF_HOME and HF_ENDPOINT when this process imported it
    assert [f.file_path for f in scan_cache_dir(cache).incomplete_files] == [ours]
    path = hf_hub_download("test/tiny", "model.safetensors", cache_dir=cache, endpoint=hub.url)
    assert Path(path).read_bytes() == (MODELS / "target" / "model.safetensors").read_bytes()
    fetched = weight_ranges(hub)
    assert fetched[-1] == 0  # huggingface_hub 2.4.0 fetched the whole file again
    again = dflash(hub, "pull", "test/tiny")
    assert again.returncode == 0, again.stderr
    assert weight_ranges(hub) == fetched  # the weights were whole: pull verified them and fetched nothing
    assert (snapshot(tmp_path, "test/tiny") / "model.safetensors").resolve() == Path(path).resolve()


def test_corrupted_and_truncated_cache_files_are_detected_and_fetched_again(hub, tmp_path):
    assert dflash(hub, "pull", "tiny-hub").returncode == 0
    target_weights = (snapshot(tmp_path, "test/tiny") / "model.safetensors").resolve()
    data = bytearray(target_weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    target_weights.write_bytes(bytes(data))
    drafter_weights = (snapshot(tmp_path, "test/tiny-drafter") / "model.safetensors").resolve()
    drafter_weights.write_bytes(drafter_weights.read_bytes()[:1000])

    assert_one_error(generate(hub, "--offline"), "is not downloaded (or not completely)")  # truncation shows offline

    repaired = dflash(hub, "pull", "tiny-hub")
    assert repaired.returncode == 0, repaired.stderr
    assert repaired.stdout.count("was corrupted or truncated in the cache, fetched again") == 2
    for repo, folder in (("test/tiny", "target"), ("test/tiny-drafter", "drafter")):
        pulled = snapshot(tmp_path, repo) / "model.safetensors"
        assert pulled.read_bytes() == (MODELS / folder / "model.safetensors").read_bytes()
    assert generate(hub, "--offline").returncode == 0


def test_offline_with_nothing_cached_says_so(hub):
    assert_one_error(dflash(hub, "pull", "tiny-hub", "--offline"), "test/tiny is not downloaded", "--offline")
    assert_one_error(dflash(hub, "chat", "tiny-hub", "--offline"), "test/tiny is not downloaded", "--offline")
    assert hub.log == []


def test_no_network_is_one_sentence(hub):
    result = dflash(hub, "pull", "tiny-hub", HF_ENDPOINT="http://127.0.0.1:9")
    assert_one_error(result, "Cannot reach the Hugging Face Hub at http://127.0.0.1:9")


def test_gated_repo_needs_a_token(hub, tmp_path):
    assert_one_error(dflash(hub, "pull", "test/gated-drafter"), "test/gated-drafter is gated", "HF_TOKEN")
    assert_one_error(
        dflash(hub, "pull", "test/gated-drafter", HF_TOKEN="hf_wrong"), "token has no access", "test/gated-drafter"
    )
    allowed = dflash(hub, "pull", "test/gated-drafter", "--token", hub.token)
    assert allowed.returncode == 0, allowed.stderr


def test_unknown_repo_name_and_alias(hub):
    assert_one_error(dflash(hub, "pull", "test/nope"), "No model repo 'test/nope'")
    assert_one_error(dflash(hub, "pull", "tiny-hbu"), "Did you mean tiny-hub,")


def test_one_quantization_out_of_a_gguf_repo(hub, tmp_path):
    assert_one_error(dflash(hub, "pull", "test/tiny-gguf"), "holds GGUF files", "test/tiny-gguf:F16")
    result = dflash(hub, "pull", "test/tiny-gguf:Q8_0")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in snapshot(tmp_path, "test/tiny-gguf").iterdir()] == ["tiny-Q8_0.gguf"]


def test_drafter_repo_that_does_not_match_the_target(hub):
    for name in ("tiny-hub", "test/bad-drafter"):  # pulled first: a pull that did happen is reported on stderr
        assert dflash(hub, "pull", name).returncode == 0
    result = generate(hub, "--drafter", "test/bad-drafter")
    assert_one_error(result, "reads target layers [1, 3, 20], but the target has only 8 layers")


def test_bars_are_drawn_on_a_terminal_and_cleared_when_a_pull_fails(hub):
    """On a terminal the heading and a bar per file are drawn while bytes arrive; when the pull fails, the display is
    cleared (its last frame erased) and nothing is reported, so the error line stands alone."""
    import io

    from rich.console import Console

    from dflash_local.downloads import Downloader
    from dflash_local.errors import DFlashError

    hub.faults = [Fault("drop", TARGET_WEIGHTS, after=1_000_000), Fault("status", TARGET_WEIGHTS, times=99)]
    screen, report = io.StringIO(), io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=120)
    downloader = Downloader(console=terminal, report=Console(file=report))
    with pytest.raises(DFlashError, match="the download failed 5 times in a row"):
        downloader.pull(hub_module.HubSource("test/tiny"))
    drawn = screen.getvalue()
    assert "pulling test/tiny (" in drawn and "model.safetensors" in drawn, drawn
    last_frame = drawn.rsplit("\r", 1)[-1]
    assert "\x1b[2K" in last_frame and "model.safetensors" not in last_frame, repr(drawn[-400:])
    assert report.getvalue() == ""

    hub.faults.clear()
    downloader.pull(hub_module.HubSource("test/tiny"))
    assert report.getvalue().startswith("pulled test/tiny (")
    assert "  verified 6 files (size + sha256): " in report.getvalue(), report.getvalue()


def test_not_enough_disk_space_stops_before_downloading(hub, monkeypatch):
    from dflash_local.errors import DFlashError

    usage = type("usage", (), {"free": 1_000_000, "total": 10**9, "used": 0})
    monkeypatch.setattr(hub_module.shutil, "disk_usage", lambda _: usage)
    needed = hub_module.human_size(sum(len(data) for data in hub.repos["test/tiny"].values()) - 18 - 8)
    with pytest.raises(DFlashError, match=rf"Not enough disk space in .*: {needed} to download, 1\.0 MB free\."):
        hub_pull.pull(hub_module.HubSource("test/tiny"))
    assert hub.downloads() == []


def test_disk_full_mid_download_leaves_nothing_that_loads_and_keeps_the_part(hub, monkeypatch):
    from dflash_local.errors import DFlashError

    def fill_disk(chunks, handle, bar):
        handle.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_pull, "_append", fill_disk)
    source = hub_module.HubSource("test/tiny")
    with pytest.raises(DFlashError, match=r"The disk holding .* is full: free some space and pull again"):
        hub_pull.pull(source)
    assert hub_module.cached_folder(source) is None
    snapshots = hub_module.repo_folder("test/tiny") / "snapshots"
    assert not snapshots.exists() or not any(snapshots.rglob("*.safetensors"))
    parts = list((hub_module.repo_folder("test/tiny") / "blobs").glob("*.incomplete"))
    assert [p.stat().st_size for p in parts] == [1000]  # kept: the next pull resumes from it


def test_dropped_and_stalled_connections_resume_from_the_partial_file(hub, tmp_path):
    # five failed tries in a row, but each brings new bytes: the pull goes on and the sixth GET finishes the file
    hub.faults = [
        Fault("drop", TARGET_WEIGHTS, after=1_500_000, times=4),
        Fault("stall", TARGET_WEIGHTS, after=1_500_000),
    ]
    result = dflash_process(hub, "pull", "tiny-hub", HF_HUB_DOWNLOAD_TIMEOUT="1")
    assert result.returncode == 0, result.stderr
    offsets = weight_ranges(hub)
    assert len(offsets) == 6 and offsets[0] == 0
    assert all(0 < later - earlier <= 1_500_000 for earlier, later in zip(offsets[:-1], offsets[1:], strict=True))
    weights = snapshot(tmp_path, "test/tiny") / "model.safetensors"
    assert weights.read_bytes() == (MODELS / "target" / "model.safetensors").read_bytes()
    assert part_files(tmp_path, "test/tiny") == []
    assert manifests(tmp_path) == ["test--tiny-drafter@main.json", "test--tiny@main.json"]


def test_server_errors_on_every_endpoint_are_retried(hub, tmp_path):
    hub.faults = [
        Fault("status", r"^/api/models/test/tiny/revision/", times=2, status=503),
        Fault("status", r"^/test/tiny/resolve/[^/]+/config\.json$", method="HEAD", times=2, status=500),
        Fault("status", TARGET_WEIGHTS, times=3, status=503),
    ]
    result = dflash(hub, "pull", "test/tiny")
    assert result.returncode == 0, result.stderr
    assert [f.times for f in hub.faults] == [0, 0, 0]
    assert len([r for r in hub.log if r.path.startswith("/api/models/test/tiny/")]) == 3
    assert len([r for r in hub.log if r.method == "HEAD" and r.path.endswith("/config.json")]) == 3
    assert weight_ranges(hub) == [0, 0, 0, 0]
    for name in TARGET_FILES:
        assert (snapshot(tmp_path, "test/tiny") / name).read_bytes() == (MODELS / "target" / name).read_bytes()


def test_lfs_files_come_from_a_cdn_that_never_sees_the_token(hub, tmp_path):
    hub.cdn = True
    hub.faults = [Fault("drop", r"^/cdn/", after=1_000_000)]
    result = dflash(hub, "pull", "test/gated-drafter", "--token", hub.token)
    assert result.returncode == 0, result.stderr
    cdn = [r for r in hub.log if r.host == "cdn"]
    assert [(r.method, r.range) for r in cdn] == [("GET", None), ("GET", "bytes=1000000-")]
    assert [r.authorization for r in cdn] == [None, None]
    hub_calls = [r for r in hub.log if r.host == "hub"]
    assert hub_calls and all(r.authorization == f"Bearer {hub.token}" for r in hub_calls)
    weights = snapshot(tmp_path, "test/gated-drafter") / "model.safetensors"
    assert weights.read_bytes() == (MODELS / "drafter" / "model.safetensors").read_bytes()


def test_a_pull_that_keeps_failing_stops_keeps_the_part_and_marks_nothing_downloaded(hub, tmp_path):
    hub.faults = [Fault("drop", TARGET_WEIGHTS, after=2_000_000), Fault("status", TARGET_WEIGHTS, times=99)]
    failed = dflash(hub, "pull", "tiny-hub")
    assert_one_error(
        failed,
        "test/tiny/model.safetensors: the download failed 5 times in a row (the server answered 503)",
        "pull again and it resumes where it stopped.",
    )
    assert weight_ranges(hub)[0] == 0 and len(weight_ranges(hub)) == 5  # the drop brought bytes, so 4 more tries
    [part] = part_files(tmp_path, "test/tiny")
    kept = part.stat().st_size
    assert 0 < kept <= 2_000_000
    assert manifests(tmp_path) == []
    assert_one_error(dflash(hub, "chat", "tiny-hub", "--offline"), "test/tiny is not downloaded", "--offline")

    hub.faults.clear()
    resumed = dflash(hub, "pull", "tiny-hub")
    assert resumed.returncode == 0, resumed.stderr
    assert weight_ranges(hub)[-1] == kept
    assert generate(hub, "--offline").returncode == 0


@pytest.mark.parametrize(("kind", "reason"), [("stall", "timed out"), ("drop", "the connection failed")])
def test_a_connection_that_keeps_failing_is_named_in_the_error(hub, tmp_path, kind, reason):
    hub.faults = [Fault(kind, TARGET_WEIGHTS, times=99)]  # every GET: headers, then silence or a cut, no bytes
    failed = dflash_process(hub, "pull", "test/tiny", HF_HUB_DOWNLOAD_TIMEOUT="1")
    assert_one_error(failed, f"test/tiny/model.safetensors: the download failed 5 times in a row ({reason});")
    assert weight_ranges(hub) == [0, 0, 0, 0, 0]
    assert manifests(tmp_path) == []


def test_bytes_that_fail_verification_never_mark_the_model_downloaded(hub, tmp_path):
    hub.faults = [Fault("corrupt", TARGET_WEIGHTS, times=2)]
    failed = dflash(hub, "pull", "tiny-hub")
    assert_one_error(failed, "test/tiny/model.safetensors failed verification twice (size or sha256 differ).")
    assert manifests(tmp_path) == []
    assert_one_error(dflash(hub, "chat", "tiny-hub", "--offline"), "test/tiny is not downloaded", "--offline")
    assert dflash(hub, "pull", "tiny-hub").returncode == 0
    assert manifests(tmp_path) == ["test--tiny-drafter@main.json", "test--tiny@main.json"]


def test_bench_prompt_sets_from_hub_datasets(hub):
    args = ("bench", "tiny", "--limit", "2", "--max-new-tokens", "4", "--no-lookup", "--json")
    result = dflash(hub, *args, "--prompts", "gsm8k")
    assert result.returncode == 0, result.stderr
    assert [row["prompt"] for row in json.loads(result.stdout)["prompts"]] == GSM8K
    offline = dflash(hub, *args, "--prompts", "gsm8k", "--offline")
    assert offline.returncode == 0, offline.stderr
    chat = dflash(hub, *args, "--prompts", "mt-bench")
    assert [row["prompt"] for row in json.loads(chat.stdout)["prompts"]] == ["Write a haiku."]
    unreachable = dflash_process(hub, *args, "--prompts", "humaneval", HF_ENDPOINT="http://127.0.0.1:9")
    assert_one_error(unreachable, "Cannot reach")  # one line: not huggingface_hub's retry log


def test_a_gguf_catalog_entry_pulls_one_quantization_and_chats(hub, tmp_path):
    pytest.importorskip("llama_cpp")
    from dflash_local.gguf.convert import convert

    q8 = convert(MODELS / "target", tmp_path / "tiny-Q8_0.gguf", "q8_0", threads=1).read_bytes()
    hub.repos["test/tiny-gguf"] = {"tiny-Q8_0.gguf": q8, "tiny-F16.gguf": b"not needed" * 100}
    result = dflash_process(hub, "chat", "tiny-gguf-hub", "--max-new-tokens", "16", input="Write a loop.\n")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr and "tau" in result.stderr  # on a pipe, the status line goes to stderr
    assert [p.name for p in snapshot(tmp_path, "test/tiny-gguf").iterdir()] == ["tiny-Q8_0.gguf"]


def test_files_kept_in_xet_go_through_hf_xet_into_the_partial_file(hub, tmp_path, monkeypatch):
    """Where the Hub names a file's Xet hash, huggingface_hub's xet_get (with its real signature; hf-xet itself, which
    needs the Hub's storage service, replaced) writes the `.incomplete` file, which is verified like any other."""
    from unittest import mock

    import huggingface_hub.file_download

    def fetch(*, incomplete_path, xet_file_data, **_):
        found = [d for files in hub.repos.values() for d in files.values() if sha256(d) == xet_file_data.file_hash]
        incomplete_path.write_bytes(found[0])

    xet_get = mock.create_autospec(huggingface_hub.file_download.xet_get, side_effect=fetch)
    monkeypatch.setattr(huggingface_hub.file_download, "xet_get", xet_get)
    hub.xet = True
    result = dflash(hub, "pull", "tiny-hub")
    assert result.returncode == 0, result.stderr
    written = sorted(Path(call.kwargs["incomplete_path"]).name for call in xet_get.call_args_list)
    weights = [sha256((MODELS / f / "model.safetensors").read_bytes()) for f in ("target", "drafter")]
    assert written == sorted(f"{digest}.incomplete" for digest in weights)
    assert not any(r.path.endswith(".safetensors") for r in hub.downloads())  # no HTTP GET of a Xet file
    for repo, folder in (("test/tiny", "target"), ("test/tiny-drafter", "drafter")):
        pulled = snapshot(tmp_path, repo) / "model.safetensors"
        assert pulled.read_bytes() == (MODELS / folder / "model.safetensors").read_bytes()


def sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
