#!/usr/bin/env bash
# One-command setup on Linux: ./install.sh [--dev] [--gpu auto|cuda|vulkan|none]
# A thin layer over pip; pyproject.toml says what dflash-local needs. Creates .venv, installs torch==2.13.0 (PyPI's
# Linux wheel is the CUDA build), then dflash-local with GGUF support (llama-cpp-python, built from source for the
# CPU: several minutes), plus the gpu extra (Triton, bitsandbytes) where nvidia-smi works, then dflash's own libllama
# (tools/build_libllama.sh): the CPU build without llamafile's tinyBLAS for lossless verification, and beside it a GPU
# build where the machine has a GPU: CUDA where nvidia-smi works (with the system's nvcc, else NVIDIA's toolkit wheels),
# Vulkan where a hardware Vulkan device is present (--gpu overrides; a GPU build that fails leaves the CPU install working). Every install goes through the lock,
# constraints.txt, so users get the versions CI tested. --dev adds the test tools to .venv and creates .venv-oracle:
# the reference implementations (PyPI dflash + transformers, and speculators) the tests call as oracles, and .venv-vllm; with --gpu vulkan on a
# machine without a Vulkan device, it also installs Mesa's software one (lavapipe) for the GPU-path tests.
set -euo pipefail
cd "$(dirname "$0")"

dev=0
gpu_choice=auto
usage="usage: ./install.sh [--dev] [--gpu auto|cuda|vulkan|none]"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=1 ;;
    --gpu) gpu_choice=${2:-}; shift ;;
    --gpu=*) gpu_choice=${1#--gpu=} ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "install.sh: unknown option $1 ($usage)" >&2; exit 2 ;;
  esac
  shift
done
case "$gpu_choice" in
  auto|cuda|vulkan|none) ;;
  *) echo "install.sh: --gpu takes auto, cuda, vulkan or none, got '$gpu_choice'." >&2; exit 2 ;;
esac

if [ "$(uname -s)" != Linux ]; then
  echo "install.sh sets up Linux only; on macOS or Windows install with pip or pipx as README.md's \"Other platforms\" says." >&2
  exit 1
fi
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

# --dev's venvs for the tests' references; made in the background while libllama builds (pip here mostly unpacks
# wheels, the build compiles), their log printed after
test_venvs() {
  echo "==> creating .venv-oracle: the reference implementation the tests compare against"
  [ -x .venv-oracle/bin/python ] || "$python" -m venv .venv-oracle
  oracle=(.venv-oracle/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-oracle.txt)
  # shellcheck disable=SC2086
  "${oracle[@]}" $torch_spec
  "${oracle[@]}" "dflash[local]==0.1.0"
  # vLLM's speculators, the independent DFlash reference for `dflash export` (tests/speculators_reference.py): without
  # its training and data extras (torchvision, torchaudio, CUDA transfer engines), with the runtime deps it imports
  "${oracle[@]}" --no-deps speculators==0.9.0
  "${oracle[@]}" hs-connectors loguru openai protobuf psutil pydantic-settings
  # vLLM itself (its CPU wheel), for the test that vLLM parses and loads what `dflash export --to vllm` writes
  # (tests/vllm_reference.py): a venv of its own, as its transformers pin conflicts with the oracle's; exactly the lock
  echo "==> creating .venv-vllm: vLLM's CPU build, the loader the export test checks against"
  [ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
  vllm=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
  # shellcheck disable=SC2086
  "${vllm[@]}" $torch_spec
  "${vllm[@]}" --no-deps -r constraints-vllm.txt
  # llama.cpp's own converter, its gguf-py and vocabularies, from the sdist of the pinned llama-cpp-python: the oracle
  # python runs them to write tiny random GGUFs of new architectures (tests/tiny_archs.py, tests/test_architectures.py);
  # and its vendored chat templates, which tests/test_template_equality.py renders with dflash and with transformers
  if [ ! -f .venv-oracle/llama.cpp/convert_hf_to_gguf.py ] || [ ! -d .venv-oracle/llama.cpp/models/templates ]; then
    echo "==> unpacking llama.cpp's converter into .venv-oracle/llama.cpp"
    work=$(mktemp -d)
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
      -c constraints.txt llama-cpp-python -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
      '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/models/ggml-vocab-*.gguf' \
      '*/vendor/llama.cpp/models/templates/*'
    rm -rf .venv-oracle/llama.cpp.partial
    mv "$work"/llama_cpp_python-*/vendor/llama.cpp .venv-oracle/llama.cpp.partial
    rm -rf .venv-oracle/llama.cpp
    mv .venv-oracle/llama.cpp.partial .venv-oracle/llama.cpp
    rm -rf "$work"
  fi
}

# llama-cpp-python (GGUF targets) builds libllama from source for the CPU, GPU or not: a CUDA build needs nvcc, which
# most machines lack; the GPU path is the torch target with Triton kernels (the gpu extra).
extras=gguf
[ "$gpu" = 1 ] && extras=gguf,gpu
[ "$dev" = 1 ] && extras=dev
echo "==> installing dflash-local[$extras]"
"${pip[@]}" -e ".[$extras]"
if [ "$dev" = 1 ]; then
  venvs_log=$(mktemp)
  test_venvs >"$venvs_log" 2>&1 &
  venvs_pid=$!
  trap 'kill "$venvs_pid" 2>/dev/null || true' EXIT  # a failed build stops them too
fi
# DFlash is bitwise lossless on F16/BF16/F32 GGUFs on the CPU only with a libllama built without llamafile's tinyBLAS:
# build it once per llama-cpp-python version into .venv/lib/dflash-libllama (a few minutes).
tools/build_libllama.sh .venv

# The GPU build beside it (its CPU backend is the same), once per llama-cpp-python version and backend.
backend=$gpu_choice
if [ "$backend" = auto ]; then
  if [ "$gpu" = 1 ]; then
    backend=cuda
  elif .venv/bin/python -m dflash_local.vulkan_probe >/dev/null 2>&1; then
    backend=vulkan
  else
    backend=none
  fi
fi
if [ "$backend" != none ]; then
  if missing=$(tools/gpu_build_deps.sh "$backend" "$dev") && tools/build_libllama.sh --backend "$backend" .venv; then
    echo "==> dflash runs GGUFs on the GPU through llama.cpp's $backend backend (dflash doctor lists the devices)"
  else
    echo "install.sh: the $backend libllama was not built (${missing:-the build failed, log above}); dflash runs on the CPU." >&2
  fi
fi

if [ "$dev" = 1 ]; then
  venvs_status=0
  wait "$venvs_pid" || venvs_status=$?
  cat "$venvs_log"
  rm -f "$venvs_log"
  if [ "$venvs_status" != 0 ]; then
    echo "install.sh: the test venvs (.venv-oracle, .venv-vllm) were not made (log above)." >&2
    exit "$venvs_status"
  fi
fi
echo "==> done: run .venv/bin/dflash --help"
