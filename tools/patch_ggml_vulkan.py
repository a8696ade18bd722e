"""Patches the vendored ggml-vulkan before dflash builds it (tools/build_libllama.sh --backend vulkan).

- Headers: with Vulkan headers older than 1.3.261 (Debian 12's) the instance is created without VK_EXT_layer_settings,
  which ggml uses only for the validation layer's best-practice checks.
- Descriptors: a dispatch writes every binding of the shared 12-binding descriptor set, unused ones with its first
  buffer. ggml writes only the pipeline's own bindings, so the rest keep buffers that a later graph reserve destroys;
  drivers that read every binding (Mesa's lavapipe) then use freed memory and crash (docs/gpu.md).

    python tools/patch_ggml_vulkan.py path/to/ggml/src/ggml-vulkan
"""

from __future__ import annotations

import sys
from pathlib import Path

FIRST = "    VkBool32 enable_best_practice = layer_settings;\n"
CREATE = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions"
LAST = CREATE + ", &layer_setting_info);\n"
PLAIN = CREATE + ");\n"

WRITE = (
    "        vk::WriteDescriptorSet write_descriptor_set{ descriptor_set, 0, 0, pipeline->parameter_count, "
    "vk::DescriptorType::eStorageBuffer, nullptr, descriptor_buffer_infos.begin() };\n"
)
PADDED_WRITE = (
    "        std::array<vk::DescriptorBufferInfo, MAX_PARAMETER_COUNT> padded_infos;\n"
    "        padded_infos.fill(*descriptor_buffer_infos.begin());\n"
    "        std::copy(descriptor_buffer_infos.begin(), descriptor_buffer_infos.end(), padded_infos.begin());\n"
    "        vk::WriteDescriptorSet write_descriptor_set{ descriptor_set, 0, 0, MAX_PARAMETER_COUNT, "
    "vk::DescriptorType::eStorageBuffer, nullptr, padded_infos.data() };\n"
)


def guard_layer_settings(source: str) -> str:
    """ggml-vulkan.cpp with the layer-settings block under `#if VK_HEADER_VERSION >= 261` and a plain instance else."""
    start, end = source.find(FIRST), source.find(LAST)
    if start < 0 or end < start:
        raise SystemExit("patch_ggml_vulkan.py: the instance-creation block changed; update this patch")
    end += len(LAST)
    guarded = f"#if VK_HEADER_VERSION >= 261\n{source[start:end]}#else\n{PLAIN}#endif\n"
    return source[:start] + guarded + source[end:]


def pad_descriptor_writes(source: str) -> str:
    """ggml-vulkan-common.h with the dispatch's descriptor write covering all MAX_PARAMETER_COUNT bindings."""
    if source.count(WRITE) != 1:
        raise SystemExit("patch_ggml_vulkan.py: the dispatch's descriptor write changed; update this patch")
    return source.replace(WRITE, PADDED_WRITE)


def patch(ggml_vulkan: Path) -> None:
    """Applies both patches in place to the ggml-vulkan source folder."""
    for name, fix in (("ggml-vulkan.cpp", guard_layer_settings), ("ggml-vulkan-common.h", pad_descriptor_writes)):
        path = ggml_vulkan / name
        path.write_text(fix(path.read_text()))


if __name__ == "__main__":
    patch(Path(sys.argv[1]))
