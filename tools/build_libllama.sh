#!/usr/bin/env bash
# Builds the libllama dflash uses on the CPU: llama-cpp-python's own source (the version installed in the venv) with
# llamafile's tinyBLAS off (-DGGML_LLAMAFILE=OFF), so F16/BF16/F32 verify batches sum in the order of one-token
# decodes and DFlash stays bitwise lossless (docs/gguf.md), and with the layer-input taps set in the graph builders
# of the architectures in TAPS (stock llama.cpp sets them for llama and qwen3, not gemma3: one line in the layer
# loop). The libraries go to VENV/lib/dflash-libllama, where dflash_local/llama_lib.py finds them (and reads which
# architectures got taps from tapped-architectures); a build of the same version and taps there is kept.
#   tools/build_libllama.sh [VENV]      # default .venv; install.sh runs it on machines without an NVIDIA GPU
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python="$venv/bin/python"
version=$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
dest="$venv/lib/dflash-libllama"
taps="gemma3"
if [ -f "$dest/libllama.so" ] && [ "$(cat "$dest/llama-cpp-python.version" 2>/dev/null)" = "$version" ] &&
  [ "$(cat "$dest/tapped-architectures" 2>/dev/null)" = "$taps" ]; then
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
for arch in $taps; do  # the tap goes first in the layer loop, as in src/models/llama.cpp
  builder="$work/llama_cpp_python-$version/vendor/llama.cpp/src/models/$arch.cpp"
  sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$builder"
  if [ "$(grep -c 'res->t_layer_inp\[il\] = inpL;' "$builder")" != 1 ]; then
    echo "build_libllama.sh: could not set the layer taps in $builder (its layer loop changed?)" >&2
    exit 1
  fi
done
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
echo "$taps" >"$stage/tapped-architectures"
rm -rf "$dest"
mv "$stage" "$dest"
echo "==> built: $dest"
