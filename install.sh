#!/usr/bin/env bash
# One-command setup: ./install.sh [--dev]
# Creates .venv, installs the right torch (CUDA build where nvidia-smi works, else the CPU
# build torch==2.13.0), then dflash-local itself with GGUF support (llama-cpp-python, built with
# CUDA where nvidia-smi works; the build takes several minutes); --dev adds the test tools and the oracle.
set -euo pipefail
cd "$(dirname "$0")"

dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    -h|--help) echo "usage: ./install.sh [--dev]"; exit 0 ;;
    *) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "install.sh: Python 3.10 or newer is needed (found: $("$python" --version 2>&1))." >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# PyPI's Linux torch wheel is the CUDA build; where a local CPU wheel is configured for pip
# (as on our CI machines) the same pin takes it. TORCH_SPEC overrides, e.g. a CPU-only index.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "==> NVIDIA GPU found: installing torch with CUDA"
else
  echo "==> no NVIDIA GPU: installing torch for the CPU"
fi
# shellcheck disable=SC2086
"${pip[@]}" ${TORCH_SPEC:-torch==2.13.0}

# llama-cpp-python (GGUF targets) builds libllama from source: with CUDA where nvidia-smi works.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=on}"
  echo "==> llama-cpp-python will be built with CUDA (CMAKE_ARGS=$CMAKE_ARGS)"
fi
if [ "$dev" = 1 ]; then
  echo "==> installing dflash-local with test dependencies"
  "${pip[@]}" -e ".[dev]"
else
  echo "==> installing dflash-local (with GGUF support: llama-cpp-python, gguf)"
  "${pip[@]}" -e ".[gguf]"
fi
if [ "$dev" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "==> adding the GPU path: Triton kernels, bitsandbytes NF4 targets"
  "${pip[@]}" -e ".[gpu]"
fi
echo "==> done: run .venv/bin/dflash --help"
