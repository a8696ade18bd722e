"""The devices llama.cpp's loaded library offers (its backend device list, with free memory), and --device resolved
against them: the one rule for which device a GGUF runs on."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from .errors import DFlashError

BACKENDS = {"cuda": "CUDA", "vulkan": "Vulkan", "metal": "Metal"}  # --device word -> llama.cpp's backend name
KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # ggml_backend_dev_type, in its order
SOFTWARE = ("llvmpipe", "lavapipe", "swiftshader")  # software renderers that describe themselves by name
INSTALL_HINT = {"CUDA": "--gpu cuda", "Vulkan": "--gpu vulkan", "Metal": "(pip install on macOS builds Metal)"}


@dataclass(frozen=True)
class Device:
    """One device of llama.cpp's list: its name (CPU, CUDA0, Vulkan0, MTL0), backend, description, kind and memory."""

    name: str
    backend: str
    description: str
    kind: str
    free: int
    total: int

    @property
    def software(self) -> bool:
        """A device that computes on the CPU cores behind a GPU API (Mesa's lavapipe): never picked by auto."""
        return any(word in self.description.lower() for word in SOFTWARE)

    @property
    def gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml beside the loaded libllama (its registry and device functions), with the signatures read here."""
    from .llama_lib import loaded_library, quiet_llama_logs

    quiet_llama_logs()  # before ggml lists its devices (each backend logs what it finds)
    lib = ctypes.CDLL(str(loaded_library().parent / "libggml.so"))
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    signatures = {
        "ggml_backend_dev_count": ([], size),
        "ggml_backend_dev_get": ([size], pointer),
        "ggml_backend_dev_name": ([pointer], ctypes.c_char_p),
        "ggml_backend_dev_description": ([pointer], ctypes.c_char_p),
        "ggml_backend_dev_type": ([pointer], ctypes.c_int),
        "ggml_backend_dev_memory": ([pointer, ctypes.POINTER(size), ctypes.POINTER(size)], None),
        "ggml_backend_dev_backend_reg": ([pointer], pointer),
        "ggml_backend_dev_buffer_type": ([pointer], pointer),
        "ggml_backend_reg_name": ([pointer], ctypes.c_char_p),
        "ggml_backend_reg_count": ([], size),
        "ggml_backend_reg_get": ([size], pointer),
    }
    for name, (argtypes, restype) in signatures.items():
        func = getattr(lib, name)
        func.argtypes, func.restype = argtypes, restype
    return lib


def library_backends() -> list[str]:
    """The backends the loaded libllama was built with (CPU, and CUDA, Vulkan or Metal where built in)."""
    lib = _ggml()
    regs = (lib.ggml_backend_reg_get(index) for index in range(lib.ggml_backend_reg_count()))
    return [lib.ggml_backend_reg_name(reg).decode() for reg in regs]


def library_devices() -> list[Device]:
    """Every device of llama.cpp's list, in its order, with its memory now."""
    lib = _ggml()
    devices = []
    for index in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(index)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        devices.append(
            Device(
                name=lib.ggml_backend_dev_name(dev).decode(),
                backend=lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)).decode(),
                description=lib.ggml_backend_dev_description(dev).decode(errors="replace"),
                kind=KINDS[kind] if kind < len(KINDS) else "other",
                free=free.value,
                total=total.value,
            )
        )
    return devices


def device_handle(name: str) -> int:
    """llama.cpp's handle (ggml_backend_dev_t) of the device called name."""
    lib = _ggml()
    for index in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(index)
        if lib.ggml_backend_dev_name(dev).decode() == name:
            return dev
    raise DFlashError(f"llama.cpp has no device called {name}.")


def cpu_buffer_type() -> int:
    """The CPU device's buffer type (where --cpu-moe keeps expert tensors)."""
    return _ggml().ggml_backend_dev_buffer_type(device_handle("CPU"))


def resolve_device(request: str) -> Device | None:
    """The device --device names (None: the CPU). auto: the first hardware GPU llama.cpp offers, else the CPU;
    cuda / vulkan / metal: that backend's first device (a software one too); else a device name such as Vulkan0."""
    word = request.lower()
    if word == "cpu":
        return None
    devices = library_devices()
    if word == "auto":
        return next((d for d in devices if d.gpu and not d.software), None)
    if word in BACKENDS:
        backend = BACKENDS[word]
        if backend not in library_backends():
            built = ", ".join(library_backends())
            raise DFlashError(
                f"--device {request}: this libllama is built for {built} only; ./install.sh {INSTALL_HINT[backend]} "
                f"builds one with {backend}."
            )
        found = next((d for d in devices if d.backend == backend), None)
        if found is None:
            raise DFlashError(f"--device {request}: llama.cpp's {backend} backend finds no device on this machine.")
        return found
    found = next((d for d in devices if d.name.lower() == word), None)
    if found is None:
        names = ", ".join(["auto", "cpu", *BACKENDS, *(d.name for d in devices if d.kind != "cpu")])
        raise DFlashError(f"Unknown device '{request}' (use {names}).")
    return found
