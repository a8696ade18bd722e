"""Images through llama.cpp's libmtmd (dflash_local/vision.py): a tiny random Gemma 3 with a SigLIP vision tower
(tests/tiny_archs.py's gemma3-vision, converted by llama.cpp's own converter, text model and --mmproj projector). Its
image embeddings equal transformers' vision tower + projector; with an image in the prompt DFlash gives plain
decoding's tokens; a session reuses a prefix holding the same image and never another's; bad images and an image to
a text-only target are one `error:` sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import oracle_python
from safetensors.torch import load_file, save_file
from test_gguf_lossless import auto_policy
from tiny_models import make_drafter

from dflash_local.chat import Chat, _turn
from dflash_local.chat_template import read_template, use_template
from dflash_local.decode import Settings, Stats, run
from dflash_local.drafters.suffix_index import SuffixIndex
from dflash_local.drafters.torch_drafter import DFlashDrafter
from dflash_local.errors import DFlashError
from dflash_local.generation import load_models
from dflash_local.prompt_cache import PromptCache
from dflash_local.runtime import LoadSpec, RuntimeConfig
from dflash_local.session import Session
from dflash_local.targets.llamacpp import LlamaCppTarget
from dflash_local.vision import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MEDIA_MARKER,
    Chunk,
    Projector,
    load_projector,
    prefill,
)

TESTS = Path(__file__).resolve().parent
SIZE, ROWS = 112, 16  # the tiny tower's image size and rows per image (tests/tiny_archs.py VISION, IMAGE_ROWS)
TOLERANCE = 2e-3  # llama.cpp's projection matrix is F16 (the converter forces it), the rest F32
NEW_TOKENS = 24
LOOKUP_TAU = 2.0  # auto's least tau after the image with lookup's drafts beside the trained drafter (docs/vision.md)


def pixels(seed: int) -> np.ndarray:
    """A seeded random RGB image of the tower's own size (no resampling on either side)."""
    return np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def model(vision_model) -> Path:
    """gemma3-vision's folder (conftest's, built once per session): hf/, hf-text/, model.gguf and mmproj.gguf."""
    return vision_model


@pytest.fixture(scope="module")
def target(model) -> LlamaCppTarget:
    return LlamaCppTarget.load(model / "model.gguf", LoadSpec(RuntimeConfig(threads=1), max_context=256))


@pytest.fixture(scope="module")
def projector(model, target) -> Projector:
    return Projector(model / "mmproj.gguf", target.context.model, 1)


def image_chunks(projector: Projector, seed: int, question: str = "What is it?") -> list[Chunk]:
    """A prompt of text, one image and text, as the projector splits and encodes it."""
    prompt = f"Look: {projector.marker} {question}"
    return projector.chunks(prompt, [projector.bitmap_of_pixels(pixels(seed))])


def test_image_embeddings_equal_transformers_vision_tower_and_projector(model, projector, tmp_path):
    """mtmd's embeddings of an image equal transformers' get_image_features on the same pixels within TOLERANCE
    (relative to the largest value); the image is one non-causal chunk of ROWS rows between text chunks."""
    chunks = image_chunks(projector, 0)
    assert [c.ids is None for c in chunks] == [False, True, False]
    image = chunks[1]
    assert image.embeddings.shape == (ROWS, 32) and image.non_causal
    save_file({"pixels": torch.from_numpy(pixels(0))}, tmp_path / "pixels.safetensors")
    command = [oracle_python(), TESTS / "tiny_archs.py", "--image-features", model / "hf"]
    done = subprocess.run(
        [*command, tmp_path / "pixels.safetensors", tmp_path / "features.safetensors"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = load_file(tmp_path / "features.safetensors")["features"].numpy()
    scale = np.abs(reference).max()
    error = np.abs(image.embeddings - reference).max() / scale
    print(f"image embeddings: max |mtmd - transformers| / max |transformers| = {error:.2e}")
    assert error < TOLERANCE
    other = image_chunks(projector, 1)[1].embeddings
    assert np.abs(other - reference).max() / scale > 100 * TOLERANCE  # another image is told apart


@pytest.fixture(scope="module")
def drafter(model, tmp_path_factory) -> DFlashDrafter:
    """A random-weight block-16 DFlash drafter shaped for the text model."""
    folder = make_drafter(tmp_path_factory.mktemp("vision-drafter") / "drafter", model / "hf-text", std=0.2)
    return DFlashDrafter.load(folder, LoadSpec(max_context=256))


@pytest.fixture(scope="module")
def trained(vision_drafter) -> DFlashDrafter:
    """conftest's drafter trained by `dflash train` for the text model (text only)."""
    return DFlashDrafter.load(vision_drafter, LoadSpec(max_context=256))


def decode(
    target, drafter, chunks: list[Chunk], block: int | None, policy=None, lookup: bool = False
) -> tuple[list[int], Stats]:
    """The new ids of a greedy generation after an image prompt (block 1: plain; None: the drafter's block under the
    policy) and its stats (prefill_tokens: the prompt positions the decode loop's prefill forwarded; the image's rows
    were fed before it)."""
    session, drafting = Session(), drafter if block != 1 else None
    ids, _ = prefill(target, drafting, chunks, session)
    settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block, draft=block != 1, lookup=lookup)
    return run(target, drafting, ids, settings, policy, session=session)


def test_dflash_with_an_image_equals_plain_decoding(target, drafter, trained, projector):
    """T=0, the drafter `dflash train` trained (conftest's) at blocks 4 and 16 and under --block-size auto's policy
    (several sizes chosen), with lookup's drafts beside it and without, and the random drafter at 16: DFlash's tokens
    after an image prompt are plain decoding's, and the decode loop forwards only the text after the image. Under
    auto with lookup, blocks are accepted (tau > LOOKUP_TAU: the target repeats itself), so multi-token accepts and
    rollbacks happen with the image's rows in the caches; the trained drafter's own drafts are not (tau 1.0: it was
    trained on text, and this random target's answers after an image are runs of tokens its text never led to)."""
    chunks = image_chunks(projector, 0)
    plain, stats = decode(target, None, chunks, 1)
    assert stats.prefill_tokens == len(chunks[-1]) and len(plain) == NEW_TOKENS
    new, stats = decode(target, drafter, chunks, 16)
    assert (new, stats.prefill_tokens) == (plain, len(chunks[-1]))
    taus = {}
    for lookup in (False, True):
        for block in (4, 16, None):
            policy = auto_policy(trained.block_size) if block is None else None
            new, stats = decode(target, trained, chunks, block, policy, lookup)
            assert (new, stats.prefill_tokens) == (plain, len(chunks[-1])), (block, lookup)
            taus[block or "auto", lookup] = round(stats.tau, 2)
            assert block or len(set(stats.block_sizes)) > 1, stats.block_sizes
    print(f"after an image, tau by (block, lookup): {taus}")
    assert taus["auto", True] > LOOKUP_TAU, taus


def test_the_drafter_gets_features_at_every_prompt_position(target, drafter, projector):
    """After an image prompt's prefill the drafter's held features cover every position before the last text
    chunk, image rows included, and those rows carry the image (another image: other features, same text rows)."""

    def features(seed: int) -> tuple[torch.Tensor, int]:
        session, chunks = Session(), image_chunks(projector, seed)
        ids, _ = prefill(target, drafter, chunks, session)
        assert session.length == len(ids) - len(chunks[-1])
        return drafter.held, len(chunks[0])

    first, before = features(0)
    second, _ = features(1)
    assert first.shape == (before + ROWS, 32 * len(drafter.target_layer_ids))
    assert torch.equal(first[:before], second[:before])
    assert (first[before:] - second[before:]).abs().amax(dim=1).min() > 1e-2


def test_the_image_and_its_non_causal_rows_change_the_output(target, drafter, projector):
    """The equality above is not vacuous: another image, or the same image's rows fed causally (a broken feed), give
    other tokens, so DFlash decoding that fed them so would fail it."""
    chunks = image_chunks(projector, 0)
    plain, _ = decode(target, None, chunks, 1)
    assert decode(target, None, image_chunks(projector, 1), 1)[0] != plain
    causal = [Chunk(c.ids, c.embeddings, False) for c in chunks]
    assert decode(target, None, causal, 1)[0] != plain
    assert decode(target, drafter, causal, 16)[0] != plain


def test_image_rows_have_ids_of_their_image(projector):
    """An image's rows get negative ids (never a vocabulary id), one distinct id per row, the same for the same
    image and none shared with another image (or with the same rows fed causally)."""
    first, again, other = image_chunks(projector, 0)[1], image_chunks(projector, 0)[1], image_chunks(projector, 1)[1]
    ids = first.row_ids()
    assert len(ids) == ROWS == len(set(ids)) and all(i < 0 for i in ids)
    assert again.row_ids() == ids
    assert not set(other.row_ids()) & set(ids)
    assert not set(Chunk(None, first.embeddings, not first.non_causal).row_ids()) & set(ids)


class Counting:
    """Counts the prompt rows a target forwards: text ids and image rows (the instance's methods wrapped)."""

    def __init__(self, target, monkeypatch) -> None:
        self.text = self.image = 0
        forward, forward_embeddings = target.forward, target.forward_embeddings

        def counted_forward(ids, *args, **kwargs):
            self.text += len(ids)
            return forward(ids, *args, **kwargs)

        def counted_embeddings(rows, *args, **kwargs):
            self.image += len(rows)
            return forward_embeddings(rows, *args, **kwargs)

        monkeypatch.setattr(target, "forward", counted_forward)
        monkeypatch.setattr(target, "forward_embeddings", counted_embeddings)

    def take(self) -> tuple[int, int]:
        """(text ids, image rows) forwarded since the last take."""
        counts, self.text, self.image = (self.text, self.image), 0, 0
        return counts


def turn(target, drafter, chunks: list[Chunk], session: Session, block: int = 16) -> tuple[list[int], int]:
    """A greedy generation after an image prompt in the given session: its new ids and the prompt positions the
    decode loop's prefill forwarded."""
    ids, _ = prefill(target, drafter if block > 1 else None, chunks, session)
    settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block, draft=block > 1, lookup=False)
    new, stats = run(target, drafter if block > 1 else None, ids, settings, session=session)
    return new, stats.prefill_tokens


@pytest.mark.parametrize("block", [1, 16])
def test_the_same_image_twice_reuses_the_caches_and_another_image_does_not(
    target, drafter, projector, monkeypatch, block
):
    """In one session the same image prompt again forwards no image row and one text id, a longer question after
    the same image only its new text, and neither encodes the image again; another image is encoded and forwards its
    rows (the text before it is kept). Each gives fresh caches' tokens."""
    fresh = {seed: turn(target, drafter, image_chunks(projector, seed), Session(), block)[0] for seed in (0, 1)}
    fresh_longer = turn(target, drafter, image_chunks(projector, 0, "What is it? Say more."), Session(), block)[0]
    counting, session, encoded, encode = Counting(target, monkeypatch), Session(), [], projector._encode
    monkeypatch.setattr(projector, "_encode", lambda chunk, rows: encoded.append(rows) or encode(chunk, rows))
    assert turn(target, drafter, image_chunks(projector, 0), session, block)[0] == fresh[0]
    assert counting.take()[1] == ROWS and encoded == [ROWS]
    new, forwarded = turn(target, drafter, image_chunks(projector, 0), session, block)
    assert (new, forwarded) == (fresh[0], 1)
    assert counting.take()[1] == 0 and encoded == [ROWS]
    longer = image_chunks(projector, 0, "What is it? Say more.")
    new, forwarded = turn(target, drafter, longer, session, block)
    assert new == fresh_longer and forwarded < len(longer[-1]) - 1
    assert counting.take()[1] == 0 and encoded == [ROWS]
    other = image_chunks(projector, 1)
    ids, kept = prefill(target, drafter if block > 1 else None, other, session)
    assert counting.take() == (0, ROWS) and kept == len(other[0])  # the text before the image kept, not its rows
    assert encoded == [ROWS, ROWS]
    settings = Settings(max_new_tokens=NEW_TOKENS, block_size=block, draft=block > 1, lookup=False)
    assert run(target, drafter if block > 1 else None, ids, settings, session=session)[0] == fresh[1]


def test_the_prompt_cache_swaps_in_a_saved_image_prompt(target, drafter, projector, monkeypatch):
    """With serve's prompt cache, image A, then image B, then A again: A's saved state is swapped in (no image row
    forwarded) and gives fresh caches' tokens; B never reuses A's rows."""
    chunks = {seed: image_chunks(projector, seed) for seed in (0, 1)}
    fresh = {seed: turn(target, drafter, chunks[seed], Session())[0] for seed in (0, 1)}
    counting, session = Counting(target, monkeypatch), Session(PromptCache(2**30))
    for seed, rows in ((0, ROWS), (1, ROWS), (0, 0)):
        assert turn(target, drafter, chunks[seed], session)[0] == fresh[seed], seed
        assert counting.take()[1] == rows, seed


def test_an_image_prompt_past_the_context_is_one_sentence(target, projector):
    """An image prompt longer than the context is refused before any row goes into the caches."""
    chunks = image_chunks(projector, 0, "word " * 300)
    with pytest.raises(DFlashError, match=r"The prompt \(\d+ tokens\) does not fit the 256-token context"):
        prefill(target, None, chunks, Session())


def test_an_mtp_drafter_with_an_image_is_one_sentence(target, drafter, projector, monkeypatch):
    """An MTP drafter's layer reads each position's token id, which an image row has none of (llama.cpp aborts the
    process on a negative id): refused in one sentence before any row is fed."""
    monkeypatch.setattr(drafter, "source", "mtp")
    fed = target.length
    with pytest.raises(DFlashError, match="^An MTP drafter takes no images yet"):
        prefill(target, drafter, image_chunks(projector, 0), Session())
    assert target.length == fed


def test_image_rows_are_never_drafted_nor_fed_as_tokens(target):
    """Lookup's index never proposes an image row (a negative id) nor indexes what precedes one; the decode loop
    refuses a prompt whose image rows the session's caches do not hold."""
    index = SuffixIndex()
    index.extend([5, 6, 7, -3, -4, 8, 5, 6])
    assert index.match(5).tokens == [7, 7, 7, 7, 7]
    index.clear()
    index.extend([9, -3, -4, 9])
    assert index.match(3) is None
    settings = Settings(max_new_tokens=2, block_size=1, draft=False, lookup=False)
    words = r"Prompt token id -3 is outside the vocabulary \(0\.\.31999\) and no image row held"
    with pytest.raises(DFlashError, match=words):
        run(target, None, [2, -3, -4, 5], settings, session=Session())


def dflash(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dflash_local", "generate", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def png(path: Path, image: np.ndarray) -> Path:
    from PIL import Image

    Image.fromarray(image).save(path)
    return path


def test_generate_with_an_image(model, tmp_path):
    """`dflash generate --mmproj FILE --image PATH` decodes after the image; another image gives other ids."""
    common = ["--target", model / "model.gguf", "--mmproj", model / "mmproj.gguf", "--prompt", " What is it?"]
    common += ["--no-draft", "--max-new-tokens", 12, "--threads", 1, "--json", "--offline"]
    first = dflash(*common, "--image", png(tmp_path / "a.png", pixels(0)))
    assert first.returncode == 0, first.stderr
    second = dflash(*common, "--image", png(tmp_path / "b.png", pixels(1)))
    assert second.returncode == 0, second.stderr
    assert first.stdout != second.stdout


def test_bad_images_are_one_error_sentence(model, tmp_path):
    """Not an image, a truncated one, one of too many pixels or bytes, a missing file, or an image to a text-only
    target (no projector): one `error:` line, exit status 1."""
    good = png(tmp_path / "good.png", pixels(0)).read_bytes()
    (tmp_path / "text.png").write_text("not an image\n")
    (tmp_path / "cut.png").write_bytes(good[: len(good) // 2])
    side = int(MAX_IMAGE_PIXELS**0.5) + 1  # a header claiming side x side pixels
    (tmp_path / "huge.png").write_bytes(good[:16] + side.to_bytes(4, "big") * 2 + good[24:])
    with open(tmp_path / "big.png", "wb") as big:  # a sparse file past the byte limit
        big.write(good)
        big.truncate(MAX_IMAGE_BYTES + 1)
    base = ["--target", model / "model.gguf", "--prompt", "hi", "--no-draft", "--max-new-tokens", 2, "--offline"]
    cases = {
        "text.png": "is not an image dflash reads",
        "cut.png": "could not be decoded as an image",
        "huge.png": f"is {side}x{side} pixels",
        "big.png": f"is {MAX_IMAGE_BYTES + 1} bytes, more than an image may be",
        "missing.png": "Cannot read the image",
    }
    for name, words in cases.items():
        done = dflash(*base, "--mmproj", model / "mmproj.gguf", "--image", tmp_path / name)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (
            name,
            done.stderr,
        )
    done = dflash(*base, "--image", tmp_path / "good.png")
    assert done.returncode == 1 and done.stderr.strip().startswith("error: --image needs --prompt and the target's")


def test_chat_attaches_an_image_to_the_next_message(model, tmp_path, monkeypatch):
    """`dflash chat --mmproj`: /image PATH attaches an image to the next message (a bad one is one `error:` line and
    the chat goes on); the next turn keeps the image in the caches (no row forwarded again); without a projector
    /image is one error line."""
    from io import StringIO

    from rich.console import Console

    models = load_models(model / "model.gguf", None, LoadSpec(RuntimeConfig(threads=1), max_context=256), False)
    models.tokenizer.config = use_template(models.tokenizer.config, read_template("chatml"), model / "model.gguf")
    settings = Settings(max_new_tokens=8, block_size=1, draft=False, lookup=False)
    out, notes = StringIO(), StringIO()
    chat = Chat(models, settings, Console(file=out), Console(file=notes, width=400), None, None)
    assert _turn(chat, f"/image {png(tmp_path / 'a.png', pixels(0))}") is True
    assert notes.getvalue().startswith("error: This chat takes no images")
    chat.projector = load_projector(models, model / "mmproj.gguf", 1)
    (tmp_path / "text.png").write_text("not an image\n")
    for name, words in (("missing.png", "Cannot read the image"), ("text.png", "is not an image dflash reads")):
        notes.truncate(0), notes.seek(0)
        assert _turn(chat, f"/image {tmp_path / name}") is True
        lines = notes.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert not chat.pending
    counting = Counting(models.target, monkeypatch)
    assert _turn(chat, f"/image {tmp_path / 'a.png'}") is False and len(chat.pending) == 1
    assert _turn(chat, "What is it?") is False and not chat.pending
    assert counting.take()[1] == ROWS and chat.state.messages[-1]["content"]
    assert _turn(chat, "And the colours?") is False
    assert counting.take()[1] == 0  # the first turn's image stays in the caches
    assert chat.state.messages[0]["images"] and len(chat.state.messages) == 4
    bare = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the prompt ends near the image
    models.tokenizer.config = use_template(models.tokenizer.config, bare, model / "model.gguf")
    assert _turn(chat, f"/image {tmp_path / 'a.png'}") is False and _turn(chat, "") is False
    assert len(chat.state.messages) == 6


def test_chat_attaches_the_image_files_a_message_names(model, tmp_path, monkeypatch):
    """A message naming an image file (a path in piped input, quoted or not, trailing punctuation aside) takes that
    image as /image would and leaves its path out of the text; a path to no file, a file that is not an image suffix,
    and a chat without a projector keep the text as it is; a bad image is one `error:` line and sends nothing."""
    from io import StringIO

    from rich.console import Console

    models = load_models(model / "model.gguf", None, LoadSpec(RuntimeConfig(threads=1), max_context=256), False)
    models.tokenizer.config = use_template(models.tokenizer.config, read_template("chatml"), model / "model.gguf")
    settings = Settings(max_new_tokens=4, block_size=1, draft=False, lookup=False)
    out, notes = StringIO(), StringIO()
    chat = Chat(models, settings, Console(file=out), Console(file=notes, width=400), None, None)
    image = png(tmp_path / "my photo.png", pixels(0))
    assert _turn(chat, f"What is in '{image}'?") is False
    assert "images" not in chat.state.messages[0] or not chat.state.messages[0]["images"]
    assert str(image) in chat.state.messages[0]["content"]  # no projector: the text as it was
    chat.state.messages = []
    chat.projector = load_projector(models, model / "mmproj.gguf", 1)
    counting = Counting(models.target, monkeypatch)
    assert _turn(chat, f"What is in '{image}'?") is False
    first = chat.state.messages[0]
    assert len(first["images"]) == 1 and first["content"] == MEDIA_MARKER + "What is in ?", first["content"]
    assert counting.take()[1] == ROWS and f"(image attached: {image})" in notes.getvalue()
    plain = png(tmp_path / "b.png", pixels(1))
    assert _turn(chat, f"and {plain}, {tmp_path / 'none.png'} and {tmp_path}?") is False
    second = chat.state.messages[2]
    assert (
        len(second["images"]) == 1 and second["content"] == f"{MEDIA_MARKER}and {tmp_path / 'none.png'} and {tmp_path}?"
    )
    (tmp_path / "text.png").write_text("not an image\n")
    notes.truncate(0), notes.seek(0)
    assert _turn(chat, f"and {tmp_path / 'text.png'}") is True and len(chat.state.messages) == 4
    assert notes.getvalue().startswith("error: ") and "is not an image dflash reads" in notes.getvalue()
    assert not chat.pending
