#!/usr/bin/env bash
# Builds llama.cpp's own llama-server from the llama.cpp that the venv's llama-cpp-python vendors, stock (no dflash
# patch: llama-server as its users get it), for the benchmarks that put dflash beside it on the same GGUF
# (benchmarks/agent_session.py, `dflash bench --peer llama-server`). CPU only; about 15 minutes on 2 cores. The
# binary goes to VENV/lib/llama-server/, and a build of the same version there is kept.
# --dflash-settings builds it with the libllama settings dflash's own build has (tools/build_libllama.sh: the CPU
# matmul patch, prompt rows apart from verify rows, and the gemma3 layer taps) into VENV/lib/llama-server-dflash/.
#   tools/build_llama_server.sh [--dflash-settings] [VENV]      # default: .venv; prints the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."
settings=stock
if [ "${1:-}" = --dflash-settings ]; then
  settings=dflash
  shift
fi
venv=${1:-.venv}
python="$venv/bin/python"
version=$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
dest="$venv/lib/llama-server"
flags=()
if [ "$settings" = dflash ]; then
  dest="$venv/lib/llama-server-dflash"
  flags=(-DGGML_LLAMAFILE=ON)  # as build_libllama.sh's build
fi
if [ -x "$dest/llama-server" ] && [ "$(cat "$dest/llama-cpp-python.version" 2>/dev/null)" = "$version" ]; then
  echo "$dest/llama-server"
  exit 0
fi
echo "==> building llama-server from llama-cpp-python $version's llama.cpp ($settings settings; minutes)" >&2
work=$(mktemp -d)
stage=$(mktemp -d "$venv/lib/.llama-server.XXXXXX")  # beside dest, so that the final rename is atomic
chmod 755 "$stage"
trap 'rm -rf "$work" "$stage"' EXIT
"$python" -m pip --disable-pip-version-check --quiet download --no-deps --no-binary llama-cpp-python \
  -c constraints.txt "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ "$settings" = dflash ]; then  # the same edits as tools/build_libllama.sh's
  builder="$src/src/models/gemma3.cpp"
  sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$builder"
  if [ "$(grep -c 'res->t_layer_inp\[il\] = inpL;' "$builder")" != 1 ]; then
    echo "build_llama_server.sh: could not set the layer taps in $builder (its layer loop changed?)" >&2
    exit 1
  fi
  "$python" tools/patch_ggml_cpu.py "$src/ggml/src/ggml-cpu"
fi
if ! cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF "${flags[@]}" >"$work/build.log" 2>&1 ||
  ! cmake --build "$work/build" --target llama-server -j "$(nproc)" >>"$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log" >&2
  echo "build_llama_server.sh: the llama-server build failed (log above)" >&2
  exit 1
fi
cp "$work/build/bin/llama-server" "$stage/"
echo "$version" >"$stage/llama-cpp-python.version"
rm -rf "$dest"
mv "$stage" "$dest"
echo "$dest/llama-server"
