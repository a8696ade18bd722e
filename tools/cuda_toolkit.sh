#!/usr/bin/env bash
# NVIDIA's CUDA toolkit from the package registry, for a CUDA libllama build on a machine without nvcc: the
# cuda-toolkit wheels (nvcc, the runtime, cuBLAS, CCCL) into VENV/lib/dflash-cuda-toolkit, whose nvidia/cu13 folder is
# laid out as a toolkit root (bin/nvcc, include, lib); added are the unversioned library names CMake links by and the
# driver's libcuda where a toolkit keeps its stub. The wheels are CUDA 13, which needs a driver for CUDA 13 or newer.
#   tools/cuda_toolkit.sh [VENV]    # prints the toolkit root; what is missing, one phrase on stdout, and exit 1 if not
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
dest="$venv/lib/dflash-cuda-toolkit"
root="$dest/nvidia/cu13"
wheels="cuda-toolkit[nvcc,cudart,cublas,cccl,crt,nvvm]==13.4.3"
driver_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9]*' | grep -o '[0-9]*$')
if [ "${driver_cuda:-0}" -lt 13 ]; then
  echo "it needs nvcc, and the CUDA toolkit wheels (CUDA 13) need a newer NVIDIA driver than this one (CUDA ${driver_cuda:-unknown}): install a CUDA toolkit for this driver (NVIDIA's installer or your distribution's nvidia-cuda-toolkit), or a newer driver, and run ./install.sh --gpu cuda"
  exit 1
fi
if [ ! -x "$root/bin/nvcc" ]; then
  echo "==> installing NVIDIA's CUDA toolkit wheels ($wheels, about 1 GB) into $dest" >&2
  rm -rf "$dest.partial"
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt --target "$dest.partial" \
    "$wheels" >&2 || [ ! -x "$dest.partial/nvidia/cu13/bin/nvcc" ]; then
    rm -rf "$dest.partial"
    echo "it needs nvcc, and NVIDIA's CUDA toolkit wheels ($wheels) did not install: install the CUDA toolkit and run ./install.sh --gpu cuda"
    exit 1
  fi
  rm -rf "$dest"
  mv "$dest.partial" "$dest"
fi
for name in cudart cublas cublasLt; do
  ln -sf "lib$name.so.13" "$root/lib/lib$name.so"
done
driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
if [ -n "$driver" ]; then
  mkdir -p "$root/lib/stubs"
  ln -sf "$driver" "$root/lib/stubs/libcuda.so"
fi
echo "$root"
