"""Memory a target + drafter pair needs, from shapes: weights as stored, the drafter, the KV caches, llama.cpp's
buffers and the process itself. Feeds the catalog's memory_gb and `dflash doctor`'s fit check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .defaults import DRAFTER_BLOCK
from .dimensions import Dimensions
from .errors import DFlashError
from .kv_cache import KVCache

WEIGHT_KINDS = ("q4_k_m", "q8_0", "f16", "bf16", "int4", "nf4")  # how a catalog target is stored: GGUF, or torch
INT4_GROUP = 128  # quant.INT4_GROUP (not imported: this module stays free of torch)
LLAMA_BATCH = 512  # n_batch = n_ubatch of LlamaCppTarget and the native drafter: the most tokens a graph holds
# Peak RSS of the process before any model: Python, torch, llama.cpp and this package imported (measured: 0.25 GB,
# benchmarks/bench_synthetic.py). On a GPU this is host memory; CUDA's own context takes about as much VRAM.
RUNTIME_BYTES = 250_000_000
# Bytes per 256 values of llama.cpp's block types (ggml-common.h), for GGUF sizes of files not yet downloaded and KV
# caches.
BLOCK_BYTES = {"q4_0": 144, "q4_k": 144, "q6_k": 210, "q8_0": 272, "f16": 512, "bf16": 512, "f32": 1024}


def llama_context(context: int) -> int:
    """The cells llama.cpp gives a context of `context` tokens: rounded up to 256."""
    return -(-context // 256) * 256


def kv_layer_bytes(sizes: Dimensions, context: int, cache: KVCache = KVCache()) -> int:
    """One layer's K and V in llama.cpp's cache of a `context`-token context, in the cache's types."""
    values = sizes.kv_heads * sizes.head_dim * llama_context(context)
    return values * (BLOCK_BYTES[cache.k] + BLOCK_BYTES[cache.v]) // 256


def activation_bytes(sizes: Dimensions) -> int:
    """The resident part of llama.cpp's compute buffer: a full batch of fp32 activations (see estimate)."""
    return 4 * LLAMA_BATCH * (3 * sizes.intermediate + 5 * sizes.hidden)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_bytes(sizes: Dimensions, kind: str) -> int:
    """Size of the GGUF file `dflash convert --type kind` writes for a target (tensor data; metadata aside)."""
    if kind not in ("q4_k_m", "q8_0", "f16", "bf16"):
        raise DFlashError(f"No size rule for GGUF type '{kind}'.")
    plain = "q4_k" if kind == "q4_k_m" else kind
    total = 0
    for layer in range(sizes.layers):
        for name, count in sizes.layer_matrices().items():
            more = kind == "q4_k_m" and name in ("attn_v", "ffn_down") and _more_bits(layer, sizes.layers)
            total += count * BLOCK_BYTES["q6_k" if more else plain] // 256
        total += 2 * sizes.hidden * 4  # the two norms, F32
    head = "q6_k" if kind == "q4_k_m" else plain
    embedding = sizes.vocab * sizes.hidden
    total += embedding * BLOCK_BYTES[head if sizes.tied else plain] // 256
    if not sizes.tied:
        total += embedding * BLOCK_BYTES[head] // 256
    return total + sizes.hidden * 4


def safetensors_bytes(sizes: Dimensions, element: int = 2) -> int:
    """Size of a 16-bit (element=2) HF target's weights."""
    matrices = sizes.layers * sum(sizes.layer_matrices().values())
    embedding = sizes.vocab * sizes.hidden * (1 if sizes.tied else 2)
    return (matrices + embedding) * element


def int4_linear_bytes(sizes: Dimensions, scale_element: int = 2) -> int:
    """The decoder layers' linears as `--quantize int4` holds them (quant.install_int4): a matrix whose input width is
    a multiple of INT4_GROUP as two nibbles per uint8 code byte (64 bytes per group of 128 weights) plus a scale and a
    min per group in scale_element bytes each (fp16: 2; fp32 compute keeps fp32, 4), i.e. 68 bytes per 128 weights in
    16-bit compute; any other matrix stays 16-bit."""
    q = sizes.heads * sizes.head_dim
    inputs = {"attn_output": q, "ffn_down": sizes.intermediate}  # every other matrix reads the hidden state
    total = 0
    for name, count in sizes.layer_matrices().items():
        if inputs.get(name, sizes.hidden) % INT4_GROUP:
            total += count * 2
        else:
            total += count // 2 + count // INT4_GROUP * 2 * scale_element
    return sizes.layers * total


def drafter_bytes(target: Dimensions, drafter_layers: int, target_layers: int, element: int = 2) -> int:
    """A published-layout DFlash drafter's weights: its layers plus fc over the concatenated target features."""
    layer = sum(target.layer_matrices().values())
    return (drafter_layers * layer + target.hidden * target.hidden * target_layers) * element


@dataclass(frozen=True)
class Estimate:
    """Bytes by part; total and a one-line account of them."""

    parts: dict[str, int]

    @property
    def total_gb(self) -> float:
        return sum(self.parts.values()) / 1e9

    def summary(self) -> str:
        return " + ".join(f"{b / 1e9:.2f} GB {name}" for name, b in self.parts.items() if b >= 5_000_000)


def estimate(
    target: Dimensions,
    target_weights: int,
    context: int,
    backend: str,
    drafter_weights: int = 0,
    drafter: Dimensions | None = None,
    block_size: int = DRAFTER_BLOCK,
    drafter_element: int = 2,
    drafter_kind: str = "native",
    cache: KVCache = KVCache(),
) -> Estimate:
    """Peak memory of one generation: target weights as stored (LlamaCppTarget reads a GGUF into llama.cpp's
    buffers once), the drafter (16-bit weights given) in drafter_element bytes per weight, KV caches at the context
    length, llama.cpp's activations, a block's logits twice in fp32, and the process. On a GGUF target the native
    drafter (llama.cpp's, F16) reads the target's embedding and head in place; the torch drafter on the CPU keeps
    one copy of the head as packed int8 rows (embedding rows are dequantized per step). The target's KV cache is in
    the `cache` types (llama.cpp's; a torch target's 16-bit cache is f16's size).

    llama.cpp reserves a compute buffer for its largest graph (a 512-token batch with every row's logits: 258.5 MiB
    at the Llama-3.2-1B shape) but the pages a generation touches are those of a full batch of activations, about
    three intermediate-size and five hidden-size fp32 rows per token: activation_bytes (measured on that shape:
    63 MB of peak RSS between 512- and 64-token batches; the formula gives 62 MB)."""
    parts = {"target weights": target_weights, "KV cache": target.layers * kv_layer_bytes(target, context, cache)}
    context = llama_context(context)
    if backend == "llamacpp":
        parts["llama.cpp activations"] = activation_bytes(target)
    parts["logits"] = 2 * block_size * target.vocab * 4
    if drafter is not None:
        native = drafter_kind == "native"
        parts["drafter weights"] = drafter_weights * drafter_element // 2
        if native:
            parts["drafter activations"] = activation_bytes(drafter)
        elif backend == "llamacpp":  # packed int8 rows, fp32 scales and offsets (the CPU); a torch target lends its own
            parts["output head for the drafter"] = target.vocab * (target.hidden + 8)
        parts["drafter KV cache"] = drafter.kv_bytes(context, 2 if native else drafter_element)
    parts["runtime"] = RUNTIME_BYTES
    return Estimate(parts)


def _weight_files_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _config(folder: Path) -> dict:
    from .weights import check_attention_shape, read_config

    config = read_config(folder)
    check_attention_shape(config, folder / "config.json")
    return config


def target_sizes(path: Path) -> Dimensions:
    """A local target's dimensions: GGUF metadata, or config.json."""
    if path.suffix == ".gguf":
        return _gguf_sizes(path)
    return Dimensions.from_config(_config(path))


def _gguf_sizes(path: Path) -> Dimensions:
    """The dimensions in a GGUF file's metadata (gguf.file.gguf_dimensions), every width stated once for all layers."""
    from .gguf.file import gguf_dimensions, read_header

    try:
        header = read_header(path)
    except (ValueError, KeyError, OSError) as exc:
        raise DFlashError(f"{path} is not a GGUF file whose shape can be read ({exc}).") from None
    dims = gguf_dimensions(path, header)
    if 0 in (dims.intermediate, dims.heads, dims.kv_heads, dims.head_dim):
        raise DFlashError(f"{path} is not a GGUF file whose shape can be read (a width varies by layer or is missing).")
    return dims


def estimate_files(
    target: Path,
    drafter: Path | None,
    context: int,
    drafter_element: int = 2,
    drafter_kind: str = "native",
    cache: KVCache = KVCache(),
) -> Estimate:
    """The estimate for model files on disk: weights as their files store them, the drafter (kind native or torch)
    in drafter_element bytes per weight (2: the native drafter, or torch in bf16/fp16; 4: torch in fp32), the target's
    KV cache in the `cache` types."""
    sizes = target_sizes(target)
    gguf_file = target.suffix == ".gguf"
    backend = "llamacpp" if gguf_file else "torch"
    if drafter is None:
        return estimate(sizes, _weight_files_bytes(target), context, backend, cache=cache)
    config = _config(drafter)
    drafter_sizes = Dimensions.from_config(config | {"vocab_size": sizes.vocab})
    block = int(config.get("block_size", DRAFTER_BLOCK))
    draft = _weight_files_bytes(drafter)
    stored = _weight_files_bytes(target)
    return estimate(sizes, stored, context, backend, draft, drafter_sizes, block, drafter_element, drafter_kind, cache)


def estimate_shape(name: str, weights: str, context: int) -> Estimate:
    """The estimate for a known shape (shapes.SHAPES) whose target is stored as weights: a GGUF type (llama.cpp)
    or bf16 safetensors for the torch target as stored, quantized on load (int4: quant.install_int4, nf4:
    bitsandbytes), or pre-quantized nf4; the drafter is its published bf16 one."""
    from .shapes import SHAPES, drafter_config

    shape = SHAPES[name]
    sizes = shape.dims
    drafter = Dimensions.from_config(drafter_config(shape))
    if weights in ("bf16", "int4", "nf4"):
        stored = safetensors_bytes(sizes)
        linears = sizes.layers * sum(sizes.layer_matrices().values())
        if weights == "int4":  # the layers' linears as int4 groups; embeddings and head stay bf16
            stored -= linears * 2 - int4_linear_bytes(sizes)
        if weights == "nf4":  # linears in 4 bits + an fp32 scale per 64 weights; embeddings and head stay bf16
            stored -= linears * 2 - linears * 17 // 32
        backend = "torch"
    else:
        stored, backend = gguf_bytes(sizes, weights), "llamacpp"
    draft = drafter_bytes(sizes, shape.drafter_layers, len(shape.target_layer_ids))
    return estimate(sizes, stored, context, backend, draft, drafter, shape.block_size)
