"""Images in a prompt: a projector (llama.cpp's libmtmd over an mmproj GGUF) turns a prompt holding media markers and
image files into text chunks (token ids) and image chunks (embedding rows the target takes as prompt rows)."""

from __future__ import annotations

import ctypes
import hashlib
import re
import struct
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .errors import DFlashError

if TYPE_CHECKING:  # llama_lib loads llama.cpp on import: only once a projector loads (after serve's device setup)
    from .decode import Settings
    from .drafters.base import Drafter
    from .generation import LoadedModels
    from .llama_lib import llama_cpp
    from .session import Session
    from .targets.llamacpp import LlamaCppTarget

MAX_IMAGE_BYTES = 32 * 1024 * 1024  # an image file's most bytes
MAX_IMAGE_PIXELS = 40_000_000  # an image's most pixels (width x height), read from its header before decoding
MEDIA_MARKER = "<__media__>"  # where an image goes in a prompt's text (libmtmd's default marker)
IMAGE_ID_SPAN = 1 << 62  # image rows' ids are -1..-IMAGE_ID_SPAN: never a vocabulary id, never fed
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp")  # what check_image reads, as a file's name ends
_WORD = re.compile(r"""'([^']+)'|"([^"]+)"|(\S+)""")  # a quoted path, or a word
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # frame markers: the size


class Chunk:
    """A run of prompt positions: token ids (text), or embedding rows (an image) with whether they attend to each
    other both ways (Gemma 3's image rows: llama.cpp's non-causal attention inside the image). A projector's image
    chunk has a key (its pixels' and projector's digest) and encodes its rows on first use, so an image the caches
    already hold is never encoded again."""

    def __init__(
        self,
        ids: list[int] | None = None,
        embeddings: np.ndarray | None = None,
        non_causal: bool = False,
        *,
        key: bytes | None = None,
        rows: int = 0,
        encode: Callable[[], np.ndarray] | None = None,
    ) -> None:
        self.ids, self.non_causal, self.key, self._encode = ids, non_causal, key, encode
        self._embeddings = embeddings
        self.rows = len(embeddings) if embeddings is not None else rows

    @property
    def embeddings(self) -> np.ndarray | None:
        """An image's rows (encoded now where they were not yet); None for text."""
        if self._embeddings is None and self._encode is not None:
            self._embeddings, self._encode = self._encode(), None
        return self._embeddings

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else self.rows

    def row_ids(self) -> list[int]:
        """The chunk's ids: a text chunk's tokens, or an image's rows as negative ids derived from its key (else its
        embeddings), one distinct id per row, so that only the same image matches them in the session and the prompt
        cache."""
        if self.ids is not None:
            return self.ids
        if self.key is not None:
            digest = hashlib.sha256(self.key + bytes([self.non_causal]) + str(self.rows).encode()).digest()
        else:
            rows = np.ascontiguousarray(self.embeddings, dtype=np.float32)
            digest = hashlib.sha256(rows.tobytes() + bytes([self.non_causal]) + str(rows.shape).encode()).digest()
        ids = []
        for row in range(self.rows):
            value = int.from_bytes(hashlib.sha256(digest + row.to_bytes(8, "little")).digest()[:8], "little")
            ids.append(-1 - value % IMAGE_ID_SPAN)
        return ids


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, JPEG, GIF or BMP header; None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"BM" and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return abs(width), abs(height)
    if data[:2] == b"\xff\xd8":
        at = 2
        while at + 9 <= len(data) and data[at] == 0xFF:
            marker, length = data[at + 1], struct.unpack(">H", data[at + 2 : at + 4])[0]
            if marker in _JPEG_SOF:
                height, width = struct.unpack(">HH", data[at + 5 : at + 9])
                return width, height
            at += 2 + length
    return None


def read_image(path: Path) -> bytes:
    """An image file's bytes, checked (check_image), after checking its size before reading it."""
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise DFlashError(f"{path} is {size} bytes, more than an image may be ({MAX_IMAGE_BYTES} bytes).")
        data = path.read_bytes()
    except OSError as exc:
        raise DFlashError(f"Cannot read the image {path} ({exc.strerror or exc}).") from None
    return check_image(data, str(path))


def named_images(text: str) -> tuple[list[Path], str]:
    """The image files a message names (a word or quoted path ending in an image suffix, trailing punctuation aside,
    naming a file that is there), and the message without them; as ollama reads paths in a prompt."""
    found: list[Path] = []

    def take(match: re.Match) -> str:
        word = next(group for group in match.groups() if group is not None)
        path = Path(word.rstrip(",;:!?)")).expanduser()
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file():
            found.append(path)
            return ""
        return match.group(0)

    rest = _WORD.sub(take, text)
    return found, " ".join(rest.split()) if found else text


def check_image(data: bytes, name: str) -> bytes:
    """The image's bytes where it holds at most MAX_IMAGE_BYTES and is a PNG, JPEG, GIF or BMP (its header) of at
    most MAX_IMAGE_PIXELS pixels; else one error sentence naming it."""
    if len(data) > MAX_IMAGE_BYTES:
        raise DFlashError(f"{name} is {len(data)} bytes, more than an image may be ({MAX_IMAGE_BYTES} bytes).")
    dims = image_size(data)
    if dims is None:
        raise DFlashError(f"{name} is not an image dflash reads (PNG, JPEG, GIF or BMP).")
    if dims[0] * dims[1] > MAX_IMAGE_PIXELS or 0 in dims:
        raise DFlashError(f"{name} is {dims[0]}x{dims[1]} pixels; an image may have 1 to {MAX_IMAGE_PIXELS} pixels.")
    return data


class Projector:
    """A vision projector (an mmproj GGUF) loaded by libmtmd for a text model that llama.cpp has loaded."""

    def __init__(self, path: Path, model: llama_cpp.llama_model_p, threads: int) -> None:
        from .llama_lib import first_llama_error, llama_cpp, mtmd_library

        mtmd = self.mtmd = mtmd_library()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.print_timings, params.warmup, params.n_threads = False, False, False, threads
        if not Path(path).is_file():
            raise DFlashError(f"No projector file {path}.")
        ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            reason = first_llama_error().removeprefix("error: ") or "not a projector for this model?"
            raise DFlashError(f"llama.cpp could not load the projector {path} ({reason}).")
        weakref.finalize(self, mtmd.mtmd_free, ctx)
        self.ctx, self.path = ctx, Path(path)
        self.width = llama_cpp.llama_model_n_embd_inp(model)  # an image row's width: the text model's input
        if not mtmd.mtmd_support_vision(ctx):
            raise DFlashError(f"{path} is a projector without a vision encoder, so it takes no images.")
        self.marker = mtmd.mtmd_default_marker().decode()

    def bitmap_of_file(self, path: Path) -> ctypes.c_void_p:
        """An image file decoded (read_image's checks, then llama.cpp's stb_image) into an mtmd bitmap."""
        return self.bitmap_of_bytes(read_image(path), str(path))

    def bitmap_of_bytes(self, data: bytes, name: str) -> ctypes.c_void_p:
        """An image's bytes decoded (check_image's checks, then llama.cpp's stb_image) into an mtmd bitmap."""
        check_image(data, name)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = self.mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buffer, len(data), False)
        if bitmap and self.mtmd.mtmd_bitmap_is_audio(bitmap):
            self.mtmd.mtmd_bitmap_free(bitmap)
            bitmap = None
        if not bitmap:
            raise DFlashError(f"{name} could not be decoded as an image (truncated or damaged?).")
        return bitmap

    def bitmaps(self, images: list[bytes], names: list[str]) -> list:
        """Each image decoded into an mtmd bitmap (all freed if one fails)."""
        bitmaps: list = []
        try:
            for data, name in zip(images, names, strict=True):
                bitmaps.append(self.bitmap_of_bytes(data, name))
        except DFlashError:
            for bitmap in bitmaps:
                self.mtmd.mtmd_bitmap_free(bitmap)
            raise
        return bitmaps

    def bitmap_of_pixels(self, pixels: np.ndarray) -> ctypes.c_void_p:
        """An mtmd bitmap of an RGB uint8 array [height, width, 3]."""
        height, width, _ = pixels.shape
        data = np.ascontiguousarray(pixels, dtype=np.uint8)
        return self.mtmd.mtmd_bitmap_init(width, height, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))

    def chunks(self, prompt: str, bitmaps: list, add_special: bool = True) -> list[Chunk]:
        """The prompt (text with one media marker per bitmap) as text and image chunks, each image encoded on first
        use (Chunk.embeddings); the bitmaps are freed."""
        mtmd = self.mtmd
        try:
            markers = prompt.count(self.marker)
            if markers != len(bitmaps):
                raise DFlashError(f"The prompt holds {markers} image markers ({self.marker}), not {len(bitmaps)}.")
            for bitmap in bitmaps:  # its key: what the image's chunk reports as its id
                mtmd.mtmd_bitmap_set_id(bitmap, self._key(bitmap).hex().encode())
            text = prompt.encode()
            given = mtmd.mtmd_input_text(text, len(text), add_special, True)
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            output = mtmd.mtmd_input_chunks_init()
            try:
                status = mtmd.mtmd_tokenize(self.ctx, output, ctypes.byref(given), array, len(bitmaps))
                if status != 0:
                    raise DFlashError(f"llama.cpp could not split the prompt at its images (status {status}).")
                count = mtmd.mtmd_input_chunks_size(output)
                return [self._chunk(mtmd.mtmd_input_chunks_get(output, i)) for i in range(count)]
            finally:
                mtmd.mtmd_input_chunks_free(output)
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _chunk(self, chunk) -> Chunk:
        mtmd = self.mtmd
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t()
            tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            return Chunk(ids=[tokens[i] for i in range(count.value)])
        if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            raise DFlashError("The projector made a chunk that is not an image (audio?), which dflash does not take.")
        if mtmd.mtmd_decode_use_mrope(self.ctx):
            raise DFlashError(f"{self.path} places image rows by 2D positions (M-RoPE), which dflash does not do yet.")
        kept = mtmd.mtmd_input_chunk_copy(chunk)  # the chunks' list is freed; the copy lives with the Chunk
        rows, key = (
            mtmd.mtmd_input_chunk_get_n_tokens(chunk),
            bytes.fromhex(mtmd.mtmd_input_chunk_get_id(chunk).decode()),
        )
        non_causal = bool(mtmd.mtmd_decode_use_non_causal(self.ctx, chunk))
        image = Chunk(non_causal=non_causal, key=key, rows=rows, encode=partial(self._encode, kept, rows))
        weakref.finalize(image, mtmd.mtmd_input_chunk_free, kept)
        return image

    def _key(self, bitmap) -> bytes:
        """An image's identity for the caches: the digest of its pixels, size and this projector's file."""
        mtmd = self.mtmd
        size = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
        pixels = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), size)
        shape = struct.pack("<II", mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap))
        return hashlib.sha256(pixels + shape + str(self.path.resolve()).encode()).digest()

    def _encode(self, chunk, rows: int) -> np.ndarray:
        """An image chunk's embedding rows, encoded by the projector."""
        mtmd = self.mtmd
        status = mtmd.mtmd_encode_chunk(self.ctx, chunk)
        if status != 0:
            from .llama_lib import first_llama_error

            raise DFlashError(f"llama.cpp could not encode an image (status {status}: {first_llama_error()}).")
        out = mtmd.mtmd_get_output_embd(self.ctx)
        return np.ctypeslib.as_array(out, shape=(rows * self.width,)).reshape(rows, self.width).copy()


def prefill(
    target: LlamaCppTarget, drafter: Drafter | None, chunks: list[Chunk], session: Session
) -> tuple[list[int], int]:
    """Feed an image prompt's chunks but its last (text, for the decode loop) past the caches' common prefix (whole
    images), with the drafter's features, and record them; return the prompt's ids and the positions kept."""
    if not chunks or chunks[-1].ids is None or not chunks[-1].ids:
        raise DFlashError("An image prompt must end with text after its last image.")
    if not hasattr(target, "forward_embeddings"):
        raise DFlashError("Images need a GGUF target (the llamacpp backend).")
    if drafter is not None and drafter.source == "mtp":  # its layer reads each position's token id: none at an image
        raise DFlashError("An MTP drafter takes no images yet: pass a DFlash drafter, or --no-draft.")
    layers = tuple(drafter.target_layer_ids) if drafter is not None else None
    if drafter is not None:
        drafter.check_target(target)
        target.set_feature_layers(list(layers))
    ids = [i for chunk in chunks for i in chunk.row_ids()]
    if len(ids) >= target.max_context:  # as the decode loop says it, before any row goes in
        raise DFlashError(f"The prompt ({len(ids)} tokens) does not fit the {target.max_context}-token context.")
    kept = reused = session.resume(target, drafter, ids, layers)  # owned by this session, trimmed to the prefix
    cut = _image_start(chunks, kept)
    if cut < kept:  # an image's rows are fed whole (they attend to each other); from nothing below the trim floor
        kept = reused = _trim(target, drafter, session, ids, cut if cut >= target.trim_floor else 0)
    begin = 0
    for chunk in chunks[:-1]:
        end = begin + len(chunk)
        if kept < end:
            if chunk.ids is not None:
                ids_in = torch.tensor(chunk.ids[kept - begin :], dtype=torch.long, device=target.device)
                out = target.forward(ids_in, all_logits=False, features=layers is not None)
            else:
                out = target.forward_embeddings(chunk.embeddings, chunk.non_causal, features=layers is not None)
            if drafter is not None:
                drafter.extend(out.features)
            kept = end
        begin = end
    session.record(ids, kept)
    return ids, reused


def _image_start(chunks: list[Chunk], position: int) -> int:
    """Where the image holding `position` past its first row starts (position itself where no image does)."""
    begin = 0
    for chunk in chunks:
        end = begin + len(chunk)
        if chunk.ids is None and begin < position < end:
            return begin
        begin = end
    return position


def _trim(target: LlamaCppTarget, drafter: Drafter | None, session: Session, ids: list[int], length: int) -> int:
    """Cut the caches back to length positions (an image's start) and record that; return length."""
    for model in (target,) if drafter is None else (target, drafter):
        model.trim(length)
    session.record(ids, length)
    return length


def image_prompt(
    models: LoadedModels, mmproj: Path, images: list[Path], prompt: str, settings: Settings, threads: int | None
) -> list[int]:
    """Prefill a text prompt with images (at its media markers, else before it) into the models' target through the
    projector mmproj; return the prompt's ids for the decode loop (`prefill`), which must get the same settings."""
    projector = load_projector(models, mmproj, threads)
    bitmaps = projector.bitmaps([read_image(path) for path in images], [str(path) for path in images])
    text = prompt if projector.marker in prompt else projector.marker * len(images) + prompt
    return prefill_for(models, projector.chunks(text, bitmaps), settings)[0]


def load_projector(models: LoadedModels, mmproj: Path, threads: int | None) -> Projector:
    """The projector mmproj for the models' target (a GGUF target: llama.cpp's model)."""
    if not hasattr(models.target, "context"):
        raise DFlashError("Images need a GGUF target (the llamacpp backend).")
    return Projector(mmproj, models.target.context.model, threads or torch.get_num_threads())


def image_file(projector: Projector, path: Path) -> bytes:
    """An image file's bytes, read and decoded once to check it (read_image, then llama.cpp's decoder)."""
    data = read_image(path)
    projector.mtmd.mtmd_bitmap_free(projector.bitmap_of_bytes(data, str(path)))
    return data


def prefill_for(models: LoadedModels, chunks: list[Chunk], settings: Settings) -> tuple[list[int], int]:
    """`prefill` with the drafter the decode loop will use under these settings."""
    drafting = settings.draft and settings.block_size != 1  # as the decode loop decides it
    return prefill(models.target, models.drafter if drafting else None, chunks, models.session)
