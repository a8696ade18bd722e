#!/usr/bin/env bash
# Builds the libllama dflash loads: llama-cpp-python's own source (the version installed in the venv) with ggml's CPU
# matmul patched (tools/patch_ggml_cpu.py): prompt batches of 64 rows or more run llamafile's tinyBLAS and the tiled
# K-quant matmul for all rows but their last, while verify and one-token batches and each batch's last row sum in the
# one-token order, and a one-row batch's flash attention takes a verify row's kernel, so DFlash stays bitwise lossless
# on the CPU (docs/gguf.md); and with the layer-input taps set in the graph builders of the architectures in TAPS
# (stock llama.cpp sets them for llama and qwen3, not gemma3: one line in the layer loop); and beside libllama,
# llama.cpp's multimodal library libmtmd (image projectors: dflash_local/vision.py) from the same build, linking that
# libllama.
# --backend vulkan or cuda adds that GPU backend to the same build (its CPU backend is the same as the CPU build's);
# the libraries go to VENV/lib/dflash-libllama (cpu) or VENV/lib/dflash-libllama-BACKEND, where
# dflash_local/llama_lib.py finds them. A build of the same version, taps and patches there is kept.
#   tools/build_libllama.sh [--backend cpu|vulkan|cuda] [VENV]      # default: cpu, .venv
set -euo pipefail
cd "$(dirname "$0")/.."
backend=cpu
if [ "${1:-}" = --backend ]; then
  backend=$2
  shift 2
fi
venv=${1:-.venv}
python="$venv/bin/python"
version=$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
taps="gemma3"
# tools/patch_ggml_*.py's changes, and libmtmd built beside libllama: a build made before a new patch (or without
# libmtmd) is redone
patches="prompt-rows one-row-attention mtmd"
case "$backend" in
  cpu) dest="$venv/lib/dflash-libllama"; flags=() ;;
  vulkan) dest="$venv/lib/dflash-libllama-vulkan"; flags=(-DGGML_VULKAN=ON); patches="$patches headers descriptors" ;;
  cuda)
    dest="$venv/lib/dflash-libllama-cuda"
    nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
    # the GPU's own architecture only (a build for every architecture takes hours): compute_cap 8.6 -> 86
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
    flags=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch")
    wheels="$(cd "$venv" && pwd)/lib/dflash-cuda-toolkit/nvidia/cu13"  # tools/cuda_toolkit.sh's: no system nvcc
    if [ ! -x "$nvcc" ] && [ -x "$wheels/bin/nvcc" ]; then
      nvcc="$wheels/bin/nvcc"
      flags+=("-DCUDAToolkit_ROOT=$wheels")
    fi
    flags+=("-DCMAKE_CUDA_COMPILER=$nvcc")
    ;;
  *) echo "build_libllama.sh: unknown backend $backend (cpu, vulkan or cuda)" >&2; exit 2 ;;
esac
if [ -f "$dest/libllama.so" ] && [ "$(cat "$dest/llama-cpp-python.version" 2>/dev/null)" = "$version" ] &&
  [ "$(cat "$dest/tapped-architectures" 2>/dev/null)" = "$taps" ] &&
  [ "$(cat "$dest/patches" 2>/dev/null)" = "$patches" ]; then
  echo "==> libllama ($backend) for llama-cpp-python $version: already built"
  exit 0
fi
echo "==> building libllama $version for $backend with prompt rows apart from verify rows (lossless; minutes)"
work=$(mktemp -d)
stage=$(mktemp -d "$venv/lib/.dflash-libllama.XXXXXX")  # beside dest, so that the final rename is atomic
chmod 755 "$stage"
trap 'rm -rf "$work" "$stage"' EXIT
pip=("$python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" download --no-deps --no-binary llama-cpp-python -c constraints.txt "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
for arch in $taps; do  # the tap goes first in the layer loop, as in src/models/llama.cpp
  builder="$src/src/models/$arch.cpp"
  sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$builder"
  if [ "$(grep -c 'res->t_layer_inp\[il\] = inpL;' "$builder")" != 1 ]; then
    echo "build_libllama.sh: could not set the layer taps in $builder (its layer loop changed?)" >&2
    exit 1
  fi
done
"$python" tools/patch_ggml_cpu.py "$src/ggml/src/ggml-cpu"
if [ "$backend" = vulkan ]; then
  # builds against Debian 12's older Vulkan headers, and binds a live buffer to every descriptor (docs/gpu.md)
  "$python" tools/patch_ggml_vulkan.py "$src/ggml/src/ggml-vulkan"
fi
if ! command -v cmake >/dev/null 2>&1; then  # as pip's own build of llama-cpp-python does: CMake from PyPI
  "${pip[@]}" install --target "$work/tools" cmake
  export PATH="$work/tools/bin:$PATH"
fi
# shellcheck disable=SC2086  # CMAKE_ARGS holds several options
if ! cmake -S "$work/llama_cpp_python-$version" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_LLAMAFILE=ON \
  -DLLAVA_BUILD=ON -DMTMD_VIDEO=OFF "${flags[@]}" ${CMAKE_ARGS:-} >"$work/build.log" 2>&1 ||
  ! cmake --build "$work/build" --target llama mtmd -j "${BUILD_JOBS:-$(nproc)}" >>"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "build_libllama.sh: the $backend libllama build failed (log above)" >&2
  exit 1
fi
cp -P "$work"/build/bin/lib{llama,ggml}*.so* "$stage"/
find "$work/build" -name 'libmtmd.so*' -exec cp -P {} "$stage"/ \;  # built outside llama.cpp's folder: not in bin/
[ -f "$stage/libmtmd.so" ] || { echo "build_libllama.sh: the build made no libmtmd.so" >&2; exit 1; }
echo "$version" >"$stage/llama-cpp-python.version"
echo "$taps" >"$stage/tapped-architectures"
echo "$patches" >"$stage/patches"
echo "$backend" >"$stage/backend"
# dest is replaced in one step where it exists (renameat2's RENAME_EXCHANGE): a process loading it meanwhile (another
# run's tests) finds the old build or the new one, never none; the old one is left in stage, removed on exit
if [ ! -e "$dest" ] || ! "$python" - "$stage" "$dest" <<'EOF'
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
at_fdcwd, rename_exchange = -100, 2
if libc.renameat2(at_fdcwd, os.fsencode(sys.argv[1]), at_fdcwd, os.fsencode(sys.argv[2]), rename_exchange) != 0:
    sys.exit(f"renameat2: {os.strerror(ctypes.get_errno())}")
EOF
then
  rm -rf "$dest"
  mv "$stage" "$dest"
fi
echo "==> built: $dest"
