"""The machine's Vulkan devices as the Vulkan loader lists them (no llama.cpp involved), and the one rule for which of
them llama.cpp may use: hardware GPUs always; software ones (Mesa's lavapipe, a CPU-type device that llama.cpp
skips) only when the user names Vulkan explicitly. Must run before llama.cpp's library is loaded."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

VISIBLE = "GGML_VK_VISIBLE_DEVICES"  # ggml-vulkan's list of device indices to use, read once at its first use
HARDWARE = (1, 2)  # VkPhysicalDeviceType: integrated and discrete GPUs, the ones ggml-vulkan takes by default
KINDS = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU (software)"}


@dataclass(frozen=True)
class VulkanDevice:
    """One physical device: its index in the loader's list, name and kind."""

    index: int
    name: str
    kind: str

    @property
    def hardware(self) -> bool:
        return self.kind in (KINDS[1], KINDS[2])


class _InstanceInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_uint32),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.c_void_p),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


class _Properties(ctypes.Structure):
    _fields_ = [
        ("apiVersion", ctypes.c_uint32),
        ("driverVersion", ctypes.c_uint32),
        ("vendorID", ctypes.c_uint32),
        ("deviceID", ctypes.c_uint32),
        ("deviceType", ctypes.c_int32),
        ("deviceName", ctypes.c_char * 256),
        ("rest", ctypes.c_ubyte * 2048),  # pipeline cache UUID, limits, sparse properties: not read
    ]


def _loader() -> ctypes.CDLL | None:
    names = ["libvulkan.so.1", ctypes.util.find_library("vulkan"), "vulkan-1.dll", "libvulkan.1.dylib"]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def vulkan_devices() -> list[VulkanDevice]:
    """The Vulkan loader's physical devices in its order (llama.cpp's indices); [] without a loader or a driver."""
    vk = _loader()
    if vk is None:
        return []
    instance = ctypes.c_void_p()
    info = _InstanceInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return []
    try:
        count = ctypes.c_uint32()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        if count.value and vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles) not in (0, 5):
            return []
        devices = []
        for index, handle in enumerate(handles[: count.value]):
            props = _Properties()
            vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), ctypes.byref(props))
            name = props.deviceName.decode(errors="replace")
            devices.append(VulkanDevice(index, name, KINDS.get(props.deviceType, KINDS[0])))
        return devices
    finally:
        vk.vkDestroyInstance(instance, None)


def expose_for(device: str) -> None:
    """--device vulkan (or VulkanN) names a software Vulkan device too, if that is all there is: llama.cpp must be
    told before it loads, so as soon as the option is read."""
    if device.lower().startswith("vulkan"):
        expose_software_devices()


def expose_software_devices() -> None:
    """Let llama.cpp use software Vulkan devices too (an explicit --device vulkan, `dflash doctor`) where the machine
    has no hardware one, unless the user already chose with GGML_VK_VISIBLE_DEVICES or llama.cpp is loaded."""
    if VISIBLE in os.environ or "llama_cpp" in sys.modules:
        return
    devices = vulkan_devices()
    if devices and not any(device.hardware for device in devices):
        os.environ[VISIBLE] = ",".join(str(device.index) for device in devices)


if __name__ == "__main__":  # install.sh: exit 0 where a hardware Vulkan device is present
    found = [device for device in vulkan_devices() if device.hardware]
    for device in found:
        print(f"{device.name} ({device.kind})")
    sys.exit(0 if found else 1)
