"""Where a GGUF's layers go: --device, --gpu-layers auto|all|N and --cpu-moe planned once from the file's tensor table
and the device's free memory (a Placement), and that placement as llama.cpp's model parameters."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from .devices import Device, cpu_buffer_type, device_handle, resolve_device
from .errors import DFlashError
from .gguf.file import GGUFModel, read_gguf
from .kv_cache import KVCache
from .memory_estimate import kv_layer_bytes

EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # MoE expert tensors, which --cpu-moe keeps in host memory
COMPUTE_RESERVE = 512 * 2**20  # the device's compute buffers and the backend's own allocations, kept free
GiB = 2**30


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp runs a model: the device (None: the CPU), how many of its layers are there (layers + 1 puts
    the output head there too, as llama.cpp counts) and whether MoE experts stay in host memory."""

    device: Device | None = None
    gpu_layers: int = 0
    layers: int = 0
    cpu_moe: bool = False

    @property
    def name(self) -> str:
        return "CPU" if self.device is None else self.device.name

    def describe(self) -> str:
        """One line for the status line and load report, e.g. 'Vulkan0 (llvmpipe): 24/24 layers, experts on CPU'."""
        if self.device is None:
            return "CPU"
        layers = f"{min(self.gpu_layers, self.layers)}/{self.layers} layers"
        moe = ", MoE experts on the CPU" if self.cpu_moe else ""
        return f"{self.device.name} ({self.device.description}): {layers}{moe}"

    def as_json(self) -> dict:
        """The placement for `generate --json`'s devices field."""
        if self.device is None:
            return {"device": "CPU", "backend": "CPU", "layers_on_device": 0, "layers": self.layers}
        return {
            "device": self.device.name,
            "backend": self.device.backend,
            "description": self.device.description,
            "layers_on_device": min(self.gpu_layers, self.layers),
            "layers": self.layers,
            "output_on_device": self.gpu_layers > self.layers,
            "cpu_moe": self.cpu_moe,
        }


def _per_layer(info: GGUFModel, cpu_moe: bool, context: int, cache: KVCache) -> tuple[list[int], int]:
    """Bytes each decoder layer puts on the device (its tensors, less experts with cpu_moe, plus its KV cache at
    context tokens in the cache's types), and the output head's."""
    layers = [0] * info.dims.layers
    pattern = re.compile(EXPERTS)
    for name, tensor in info.tensors.items():
        match = re.match(r"blk\.(\d+)\.", name)
        if match and int(match.group(1)) < len(layers) and not (cpu_moe and pattern.search(name)):
            layers[int(match.group(1))] += tensor.n_bytes
    kv = kv_layer_bytes(info.dims, context, cache)
    head = info.tensors.get("output.weight", info.tensors["token_embd.weight"]).n_bytes
    return [size + kv for size in layers], head


def _fit(device: Device, layers: list[int], head: int, drafter: int) -> int:
    """The most layers (counted as llama.cpp does, from the last) whose bytes fit in the device's free memory."""
    budget = device.free - COMPUTE_RESERVE - drafter
    if budget >= sum(layers) + head:
        return len(layers) + 1
    fitted = 0
    for size in reversed(layers):
        if budget < size:
            break
        budget -= size
        fitted += 1
    return fitted


def plan_placement(
    path: Path, device: str, gpu_layers: str, cpu_moe: bool, context: int, drafter: int, cache: KVCache = KVCache()
) -> Placement:
    """The placement of the GGUF at path: the device --device names, and --gpu-layers (auto: as many as its free
    memory holds beside the KV cache in the `cache` types, the drafter's `drafter` bytes and compute buffers; all; or
    a number)."""
    info = read_gguf(path)
    total = info.dims.layers
    found = resolve_device(device)
    if found is None:
        return Placement(None, 0, total, cpu_moe)
    layers, head = _per_layer(info, cpu_moe, context, cache)
    if gpu_layers == "auto":
        return Placement(found, _fit(found, layers, head, drafter), total, cpu_moe)
    wanted = total + 1 if gpu_layers == "all" else int(gpu_layers)
    need = sum(layers[max(total - wanted, 0) :]) + (head if wanted > total else 0) + drafter + COMPUTE_RESERVE
    if need > found.free:
        smaller = "a smaller --max-context" + ("" if cache.quantized else " or --cache-type q8_0")
        raise DFlashError(
            f"{path.name} with {min(wanted, total)} layers on {found.name} needs about {need / GiB:.1f} GiB (weights, "
            f"a {context}-token {cache.describe()} KV cache, the drafter, compute buffers) and {found.name} has "
            f"{found.free / GiB:.1f} GiB free: use --gpu-layers auto (as many as fit)"
            f"{', --cpu-moe' if not cpu_moe else ''} or {smaller}."
        )
    return Placement(found, wanted, total, cpu_moe)


def file_bytes(path: Path | None) -> int:
    """Bytes of a drafter's weights on disk (a GGUF file, or a folder's GGUF and safetensors files); 0 for None."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".gguf", ".safetensors"))


class _BuftOverride(ctypes.Structure):
    """llama.cpp's llama_model_tensor_buft_override: tensors whose name matches pattern go to buffer type buft."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class ModelParams:
    """llama.cpp's model parameters for a placement, holding the C arrays they point to for as long as it lives (on
    the CPU there are none: no main GPU means no device at all, so `.params` alone may be kept)."""

    def __init__(self, placement: Placement, llama_cpp) -> None:
        params = llama_cpp.llama_model_default_params()
        params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_NONE
        self._devices = self._overrides = None
        if placement.device is None:
            params.main_gpu = -1  # llama.cpp keeps no device: the CPU alone, whatever the library offers
            params.n_gpu_layers = 0
        else:
            self._devices = (ctypes.c_void_p * 2)(device_handle(placement.device.name), None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)  # that device alone
            params.main_gpu, params.n_gpu_layers = 0, placement.gpu_layers
        if placement.cpu_moe:
            self._pattern = EXPERTS.encode()
            pair = (_BuftOverride(self._pattern, cpu_buffer_type()), _BuftOverride(None, None))
            self._overrides = (_BuftOverride * 2)(*pair)
            params.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.params = params
