"""GGUFs other tools keep (ollama, LM Studio, the Hugging Face cache, llama.cpp's cache) listed by `dflash models`,
run in place by name, and never downloaded again for a catalog entry."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from in_process import invoke
from one_error import assert_one_error
from test_gguf_cli import write_header_gguf

from dflash_local.hub import human_size
from tools.hub_server import COMMIT, FakeHub, repo_of

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

MODELS = Path(__file__).resolve().parent.parent / "models" / "tiny"
PROMPT_IDS = "94,1209,1011,267,2155,7,1021,30,1024,14"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> Path:
    from dflash_local.gguf.convert import convert

    return convert(MODELS / "target", tmp_path_factory.mktemp("local") / "tiny-Q8_0.gguf", "q8_0", threads=1)


def _ollama_model(models: Path, name: str, tag: str, blob: Path, namespace: str = "library") -> Path:
    """An ollama store entry as ollama writes it: a manifest naming layers, each a blob named by its sha256."""
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    stored = models / "blobs" / f"sha256-{digest}"
    stored.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(blob, stored)
    config = models / "blobs" / f"sha256-{'0' * 64}"
    config.write_text("{}")
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'0' * 64}", "size": 2},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": blob.stat().st_size},
    ]
    manifest = models / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": layers[0], "layers": layers}))
    return stored


@pytest.fixture()
def machine(tmp_path, monkeypatch, q8) -> dict[str, Path]:
    """A HOME where ollama, LM Studio (moved home, custom downloads folder), llama.cpp's old cache and the Hugging
    Face cache each keep the tiny Q8_0 GGUF; ollama also keeps a gpt-oss blob in ollama's own architecture name."""
    home = tmp_path / "home"
    for key, value in {
        "HOME": home,
        "HF_HOME": tmp_path / "hf",
        "DFLASH_HOME": tmp_path / "dflash",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OMP_NUM_THREADS": "1",
    }.items():
        monkeypatch.setenv(key, str(value))
    for key in ("OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME", "HF_HUB_CACHE", "DFLASH_CATALOG", "HF_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    ollama = home / ".ollama" / "models"
    found = {
        "ollama": _ollama_model(ollama, "tiny", "latest", q8),
        "gptoss": _ollama_model(ollama, "gpt-oss", "20b", write_header_gguf(tmp_path / "gptoss.gguf", "gptoss")),
    }
    lms_home = tmp_path / "lmstudio-home"
    (home / ".lmstudio-home-pointer").write_text(f"{lms_home}\n")
    lms_home.mkdir()
    (lms_home / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "lms")}))
    found["lmstudio"] = tmp_path / "lms" / "someone" / "Tiny-GGUF" / "tiny-Q8_0.gguf"
    write_header_gguf(found["lmstudio"].with_name("mmproj-tiny-f16.gguf"), "clip")  # a vision projector: not a target
    found["hf-cache"] = tmp_path / "hf" / "hub" / "models--someone--Tiny-GGUF" / "snapshots" / COMMIT / "tiny.gguf"
    found["llama.cpp"] = home / ".cache" / "llama.cpp" / "someone_Tiny-GGUF_tiny-Q8_0-00001-of-00002.gguf"
    write_header_gguf(found["llama.cpp"].with_name("someone_Tiny-GGUF_tiny-Q8_0-00002-of-00002.gguf"), "llama")
    for store in ("lmstudio", "hf-cache", "llama.cpp"):
        found[store].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(q8, found[store])
    return found


def _names(machine: dict[str, Path]) -> dict[str, str]:
    """store -> the name `dflash models` must list for it."""
    names = {store: str(path) for store, path in machine.items() if store not in ("ollama", "gptoss")}
    return names | {"ollama": "ollama:tiny:latest", "gptoss": "ollama:gpt-oss:20b"}


def test_piped_models_are_one_line_each_catalog_and_every_store(machine):
    result = invoke("models")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {line.split("\t")[0]: line.split("\t") for line in lines}
    assert len(rows) == len(lines)
    from dflash_local.catalog import load_catalog

    assert set(load_catalog()) <= set(rows)
    published = {"qwen3.5-9b-q4", "gpt-oss-20b-q4", "qwen3-coder-30b-a3b-q4", "qwen3.6-27b-q4", "gemma4-31b-q4"}
    assert published <= set(rows) and all(rows[name][3].endswith(" GB") for name in published)
    assert all(rows[name][1] == "catalog" for name in load_catalog())
    expected = _names(machine)
    for store, name in expected.items():
        assert rows[name][1] == ("ollama" if store == "gptoss" else store), rows[name]
    assert rows["ollama:tiny:latest"][2] == "7.9 MB" and "llama GGUF" in rows["ollama:tiny:latest"][4]
    assert "gptoss GGUF" in rows["ollama:gpt-oss:20b"][4]
    assert not [line for line in lines if "mmproj" in line or "00002-of-00002" in line]


def test_models_json_names_each_file_read_in_place(machine):
    result = invoke("models", "--json")
    assert result.exit_code == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    for store, name in _names(machine).items():
        assert Path(rows[name]["path"]) == machine[store], rows[name]
    assert rows["ollama:tiny:latest"]["source"] == "ollama"
    assert rows["tiny"] == rows["tiny"] | {"source": "catalog", "on_disk": "bundled", "path": ""}


@pytest.mark.parametrize("columns", ["40", "80"])
def test_names_stay_whole_in_a_narrow_terminal(machine, columns):
    result = invoke("models", env={"COLUMNS": columns, "FORCE_COLOR": "1", "NO_COLOR": None})
    assert result.exit_code == 0, result.stderr
    lines = ANSI.sub("", result.stdout).splitlines()
    from dflash_local.catalog import load_catalog

    for name in [*load_catalog(), *_names(machine).values()]:
        assert name in lines, (name, lines)  # each name alone on its line, never broken
    assert max(len(line) for line in lines if line not in _names(machine).values()) <= int(columns)


def _generate(target: str | Path, *extra: str) -> list[int]:
    args = ("generate", "--target", target, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", "16", "--json", *extra)
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["output_ids"]


def test_generate_runs_from_ollama_and_lmstudio_in_place(machine, q8):
    plain = _generate(q8, "--no-draft")
    assert _generate("ollama:tiny", "--no-draft") == plain
    assert _generate("ollama:library/tiny:latest", "--drafter", str(MODELS / "drafter"), "--block-size", "4") == plain
    assert _generate(machine["lmstudio"], "--no-draft") == plain
    doctor = invoke("doctor", "ollama:tiny")
    assert doctor.exit_code == 0 and "ollama:tiny fits?" in doctor.stdout, doctor.stdout + doctor.stderr
    assert not list((Path(os.environ["HF_HOME"]) / "hub").glob("models--*/snapshots/*/*.part"))


def test_a_blob_llama_cpp_cannot_load_is_one_sentence(machine):
    line = assert_one_error(invoke("generate", "--target", "ollama:gpt-oss:20b", "--prompt-ids", "1,2", "--no-draft"))
    assert "ollama:gpt-oss:20b" in line and "'gptoss'" in line and "cannot load" in line, line


def test_an_ollama_name_not_in_the_store_is_one_sentence(machine):
    line = assert_one_error(invoke("generate", "--target", "ollama:qwen3:8b", "--prompt-ids", "1,2", "--no-draft"))
    assert "ollama:qwen3:8b is not in ollama's store" in line, line
    line = assert_one_error(invoke("generate", "--target", "ollama:a/b/c/d", "--prompt-ids", "1,2", "--no-draft"))
    assert "is not an ollama model name" in line, line


def test_a_catalog_target_already_on_disk_is_linked_not_downloaded(machine, q8, tmp_path, monkeypatch):
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(
        '[tiny-local]\nbackend = "llamacpp"\ntarget = { repo = "test/tiny-gguf", files = ["tiny-Q8_0.gguf"] }\n'
        'drafter = { repo = "test/tiny-drafter" }\n'
    )
    repos = {"test/tiny-gguf": {"tiny-Q8_0.gguf": q8.read_bytes()}, "test/tiny-drafter": repo_of(MODELS / "drafter")}
    with FakeHub(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("DFLASH_CATALOG", str(catalog))
        pulled = invoke("pull", "tiny-local")
        assert pulled.exit_code == 0, pulled.stderr
        fetched = sorted(r.path.rsplit("/", 1)[1] for r in hub.downloads())
    assert fetched == ["config.json", "model.safetensors"]  # the drafter's files only
    linked = tmp_path / "hf" / "hub" / "models--test--tiny-gguf" / "snapshots" / COMMIT / "tiny-Q8_0.gguf"
    copy = linked.resolve()
    assert linked.is_symlink() and copy in {path.resolve() for path in machine.values()}
    assert f"tiny-Q8_0.gguf: already on this machine at {copy}, used in place" in pulled.stdout
    offline = _generate("tiny-local", "--offline", "--block-size", "4")
    assert offline == _generate(q8, "--no-draft")
    removed = invoke("rm", "tiny-local")
    drafter_bytes = sum(len(data) for data in repos["test/tiny-drafter"].values())
    assert removed.exit_code == 0 and f"freed {human_size(drafter_bytes)}" in removed.stdout, removed.stdout
    assert not linked.exists() and copy.read_bytes() == q8.read_bytes()  # the other tool's file stays
