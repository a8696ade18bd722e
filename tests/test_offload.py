"""--gpu-layers and --cpu-moe planned from a GGUF's tensor table and a device's free memory: the layer sizes agree with
gguf-py's own reader of the file, auto puts as many layers as fit (the output head only with all of them), an explicit
count that does not fit is one sentence with the numbers, and bad values are refused before anything loads."""

from __future__ import annotations

import re

import gguf
import pytest

from dflash_local import offload
from dflash_local.cli.values import gpu_layers
from dflash_local.devices import Device
from dflash_local.errors import DFlashError

CONTEXT = 256


def fake_device(free: int) -> Device:
    return Device("Vulkan0", "Vulkan", "a test GPU", "gpu", free, free)


def reference_sizes(path, cpu_moe: bool) -> tuple[list[int], int, int]:
    """Per-layer tensor bytes, the head's and the layer count, read with gguf-py's GGUFReader (not dflash's parser)."""
    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    sizes, head, embed = [0] * layers, 0, 0
    for tensor in reader.tensors:
        match = re.match(r"blk\.(\d+)\.", tensor.name)
        if match and not (cpu_moe and "_exps" in tensor.name):
            sizes[int(match.group(1))] += int(tensor.n_bytes)
        head = int(tensor.n_bytes) if tensor.name == "output.weight" else head
        embed = int(tensor.n_bytes) if tensor.name == "token_embd.weight" else embed
    return sizes, head or embed, layers


def kv_per_layer(path) -> int:
    info = offload.read_gguf(path)
    return 2 * info.dims.kv_heads * info.dims.head_dim * CONTEXT * 2


@pytest.fixture
def model(tiny_gguf):
    return tiny_gguf["f16"]


def plan(monkeypatch, path, free: int, layers: str = "auto", cpu_moe: bool = False):
    monkeypatch.setattr(offload, "resolve_device", lambda request: fake_device(free))
    return offload.plan_placement(path, "vulkan", layers, cpu_moe, CONTEXT, 0)


def test_auto_fits_as_many_layers_as_the_free_memory_holds(model, monkeypatch):
    sizes, head, count = reference_sizes(model, cpu_moe=False)
    per_layer = [size + kv_per_layer(model) for size in sizes]
    everything = sum(per_layer) + head + offload.COMPUTE_RESERVE
    assert plan(monkeypatch, model, everything).gpu_layers == count + 1  # the output head too
    assert plan(monkeypatch, model, everything - 1).gpu_layers == count  # all layers, not the head
    two_last = sum(per_layer[-2:]) + offload.COMPUTE_RESERVE
    assert plan(monkeypatch, model, two_last).gpu_layers == 2
    assert plan(monkeypatch, model, two_last - 1).gpu_layers == 1
    assert plan(monkeypatch, model, offload.COMPUTE_RESERVE).gpu_layers == 0


def test_an_explicit_count_that_does_not_fit_is_one_sentence_with_the_numbers(model, monkeypatch):
    sizes, head, count = reference_sizes(model, cpu_moe=False)
    with pytest.raises(DFlashError, match=r"with \d+ layers on Vulkan0 needs about [\d.]+ GiB .* has [\d.]+ GiB free"):
        plan(monkeypatch, model, offload.COMPUTE_RESERVE, "all")
    placed = plan(monkeypatch, model, 2**40, "2")
    assert (placed.gpu_layers, placed.layers) == (2, count)
    assert placed.describe() == f"Vulkan0 (a test GPU): 2/{count} layers"
    assert plan(monkeypatch, model, 2**40, "all").as_json()["output_on_device"] is True


def test_the_cpu_places_nothing_on_a_device(model, monkeypatch):
    monkeypatch.setattr(offload, "resolve_device", lambda request: None)
    placed = offload.plan_placement(model, "cpu", "all", False, CONTEXT, 0)
    assert placed.device is None and placed.describe() == "CPU" and placed.as_json()["layers_on_device"] == 0


@pytest.mark.parametrize("value", ["-1", "half", "", "2.5"])
def test_bad_gpu_layers_values_are_one_sentence(value):
    with pytest.raises(DFlashError, match="--gpu-layers must be auto, all or a whole number of layers"):
        gpu_layers(value)
