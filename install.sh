#!/usr/bin/env bash
# One-command setup: ./install.sh [--dev]
# Creates .venv, installs the right torch (CUDA build where nvidia-smi works, else the CPU
# build torch==2.13.0), then dflash-local itself with GGUF support (llama-cpp-python, built with
# CUDA where nvidia-smi works; the build takes several minutes; on CPU machines a second libllama build without
# llamafile, for lossless F16 verification). Every install goes through the lock,
# constraints.txt, so users get the versions CI tested. --dev adds the test tools to .venv and creates
# .venv-oracle: the reference implementation (PyPI dflash + transformers) the tests call as an oracle.
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
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: Python 3.11 or newer is needed (found: $("$python" --version 2>&1))." >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)

# PyPI's Linux torch wheel is the CUDA build; where a local CPU wheel is configured for pip
# (as on our CI machines) the same pin takes it. TORCH_SPEC overrides, e.g. a CPU-only index.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  gpu=1
  echo "==> NVIDIA GPU found: installing torch with CUDA"
else
  gpu=0
  echo "==> no NVIDIA GPU: installing torch for the CPU"
fi
torch_spec=${TORCH_SPEC:-torch==2.13.0}
# shellcheck disable=SC2086
"${pip[@]}" $torch_spec

# A .venv made by an older --dev held the reference package, whose console script was also called dflash.
if .venv/bin/python -m pip show --quiet dflash >/dev/null 2>&1; then
  echo "==> removing the reference dflash package and transformers from .venv (they live in .venv-oracle now)"
  .venv/bin/python -m pip uninstall --quiet --yes dflash transformers
fi

# llama-cpp-python (GGUF targets) builds libllama from source: with CUDA where nvidia-smi works.
if [ "$gpu" = 1 ]; then
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
# On the CPU, DFlash is bitwise lossless on F16/BF16/F32 GGUFs only with a libllama built without llamafile's
# tinyBLAS: build it once per llama-cpp-python version into .venv/lib/dflash-libllama (a few minutes).
if [ "$gpu" = 0 ] && [ "$(uname -s)" = Linux ]; then
  scripts/build_libllama.sh .venv
fi
if [ "$dev" = 0 ] && [ "$gpu" = 1 ]; then
  echo "==> adding the GPU path: Triton kernels, bitsandbytes NF4 targets"
  "${pip[@]}" -e ".[gpu]"
fi

if [ "$dev" = 1 ]; then
  echo "==> creating .venv-oracle: the reference implementation the tests compare against"
  [ -x .venv-oracle/bin/python ] || "$python" -m venv .venv-oracle
  oracle=(.venv-oracle/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-oracle.txt)
  # shellcheck disable=SC2086
  "${oracle[@]}" $torch_spec
  "${oracle[@]}" "dflash[local]==0.1.0"
fi
echo "==> done: run .venv/bin/dflash --help"
