"""Lets ggml-vulkan.cpp build against Vulkan headers older than 1.3.261 (Debian 12's): the instance is created without
VK_EXT_layer_settings there, which ggml uses only for the validation layer's best-practice checks.

    python tools/patch_vulkan_headers.py path/to/ggml-vulkan.cpp
"""

from __future__ import annotations

import sys
from pathlib import Path

FIRST = "    VkBool32 enable_best_practice = layer_settings;\n"
CREATE = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions"
LAST = CREATE + ", &layer_setting_info);\n"
PLAIN = CREATE + ");\n"


def patch(source: str) -> str:
    """The source with the layer-settings block under `#if VK_HEADER_VERSION >= 261` and a plain instance otherwise."""
    start, end = source.find(FIRST), source.find(LAST)
    if start < 0 or end < start:
        raise SystemExit("patch_vulkan_headers.py: the instance-creation block changed; update this patch")
    end += len(LAST)
    guarded = f"#if VK_HEADER_VERSION >= 261\n{source[start:end]}#else\n{PLAIN}#endif\n"
    return source[:start] + guarded + source[end:]


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(patch(path.read_text()))
