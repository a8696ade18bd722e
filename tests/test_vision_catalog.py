"""A target's vision projector found and loaded with it (issue #53): a catalog entry's `mmproj`, pulled with the target
and verified; ollama's projector layer and LM Studio's mmproj GGUF beside the model, read in place; chat, serve and
generate loading it without --mmproj (which still wins); `dflash models` and `dflash doctor` saying which models see
images. The loading tests run the tiny random Gemma 3 vision target (tests/tiny_archs.py's gemma3-vision)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from in_process import invoke
from one_error import assert_one_error
from test_gguf_cli import write_header_gguf
from test_local_models import _ollama_model

from dflash_local import hub_access
from dflash_local.catalog import load_catalog, resolve
from dflash_local.errors import DFlashError
from dflash_local.hub import HubSource, human_size
from tools.hub_server import COMMIT, FakeHub, Fault

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

SIZE = 112  # the tiny tower's image size (tests/tiny_archs.py VISION)
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
VISION_ENTRY = """
[tiny-vision]
summary = "the tiny vision target and its projector"
backend = "llamacpp"
target = "bundled:model.gguf"
mmproj = "bundled:mmproj.gguf"
"""
HUB_ENTRY = """
[vision-hub]
summary = "a GGUF target and its projector from one repo"
backend = "llamacpp"
target = { repo = "test/vision-GGUF", files = ["model-Q8_0.gguf"] }
mmproj = { repo = "test/vision-GGUF", files = ["mmproj-model-f16.gguf"] }
"""


def _refuse(source: HubSource) -> Path:
    raise AssertionError(f"{source.repo} was fetched")


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    """A HOME without any store, dflash's and the Hub cache's folders in tmp_path, no catalog of the user's."""
    home = tmp_path / "home"
    home.mkdir()
    for key, value in {"HOME": home, "HF_HOME": tmp_path / "hf", "DFLASH_HOME": tmp_path / "dflash"}.items():
        monkeypatch.setenv(key, str(value))
    for key in ("OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME", "HF_HUB_CACHE", "DFLASH_CATALOG", "HF_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return home


def _catalog(tmp_path: Path, monkeypatch, text: str, folder: Path | None = None) -> Path:
    catalog = (folder or tmp_path) / "catalog.toml"
    catalog.write_text(text)
    monkeypatch.setenv("DFLASH_CATALOG", str(catalog))
    return catalog


@pytest.mark.parametrize(
    "mmproj,words",
    [
        ('{ repo = "a/b" }', 'must name its file: { repo = "owner/name", files = ["mmproj-....gguf"] }'),
        ('{ repo = "a/b", files = ["mmproj-*.gguf"] }', "must name one .gguf file"),
        ('{ repo = "a/b", files = ["mmproj-f16.gguf", "mmproj-f32.gguf"] }', "must name one .gguf file"),
        ('"bundled:mmproj.bin"', "must name one .gguf file"),
        ('"mmproj.gguf"', 'must be "bundled:PATH" or { repo = "owner/name" }'),
    ],
)
def test_a_bad_mmproj_field_is_one_sentence(home, tmp_path, monkeypatch, mmproj, words):
    catalog = _catalog(tmp_path, monkeypatch, f'[mine]\ntarget = {{ repo = "a/b" }}\nmmproj = {mmproj}\n')
    with pytest.raises(DFlashError) as error:
        load_catalog()
    assert str(error.value).startswith(f"{catalog}: entry 'mine': mmproj ") and words in str(error.value)


def test_a_projector_needs_a_gguf_target(home, tmp_path, monkeypatch):
    text = '[mine]\nbackend = "torch"\ntarget = { repo = "a/b" }\nmmproj = "bundled:mmproj.gguf"\n'
    catalog = _catalog(tmp_path, monkeypatch, text)
    with pytest.raises(DFlashError) as error:
        load_catalog()
    assert str(error.value) == (
        f"{catalog}: entry 'mine': mmproj: a projector needs a GGUF target (backend llamacpp), not backend torch."
    )


def test_the_catalog_vision_pairs_name_their_projector_and_models_marks_them(home):
    """The bundled Gemma 3 vision entries pull their projector with the target (same repo); `dflash models` marks
    them, and no text-only entry, as seeing images."""
    catalog = load_catalog()
    for name, size in (("gemma3-4b-vision-q4", "4b"), ("gemma3-12b-vision-q4", "12b")):
        repo = f"ggml-org/gemma-3-{size}-it-GGUF"
        assert catalog[name].mmproj == HubSource(repo, ("mmproj-model-f16.gguf",))
        assert catalog[name].sources() == [catalog[name].target, catalog[name].mmproj]
        assert catalog[name].target.repo == repo and catalog[name].drafter is None
    listed = invoke("models")
    assert listed.exit_code == 0, listed.stderr
    rows = {line.split("\t")[0]: line.split("\t") for line in listed.stdout.splitlines()}
    seeing = {name for name, row in rows.items() if row[4].endswith(" · sees images")}
    assert seeing == {"gemma3-4b-vision-q4", "gemma3-12b-vision-q4"}
    shown = {row["name"]: row["projector"] for row in json.loads(invoke("models", "--json").stdout)}
    assert shown["gemma3-4b-vision-q4"] == "ggml-org/gemma-3-4b-it-GGUF/mmproj-model-f16.gguf"
    assert shown["qwen3-8b-q4"] == ""


def _blob(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "hf" / "hub" / "models--test--vision-GGUF"
    return (folder / "snapshots" / COMMIT / name).resolve()


def test_pull_fetches_the_projector_verified_and_rm_removes_it(home, tmp_path, monkeypatch):
    """`dflash pull` fetches the entry's projector beside its target (only the files named, each verified); a
    projector corrupted in the cache is fetched again; `dflash models` counts it; `dflash rm` frees it."""
    _catalog(tmp_path, monkeypatch, HUB_ENTRY)
    files = {
        "model-Q8_0.gguf": b"m" * 30000,
        "model-F16.gguf": b"f" * 50000,
        "mmproj-model-f16.gguf": b"p" * 20000,
        "mmproj-model-f32.gguf": b"q" * 40000,
    }
    with FakeHub({"test/vision-GGUF": files}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        pulled = invoke("pull", "vision-hub")
        assert pulled.exit_code == 0, pulled.stderr
        fetched = sorted(r.path.rsplit("/", 1)[1] for r in hub.downloads())
        assert fetched == ["mmproj-model-f16.gguf", "model-Q8_0.gguf"]
        assert "pulled test/vision-GGUF (mmproj-model-f16.gguf)" in pulled.stdout
        projector = _blob(tmp_path, "mmproj-model-f16.gguf")
        assert projector.read_bytes() == files["mmproj-model-f16.gguf"]
        assert resolve("vision-hub", None, _refuse).mmproj.resolve() == projector

        projector.write_bytes(b"x" * 20000)  # the same size, other bytes: only the sha256 tells
        again = invoke("pull", "vision-hub")
        assert again.exit_code == 0, again.stderr
        assert "mmproj-model-f16.gguf: was corrupted or truncated in the cache, fetched again" in again.stdout
        assert projector.read_bytes() == files["mmproj-model-f16.gguf"]

        listed = {line.split("\t")[0]: line.split("\t") for line in invoke("models").stdout.splitlines()}
        assert listed["vision-hub"][2] == human_size(50000) and listed["vision-hub"][4].endswith("sees images")
        projector.unlink()
        assert invoke("models").stdout.count("partial") == 1
        offline = invoke("generate", "--target", "vision-hub", "--prompt", "hi", "--offline")
        assert_one_error(offline, "test/vision-GGUF is not downloaded", "--offline")
        assert invoke("pull", "vision-hub").exit_code == 0
    removed = invoke("rm", "vision-hub")
    assert removed.exit_code == 0 and f"freed {human_size(50000)}" in removed.stdout, removed.stdout
    assert not (tmp_path / "hf" / "hub" / "models--test--vision-GGUF").exists()


def test_an_interrupted_projector_download_leaves_no_projector_and_resumes(home, tmp_path, monkeypatch):
    """A projector download cut midway is one sentence and leaves only its partial blob (no projector file, the
    entry not pulled); the next pull resumes from the partial bytes and verifies the whole file."""
    monkeypatch.setattr(hub_access, "FIRST_DELAY", 0.01)
    _catalog(tmp_path, monkeypatch, HUB_ENTRY)
    data = bytes(range(256)) * 400
    files = {"model-Q8_0.gguf": b"m" * 30000, "mmproj-model-f16.gguf": data}
    projector = r"/mmproj-model-f16\.gguf$"
    with FakeHub({"test/vision-GGUF": files}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.faults = [Fault("drop", projector, after=40000), Fault("status", projector, times=99)]
        assert_one_error(invoke("pull", "vision-hub"), "test/vision-GGUF/mmproj-model-f16.gguf")
        snapshot = tmp_path / "hf" / "hub" / "models--test--vision-GGUF" / "snapshots" / COMMIT
        assert not (snapshot / "mmproj-model-f16.gguf").exists()
        blobs = snapshot.parent.parent / "blobs"
        partial = [p.stat().st_size for p in blobs.glob("*.incomplete")]
        assert len(partial) == 1 and 0 < partial[0] < len(data)
        listed = {line.split("\t")[0]: line.split("\t") for line in invoke("models").stdout.splitlines()}
        assert listed["vision-hub"][2] == "partial"
        hub.faults.clear()
        assert invoke("pull", "vision-hub").exit_code == 0
        ranges = [r.range for r in hub.downloads() if r.path.endswith("/mmproj-model-f16.gguf")]
    assert ranges[-1] == f"bytes={partial[0]}-"
    assert (snapshot / "mmproj-model-f16.gguf").read_bytes() == data and not list(blobs.glob("*.incomplete"))


def _ollama_vision(models: Path, name: str, model: Path, projector: Path) -> Path:
    """An ollama model whose manifest adds its projector as a layer (as ollama stores llava-style models)."""
    _ollama_model(models, name, "latest", model)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    digest = hashlib.sha256(projector.read_bytes()).hexdigest()
    stored = models / "blobs" / f"sha256-{digest}"
    shutil.copyfile(projector, stored)
    data = json.loads(manifest.read_text())
    data["layers"].append({"mediaType": PROJECTOR_LAYER, "digest": f"sha256:{digest}", "size": stored.stat().st_size})
    manifest.write_text(json.dumps(data))
    return stored


def _lmstudio(home: Path, model: Path, projector: Path | None, folder: str = "Vision-GGUF") -> Path:
    """A model in LM Studio's folder (~/.lmstudio/models/someone/FOLDER/), its projector beside it."""
    place = home / ".lmstudio" / "models" / "someone" / folder
    place.mkdir(parents=True)
    shutil.copyfile(model, place / "vision-Q8_0.gguf")
    if projector is not None:
        shutil.copyfile(projector, place / "mmproj-vision-f16.gguf")
    return place / "vision-Q8_0.gguf"


def test_the_stores_projectors_are_found_where_they_keep_them(home, tmp_path):
    """ollama's projector layer and LM Studio's mmproj GGUF beside the model resolve as the model's projector and
    mark it in `dflash models`; a model without one, an `mmproj` file that is no projector, or a projector beside a
    GGUF outside the stores resolve to none."""
    model = write_header_gguf(tmp_path / "files" / "model.gguf", "llama")
    clip = write_header_gguf(tmp_path / "files" / "projector.gguf", "clip")
    ollama = home / ".ollama" / "models"
    blob = _ollama_vision(ollama, "vision", model, clip)
    _ollama_model(ollama, "text", "latest", write_header_gguf(tmp_path / "files" / "other.gguf", "llama", 3))
    assert resolve("ollama:vision", None, _refuse).mmproj == blob
    assert resolve("ollama:text", None, _refuse).mmproj is None
    in_lmstudio = _lmstudio(home, model, clip)
    assert resolve(str(in_lmstudio), None, _refuse).mmproj == in_lmstudio.with_name("mmproj-vision-f16.gguf")
    not_clip = _lmstudio(home, model, None, "Other-GGUF")
    write_header_gguf(not_clip.with_name("mmproj-other.gguf"), "llama")
    assert resolve(str(not_clip), None, _refuse).mmproj is None
    outside = tmp_path / "elsewhere" / "vision-Q8_0.gguf"
    outside.parent.mkdir()
    shutil.copyfile(model, outside)
    shutil.copyfile(clip, outside.with_name("mmproj-vision-f16.gguf"))
    assert resolve(str(outside), None, _refuse).mmproj is None

    rows = {row["name"]: row for row in json.loads(invoke("models", "--json").stdout)}
    assert rows["ollama:vision:latest"]["projector"] == str(blob)
    assert rows[str(in_lmstudio)]["projector"] == str(in_lmstudio.with_name("mmproj-vision-f16.gguf"))
    assert rows["ollama:text:latest"]["projector"] == rows[str(not_clip)]["projector"] == ""
    lines = {line.split("\t")[0]: line for line in invoke("models").stdout.splitlines()}
    assert lines["ollama:vision:latest"].endswith(" · sees images") and lines[str(in_lmstudio)].endswith("images")
    assert "images" not in lines["ollama:text:latest"] and "images" not in lines[str(not_clip)]


# The tiny vision target, loaded by every front end.


@pytest.fixture(scope="module")
def vision(tmp_path_factory) -> Path:
    """gemma3-vision's folder (model.gguf, mmproj.gguf, hf-text/), with a catalog naming the pair (bundled paths)."""
    from test_architectures import build_tiny

    folder = build_tiny(tmp_path_factory.mktemp("vision-catalog"), "gemma3-vision") / "gemma3-vision"
    (folder / "catalog.toml").write_text(VISION_ENTRY)
    return folder


def png(path: Path, seed: int) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _generate(target: str | Path, *extra: str | Path) -> list[int]:
    args = ["generate", "--target", target, "--prompt", " What is it?", "--no-draft", "--max-new-tokens", "8"]
    result = invoke(*args, "--threads", "1", "--max-context", "256", "--json", "--offline", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["output_ids"]


def test_generate_loads_the_catalog_entrys_projector(vision, home, tmp_path, monkeypatch):
    """`generate --image` with a catalog name whose entry names a projector: no --mmproj needed, the same tokens as
    the explicit pair; an explicit --mmproj wins over the entry's; a text-only target's --image is one sentence."""
    monkeypatch.setenv("DFLASH_CATALOG", str(vision / "catalog.toml"))
    image = png(tmp_path / "a.png", 0)
    explicit = _generate(vision / "model.gguf", "--mmproj", vision / "mmproj.gguf", "--image", image)
    assert _generate("tiny-vision", "--image", image) == explicit
    assert _generate("tiny-vision", "--image", png(tmp_path / "b.png", 1)) != explicit
    args = ("--prompt", "hi", "--image", image, "--offline", "--no-draft", "--threads", "1")
    missing = invoke("generate", "--target", "tiny-vision", *args, "--mmproj", tmp_path / "none.gguf")
    assert_one_error(missing, f"No projector file {tmp_path / 'none.gguf'}.")
    text_only = invoke("generate", "--target", vision / "model.gguf", "--prompt", "hi", "--image", image, "--offline")
    assert_one_error(text_only, "--image needs --prompt and the target's vision projector (--mmproj FILE)")


def test_a_pulled_vision_pair_takes_images_offline(vision, home, tmp_path, monkeypatch):
    """The pair pulled from a loopback Hub (target and projector, each verified) answers an image offline with the
    tokens of the same files given by path."""
    _catalog(tmp_path, monkeypatch, HUB_ENTRY)
    files = {"model-Q8_0.gguf": (vision / "model.gguf").read_bytes()}
    files["mmproj-model-f16.gguf"] = (vision / "mmproj.gguf").read_bytes()
    with FakeHub({"test/vision-GGUF": files}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert invoke("pull", "vision-hub").exit_code == 0
    image = png(tmp_path / "a.png", 0)
    explicit = _generate(vision / "model.gguf", "--mmproj", vision / "mmproj.gguf", "--image", image)
    assert _generate("vision-hub", "--image", image) == explicit


def test_the_stores_projectors_load_like_mmproj(vision, home, tmp_path):
    """An ollama model with a projector layer and an LM Studio model with its mmproj GGUF beside it answer an image
    without --mmproj, as the same files given with --mmproj do."""
    image = png(tmp_path / "a.png", 0)
    explicit = _generate(vision / "model.gguf", "--mmproj", vision / "mmproj.gguf", "--image", image)
    _ollama_vision(home / ".ollama" / "models", "vision", vision / "model.gguf", vision / "mmproj.gguf")
    assert _generate("ollama:vision", "--image", image) == explicit
    lmstudio = _lmstudio(home, vision / "model.gguf", vision / "mmproj.gguf")
    assert _generate(lmstudio, "--image", image) == explicit


def test_chat_and_serve_load_the_entrys_projector(vision, home, tmp_path, monkeypatch):
    """`dflash chat NAME` takes /image with the entry's projector (a text-only target refuses it); serve's engine
    for the entry holds the projector and answers an image request, one for a text-only target holds none."""
    import openai
    from test_serve_clients import KEY, serving
    from test_serve_vision import b64
    from test_serve_vision import png as png_bytes

    from dflash_local.chat_template import read_template
    from dflash_local.cli.options import DecodeOptions, ModelOptions
    from dflash_local.cli.serve import _engine

    monkeypatch.setenv("DFLASH_CATALOG", str(vision / "catalog.toml"))
    image = png(tmp_path / "a.png", 0)
    common = ["--chat-template", "chatml", "--no-draft", "--max-new-tokens", "4", "--threads", "1", "--offline"]
    lines = f"/image {image}\nWhat is it?\n"
    chat = invoke("chat", "tiny-vision", *common, "--max-context", "256", input=lines)
    assert chat.exit_code == 0 and "error" not in chat.stderr and "(image 1 attached" in chat.stdout, chat.stderr
    text_only = invoke("chat", vision / "model.gguf", *common, "--max-context", "256", input=lines)
    assert text_only.exit_code == 0 and "error: This chat takes no images" in text_only.stderr, text_only.stderr

    options = ModelOptions(threads=1, max_context=256, offline=True)
    plain, chatml = DecodeOptions(no_draft=True), read_template("chatml")
    assert _engine(str(vision / "model.gguf"), plain, options, chatml, None, 4).projector is None
    engine = _engine("tiny-vision", plain, options, chatml, None, 4)
    assert engine.projector is not None and engine.projector.path == vision / "mmproj.gguf"
    with serving(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png_bytes(0))}"}}
        content = [{"type": "text", "text": "What is it?"}, part]
        answer = client.chat.completions.create(
            model="tiny-vision", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=4
        )
        assert answer.choices[0].message.content is not None and answer.usage.prompt_tokens > 16


def test_doctor_says_which_models_take_images_and_counts_the_projector(vision, home, tmp_path, monkeypatch):
    """`dflash doctor NAME`: a model with a projector takes images and its fit check counts the projector's bytes;
    a text-only one does not; a catalog entry not pulled yet says its projector comes with the pull."""
    from dflash_local import doctor

    monkeypatch.setenv("DFLASH_CATALOG", str(vision / "catalog.toml"))
    monkeypatch.setattr(doctor, "memory_budget", lambda: ("GPU test", 100.0))
    checks = {check.name: check for check in doctor.model_checks("tiny-vision")}
    where = f"{vision / 'mmproj.gguf'}, {human_size((vision / 'mmproj.gguf').stat().st_size)}"
    assert checks["tiny-vision images?"].found == f"yes: its vision projector loads with it ({where})"
    without, _ = doctor.estimate_gb(vision / "model.gguf", None)
    projector_gb = (vision / "mmproj.gguf").stat().st_size / 1e9
    assert f"needs ~{without + projector_gb:.1f} GB" in checks["tiny-vision fits?"].found
    assert doctor.estimate_gb(vision / "model.gguf", None, vision / "mmproj.gguf")[0] == pytest.approx(
        without + projector_gb
    )
    text = {check.name: check for check in doctor.model_checks(str(vision / "model.gguf"))}
    assert text[f"{vision / 'model.gguf'} images?"].found.startswith("no: text only")
    not_pulled = {check.name: check for check in doctor.model_checks("gemma3-4b-vision-q4")}
    found = not_pulled["gemma3-4b-vision-q4 images?"].found
    assert found == "yes: its vision projector loads with it (fetched by `dflash pull gemma3-4b-vision-q4`)"
