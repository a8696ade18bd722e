"""Option values checked and turned into what the engine wants, before anything loads; each mistake one sentence."""

from __future__ import annotations

from ..defaults import MIN_BLOCK
from ..errors import DFlashError
from ..kv_cache import CACHE_TYPES, KVCache


def block_size(option: str) -> int | None:
    """--block-size as the engine wants it: None for auto, else a fixed size of at least MIN_BLOCK."""
    if option == "auto":
        return None
    try:
        size = int(option)
    except ValueError:
        raise DFlashError(f"--block-size must be auto or a whole number, got '{option}'.") from None
    if size < MIN_BLOCK:
        raise DFlashError(f"--block-size must be at least {MIN_BLOCK} (up to the drafter's trained size), got {size}.")
    return size


def check_numbers(
    max_new_tokens: int, max_context: int | None = None, seed: int | None = None, cache_ram: int = 0
) -> None:
    """The numeric options of generate/chat/bench/serve, checked before anything loads."""
    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    if max_context is not None and max_context < 1:
        raise DFlashError(f"--max-context must be at least 1 token, got {max_context}.")
    if seed is not None and not 0 <= seed < 2**64:
        raise DFlashError(f"--seed must be a whole number from 0 to {2**64 - 1}, got {seed}.")
    if cache_ram < 0:
        raise DFlashError(f"--cache-ram must be 0 (off) or more MiB, got {cache_ram}.")


def prompt_text(prompt: str) -> str:
    """--prompt as given, unless the shell passed bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(exc.object[exc.start])
        what = f"the byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"the code point U+{char:04X}"
        raise DFlashError(
            f"--prompt is not valid UTF-8 text ({what} at position {exc.start}): "
            "pass UTF-8, or token ids with --prompt-ids."
        ) from None
    return prompt


def quantize(option: str, default: str | None) -> str | None:
    """--quantize as the loader wants it: None, 'int4' or 'nf4'."""
    if option not in ("auto", "none", "int4", "nf4"):
        raise DFlashError(f"--quantize must be auto, none, int4 or nf4, got '{option}'.")
    return default if option == "auto" else (None if option == "none" else option)


def drafter_quantize(option: str) -> str | None:
    """--drafter-quantize as the loader wants it: None, 'int8' or 'nf4'."""
    if option not in ("none", "int8", "nf4"):
        raise DFlashError(f"--drafter-quantize must be none, int8 or nf4, got '{option}'.")
    return None if option == "none" else option


def kv_cache(both: str, k: str | None, v: str | None) -> KVCache:
    """--cache-type (K and V) and --cache-type-k/-v (each, where given) as the loader wants them; checked."""
    given = {"--cache-type": both, "--cache-type-k": k, "--cache-type-v": v}
    for flag, kind in given.items():
        if kind is not None and kind not in CACHE_TYPES:
            raise DFlashError(f"{flag} must be {', '.join(CACHE_TYPES[:-1])} or {CACHE_TYPES[-1]}, got '{kind}'.")
    return KVCache(k or both, v or both)


def gpu_layers(option: str) -> str:
    """--gpu-layers checked: auto, all, or a whole number of layers (0 keeps the model's layers on the CPU)."""
    if option in ("auto", "all") or option.isdigit():
        return option
    raise DFlashError(f"--gpu-layers must be auto, all or a whole number of layers, got '{option}'.")


def parse_ids(text: str, option: str) -> list[int]:
    """Comma-separated integers; blank text is no ids, an empty or non-integer element is an error."""
    if not text.strip():
        return []
    ids = []
    for number, part in enumerate(text.split(","), 1):
        try:
            ids.append(int(part))
        except ValueError:
            what = f"element {number} is empty" if not part.strip() else f"'{part.strip()}' is not an integer"
            raise DFlashError(f"{option} must be comma-separated integers, got '{text}' ({what}).") from None
    return ids
