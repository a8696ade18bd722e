"""The KV cache types a llama.cpp target can keep (--cache-type, llama.cpp's names); their sizes are
memory_estimate.kv_layer_bytes."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_TYPES = ("f16", "q8_0", "q4_0")  # each checked lossless against plain decoding (tests/test_cache_type.py)


@dataclass(frozen=True)
class KVCache:
    """The types of a llama.cpp target's K and V cache, each one of CACHE_TYPES (cli.values.kv_cache checks the
    options); llama.cpp turns flash attention on for a quantized V cache, which needs it."""

    k: str = "f16"
    v: str = "f16"

    @property
    def quantized(self) -> bool:
        return (self.k, self.v) != ("f16", "f16")

    def describe(self) -> str:
        """'q8_0', or 'K q8_0, V f16' where the two differ."""
        return self.k if self.k == self.v else f"K {self.k}, V {self.v}"
