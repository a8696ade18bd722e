#!/usr/bin/env bash
# What a GPU libllama build needs beyond a C++ compiler, installed from the distribution's packages where this runs as
# root with apt-get; otherwise what is missing is printed (one phrase on stdout) and the exit status is 1.
#   tools/gpu_build_deps.sh vulkan|cuda [DEV]     # DEV=1: also Mesa's software Vulkan device where none is present
set -uo pipefail
cd "$(dirname "$0")/.."
backend=$1
dev=${2:-0}
apt_install() {  # apt_install PACKAGE...: as root with apt-get, quietly; fails otherwise
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >/dev/null 2>&1
}
case "$backend" in
  vulkan)
    packages=(glslc libvulkan-dev spirv-headers)
    have() { command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.h ] &&
      [ -d /usr/include/spirv ] && ldconfig -p | grep -q 'libvulkan\.so '; }
    if ! have && ! { apt_install "${packages[@]}" && have; }; then
      echo "it needs glslc, the Vulkan headers and SPIRV-Headers: sudo apt-get install ${packages[*]}"
      exit 1
    fi
    if [ "$dev" = 1 ] && ! .venv/bin/python -c 'from dflash_local.vulkan_probe import vulkan_devices as v; assert v()' \
      2>/dev/null; then
      apt_install mesa-vulkan-drivers || { echo "the tests need a Vulkan device: sudo apt-get install mesa-vulkan-drivers"; exit 1; }
    fi
    ;;
  cuda)
    if ! nvidia-smi >/dev/null 2>&1; then
      echo "it needs an NVIDIA GPU that nvidia-smi sees (the build targets that GPU's architecture)"
      exit 1
    fi
    if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
      # no system toolkit: NVIDIA's wheels from the package registry (tools/build_libllama.sh finds them there)
      toolkit=$(tools/cuda_toolkit.sh .venv) || { echo "$toolkit"; exit 1; }
    fi
    ;;
  *) echo "no GPU backend called $backend"; exit 1 ;;
esac
