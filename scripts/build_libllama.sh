#!/usr/bin/env bash
# Builds the libllama dflash uses on the CPU: llama-cpp-python's own source (the version installed in the venv) with
# llamafile's tinyBLAS off (-DGGML_LLAMAFILE=OFF), so F16/BF16/F32 verify batches sum in the order of one-token
# decodes and DFlash stays bitwise lossless (README, "Lossless on every GGUF quantization"). The libraries go to
# VENV/lib/dflash-libllama, where dflash_local/llama_lib.py finds them; a build of the same version there is kept.
#   scripts/build_libllama.sh [VENV]      # default .venv; install.sh runs it on machines without an NVIDIA GPU
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python="$venv/bin/python"
version=$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
dest="$venv/lib/dflash-libllama"
if [ -f "$dest/libllama.so" ] && [ "$(cat "$dest/llama-cpp-python.version" 2>/dev/null)" = "$version" ]; then
  echo "==> batch-invariant libllama for llama-cpp-python $version: already built"
  exit 0
fi
echo "==> building libllama $version without llamafile's tinyBLAS (lossless F16 verification; a few minutes)"
work=$(mktemp -d)
stage=$(mktemp -d "$venv/lib/.dflash-libllama.XXXXXX")  # beside dest, so that the final rename is atomic
chmod 755 "$stage"
trap 'rm -rf "$work" "$stage"' EXIT
pip=("$python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" download --no-deps --no-binary llama-cpp-python -c constraints.txt "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
if ! command -v cmake >/dev/null 2>&1; then  # as pip's own build of llama-cpp-python does: CMake from PyPI
  "${pip[@]}" install --target "$work/tools" cmake
  export PATH="$work/tools/bin:$PATH"
fi
# shellcheck disable=SC2086  # CMAKE_ARGS holds several options
if ! cmake -S "$work/llama_cpp_python-$version" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_LLAMAFILE=OFF \
  -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-} >"$work/build.log" 2>&1 ||
  ! cmake --build "$work/build" --target llama -j "$(nproc)" >>"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "build_libllama.sh: the libllama build failed (log above)" >&2
  exit 1
fi
cp -P "$work"/build/bin/lib{llama,ggml}*.so* "$stage"/
echo "$version" >"$stage/llama-cpp-python.version"
rm -rf "$dest"
mv "$stage" "$dest"
echo "==> built: $dest"
