#!/usr/bin/env bash
# Benchmark calls of one 2 x H200 lease (device kind nvidia-h200-x2), one lane per GPU, each call inside 10 minutes.
# The calls go back to back (a warm machine keeps /tmp for about 30 s after a call). Staging the default target's GGUF
# needs one call per chunk (../shared/device/stage-target.sh: .device/part1, part2, ...; a call carries at most 64 MiB
# with the tree, so a tree of ~38 MB takes chunks of 16 MB, six of them); the `scale-*` phases need no
# target, so each staging call also runs a random-weight scale part. `speed` needs the target staged and .carry/eval
# carried (HumanEval.jsonl.gz + question.jsonl: the image lacks the packages that ship them).
#
#   bash scripts/h200_session.sh scale-a   # GPU 0: scale 8b; GPU 1: scale 8b-long, then 8b with the fused round
#   bash scripts/h200_session.sh scale-b   # both GPUs: scale 32b (target split over the two), then lossless (fp32)
#   bash scripts/h200_session.sh speed     # GPU 0: speed, DFlash 2 fused (--compile), then its second process;
#                                          # GPU 1: speed, compiled plain; the fp32 GPU tests; one process with both
#   bash scripts/h200_session.sh speed2    # the same, fp32 tests first; GPU 0 adds the default (graph) round's cold
#                                          # start and steady state, GPU 1 a profile of the calls (profile_call)
#   bash scripts/h200_session.sh speed1    # one GPU: fp32 default-target test, fused DFlash 2, compiled plain
#   bash scripts/h200_session.sh fusion-a  # one GPU, no target: scripts/fusion_load_check.py, then compile="background"
#                                          # on tiny models (the GPU test)
#   bash scripts/h200_session.sh fusion    # one GPU: compile="background" -- fusion_check, then a second process
#   bash scripts/h200_session.sh plain     # one GPU: compiled plain decoding (cold, steady, sweep)
#   bash scripts/h200_session.sh tiny      # one GPU, no target (a staging call): the GPU tests on tiny models
#   bash scripts/h200_session.sh verify    # one GPU: the fp32 default-target tests (eager-kernel graph; the default
#                                          # loop after its switch to the round fused ahead of time)
#   bash scripts/h200_session.sh batch8    # one GPU: the default loop's cold start from an empty cache; batch 8, the
#                                          # default loop then plain batched generate; a later process's cold start
#   bash scripts/h200_session.sh batch8-one  # one GPU, one process: batch 8, the default loop and plain batched
#                                            # generate (static cache), median of three warm calls each
#   bash scripts/h200_session.sh tree-he   # one GPU: path against a tree of $TREE_NODES nodes (default 16), HumanEval
#   bash scripts/h200_session.sh tree-mt   #   100-163 / all 80 MT-Bench first turns, the default (fused) loop
#   bash scripts/h200_session.sh tree-both # one GPU: tree-he then tree-mt in one call
#   bash scripts/h200_session.sh table     # one GPU: the README table (default loop, tree) against plain-graph
#   bash scripts/h200_session.sh acceptance  # one GPU: tau by category, T 0 and 1, trees of 16 and 32 nodes
#   CANDIDATE=DIR bash scripts/h200_session.sh compare  # one GPU: the shipped drafter against DIR, T 0 and 1
#   bash scripts/h200_session.sh settings  # one GPU: a new sampling setting's first call (seeded), fused rounds
#   bash scripts/h200_session.sh round-ratio  # one GPU, no target: fused round / fused 16-token forward, 135M and 8B
#   bash scripts/h200_session.sh tree-profile # one GPU, no target: the path round and the tree round, part by part
#   bash scripts/h200_session.sh sweep-graph  # one GPU, no target: the exactness sweep through the graph rounds
#   bash scripts/h200_session.sh sweep-fused-0  # (and -1, -2) one GPU, no target: the sweep's fused cases, one pair
#   bash scripts/h200_session.sh sweep-all  # one GPU, no target: sweep-graph and sweep-fused-0/1/2 side by side
#   bash scripts/h200_session.sh verify-sweep  # one GPU: verify and sweep-all side by side
#   bash scripts/h200_session.sh stage     # a staging call alone (carry .device/partN, assemble.sh, whl)
#
# Each step has its own time limit and records its exit status (a crash inside a CUDA graph prints no traceback).
# Results: $OUT/<phase>.tar (the device returns at most 8 files).
set -u
phase="${1:?usage: h200_session.sh scale-a|scale-b|speed}"
[ -z "${SKIP_ASSEMBLE:-}" ] && [ -e .device/assemble.sh ] && bash .device/assemble.sh
source scripts/h200_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
S=/tmp/session/$phase; rm -rf "$S"; mkdir -p "$S"
quiet() { tr "\r" "\n" | grep --line-buffered -v -E "it/s|s/it|Loading|Converting|^\s*$"; }  # tqdm redraws end in \r
step() { local name="$1" seconds="$2"; shift 2; local begun=$SECONDS
  timeout "$seconds" python3 -X faulthandler "$@" 2>&1 | quiet > "$S/$name.log"
  echo "[$name] exit ${PIPESTATUS[0]} after $((SECONDS - begun))s" | tee -a "$S/$name.log"; tail -4 "$S/$name.log"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$S/gpus.txt"

case "$phase" in
stage) ;;
scale-a)
  (export CUDA_VISIBLE_DEVICES=0
   step scale-8b 540 -m dflash2.lab.scale --parts 8b --budget 500 --out "$S/scale-8b.json") &
  (export CUDA_VISIBLE_DEVICES=1
   step scale-8b-long 215 -m dflash2.lab.scale --parts 8b-long --budget 190 --out "$S/scale-8b-long.json"
   step scale-8b-fused 320 -m dflash2.lab.scale --parts 8b --methods plain-eager,fused --budget 300 \
     --out "$S/scale-8b-fused.json") &
  wait ;;
scale-b)
  step scale-32b 330 -m dflash2.lab.scale --parts 32b --budget 300 --out "$S/scale-32b.json"
  step scale-lossless 220 -m dflash2.lab.scale --parts lossless --budget 190 --out "$S/scale-lossless.json"
  ;;
speed)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  speed=(-m dflash2.benchmarks.speed --device cuda)
  (export CUDA_VISIBLE_DEVICES=0
   step speed-fused 360 "${speed[@]}" --compile --methods dflash2 --out "$S/speed-fused.json"
   step speed-fused-second 120 "${speed[@]}" --compile --methods dflash2 --quick --out "$S/speed-fused-second.json") &
  (export CUDA_VISIBLE_DEVICES=1
   step speed-plain 300 "${speed[@]}" --methods plain --out "$S/speed-plain.json"
   step gpu-tests 190 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging
   step speed-mixed 70 "${speed[@]}" --compile --methods dflash2,plain --quick --out "$S/speed-mixed.json") &
  wait ;;
speed2)  # after the prefill graphs: the same comparison again, the fp32 tests first, a profile of the calls
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  speed=(-m dflash2.benchmarks.speed --device cuda)
  (export CUDA_VISIBLE_DEVICES=0
   step speed-fused 320 "${speed[@]}" --compile --methods dflash2 --out "$S/speed-fused.json"
   step speed-graph 120 "${speed[@]}" --methods dflash2 --sections cold,steady --out "$S/speed-graph.json") &
  (export CUDA_VISIBLE_DEVICES=1
   step gpu-tests 190 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging
   step speed-plain 240 "${speed[@]}" --methods plain --out "$S/speed-plain.json"
   step profile-call 60 -m dflash2.lab.profile_call --device cuda --out "$S/profile-call.json") &
  wait ;;
speed1)  # one GPU, one step after the other: the fp32 test on the default target, fused DFlash 2, compiled plain
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  speed=(-m dflash2.benchmarks.speed --device cuda)
  step gpu-tests 150 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging -k default_target
  step speed-fused 200 "${speed[@]}" --compile --methods dflash2 --sections cold,steady,round,sweep \
    --out "$S/speed-fused.json"
  step speed-plain 130 "${speed[@]}" --methods plain --sections cold,steady --out "$S/speed-plain.json"
  ;;
fusion-a)  # one GPU, no target needed (a staging call): where loading a compiled round crashes, then compile="background"
           # on tiny models (the GPU test)
  step load-check 300 scripts/fusion_load_check.py --out "$S/load-check"
  step gpu-fusion 200 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging -k background
  ;;
fusion)  # one GPU, compile="background" on the default target: fusion_check (first call, calls while the child
         # builds, the switch and its memory, unfused vs fused; the package goes into DFLASH2_CACHE); then speed in a
         # fresh process that finds that package at once (cold start, steady state, round, sweep at batch 1 and 8)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  export DFLASH2_CACHE=/tmp/dflash2-cache
  step fusion-check 220 -m dflash2.lab.fusion_check --device cuda --max-new-tokens 256 --num-prompts 10 \
    --out "$S/fusion-check.json"
  step speed-background 330 -m dflash2.benchmarks.speed --device cuda --background-fusion --methods dflash2 \
    --sections cold,steady,round,sweep --out "$S/speed-background.json"
  ;;
plain)  # one GPU: compiled plain decoding, the comparison for `fusion` (cold start, steady state, sweep)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  step speed-plain 320 -m dflash2.benchmarks.speed --device cuda --methods plain --sections cold,steady,sweep \
    --out "$S/speed-plain.json"
  ;;
tree-he|tree-mt)  # one GPU: path against a tree of $TREE_NODES (default 16) nodes, the default (fused) loop, one task
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  task=$([ "$phase" = tree-he ] && echo humaneval || echo mtbench)
  step "$phase" 560 -m dflash2.benchmarks.speed --device cuda --tasks "$task" --methods dflash2-path,dflash2-tree \
    --tree-nodes "${TREE_NODES:-16}" --sections steady --num-prompts 80 --skip-humaneval 100 --skip-mtbench 0 \
    --out "$S/$phase-${TREE_NODES:-16}.json"
  ;;
tree-both)  # one GPU: tree-he then tree-mt in one call (each about 200 s with the background builds)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  for task in humaneval mtbench; do
    step "tree-$task" 280 -m dflash2.benchmarks.speed --device cuda --tasks "$task" --methods dflash2-path,dflash2-tree \
      --tree-nodes "${TREE_NODES:-16}" --sections steady --num-prompts 80 --skip-humaneval 100 --skip-mtbench 0 \
      --out "$S/tree-$task-${TREE_NODES:-16}.json"
  done ;;
table)  # one GPU: README's results table with the config's default (the tree), the default loop against the compiled
        # plain CUDA-graph loop, steady state, one process per task; then a new sampling setting's first call (seeded)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  for task in ${TASKS:-humaneval mtbench}; do
    sections=steady; [ "$task" = mtbench ] && sections=steady,settings
    step "table-$task" 290 -m dflash2.benchmarks.speed --device cuda --tasks "$task" --plain-graph-compile \
      --methods dflash2,plain-graph --sections "$sections" --num-prompts 80 --skip-humaneval 100 --skip-mtbench 0 \
      --out "$S/table-$task.json"
  done ;;
settings)  # one GPU: the table's `settings` section alone (the fused greedy and sampled rounds, then each new sampling
           # setting's first call against its second, seeded alike), one MT-Bench prompt
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  step settings 400 -m dflash2.benchmarks.speed --device cuda --compile --tasks mtbench --methods dflash2 \
    --sections settings --num-prompts 1 --skip-mtbench 0 --out "$S/settings.json"
  ;;
acceptance)  # one GPU: issue #30's table, tau by category (all 80 MT-Bench first turns, HumanEval 100-163, the math set),
             # greedy and T = 1, trees of $TREE_SET nodes (default 16 and 32; 0 is the path): a process per pair side by
             # side, each in the default loop as a user meets it (its graph round until its background build is in,
             # then the fused one), then one Markdown table of their reports
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  for temperature in 0 1; do
    for nodes in ${TREE_SET:-16 32}; do
      step "acceptance-t$temperature-n$nodes" 560 -m dflash2.benchmarks.acceptance --device cuda \
        --task mtbench,humaneval,math --skip 0,100,0 --max-new-tokens 256 --temperature "$temperature" \
        --tree-nodes "$nodes" --out "$S/acceptance-t$temperature-n$nodes.json" &
    done
  done
  wait
  python3 -m dflash2.benchmarks.acceptance --table "$S"/acceptance-t*.json | tee "$S/acceptance-table.md"
  ;;
compare)  # one GPU: the shipped drafter against CANDIDATE (a drafter folder) on issue #30's prompts, greedy and T = 1,
          # this config's tree, both drafters in one process per temperature (--no-fusion: the eager-kernel round
          # throughout, so no switch to the fused round lands at another prompt in each drafter's run)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  [ -e "${CANDIDATE:-}/config.json" ] || { echo "CANDIDATE=<drafter folder> is needed"; exit 2; }
  [ -e .carry/eval/question.jsonl ] || { echo "the evaluation prompts are missing: carry .carry/eval"; exit 2; }
  for temperature in 0 1; do
    step "compare-t$temperature" 560 -m dflash2.benchmarks.acceptance --device cuda --no-fusion \
      --drafter drafters/SmolLM2-135M-Instruct-DFlash2 --drafter "$CANDIDATE" --task mtbench,humaneval,math \
      --skip 0,100,0 --max-new-tokens 256 --temperature "$temperature" --out "$S/compare-t$temperature.json" &
  done
  wait
  python3 -m dflash2.benchmarks.acceptance --table "$S"/compare-t*.json | tee "$S/compare-table.md"
  ;;
round-ratio)  # one GPU, no target (a staging call): the fused round against the fused 16-token forward, 135M and 8B
  step round-ratio 560 -m dflash2.lab.round_profile --shape smollm2-135m,qwen3-8b --compile --parts round \
    --forwards forward16 --out "$S/round-ratio.json"
  ;;
tree-profile)  # one GPU, no target (a staging call): the path round and the tree round of 16 nodes, part by part
  step tree-profile 560 -m dflash2.lab.round_profile --shape smollm2-135m --compile --tree-nodes 0,16 --kernels \
    --forwards forward16 --out "$S/tree-profile.json"
  ;;
sweep-graph)  # one GPU, no target: the exactness sweep through the graph rounds (path and tree), then the tiny tests
  (export DFLASH2_SWEEP_FUSED=0 DFLASH2_SWEEP_OUT="$S/sweep-graph.json" DFLASH2_SWEEP_CASES="${SWEEP_CASES:-300}"
   step sweep-graph 300 -m pytest -q -m gpu tests/test_gpu_sweep.py -p no:cacheprovider -s)
  ;;
sweep-fused-0|sweep-fused-1|sweep-fused-2)  # one GPU, no target: the sweep through the fused rounds, one pair per call
  (export DFLASH2_SWEEP_FUSED=only DFLASH2_SWEEP_PAIRS="${phase#sweep-fused-}" DFLASH2_SWEEP_OUT="$S/$phase.json" \
     DFLASH2_SWEEP_CASES="${SWEEP_CASES:-80}"
   step "$phase" 540 -m pytest -q -m gpu tests/test_gpu_sweep.py -p no:cacheprovider -s)
  ;;
sweep-all)  # one GPU, no target: the graph sweep and the three pairs' fused sweeps as four processes side by side (the
           # fused cases are bound by inductor builds, CPU work: in parallel they take about as long as one pair alone)
  (export DFLASH2_SWEEP_FUSED=0 DFLASH2_SWEEP_OUT="$S/sweep-graph.json" DFLASH2_SWEEP_CASES="${SWEEP_CASES:-300}"
   step sweep-graph 560 -m pytest -q -m gpu tests/test_gpu_sweep.py -p no:cacheprovider -s) &
  for pair in 0 1 2; do
    (export DFLASH2_SWEEP_FUSED=only DFLASH2_SWEEP_PAIRS=$pair DFLASH2_SWEEP_OUT="$S/sweep-fused-$pair.json" \
       DFLASH2_SWEEP_CASES="${FUSED_CASES:-90}"
     step "sweep-fused-$pair" 560 -m pytest -q -m gpu tests/test_gpu_sweep.py -p no:cacheprovider -s) &
  done
  wait ;;
verify-sweep)  # one GPU: the default target's fp32 test beside sweep-all (all correctness, no timing: they may share it)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  (step gpu-default-target 560 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging \
     -k default_target) &
  SKIP_ASSEMBLE=1 bash "$0" sweep-all > "$S/sweep-all.out" 2>&1 &
  wait
  tar xf "$OUT/sweep-all.tar" -C "$S" && rm -f "$OUT/sweep-all.tar" ;;
tiny)  # one GPU, no target needed (a staging call)
  step gpu-tiny 240 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging -k "tiny or background"
  ;;
verify)  # one GPU, fp32, the default target: the eager-kernel graph, then the default loop fused ahead of time
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  step gpu-default-target 540 -m pytest -q -m gpu tests/test_gpu.py -s -p no:cacheprovider -p no:logging \
    -k default_target
  ;;
batch8)  # one GPU, four processes sharing one DFLASH2_CACHE (empty at the start): (1) the default loop's cold start
         # with nothing on disk (it converts the GGUF target; its child goes on building the batch-1 round after the
         # process exits); (2) batch 8 rows (natural ends, 256 new tokens), the default loop, its batch-8 round built
         # first; (3) plain batched generate with a static cache; (4) a later process: the converted target and the
         # batch-1 round on disk (cold start counted from the process start)
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  export DFLASH2_CACHE=/tmp/dflash2-cache
  rm -rf "$DFLASH2_CACHE"
  speed=(-m dflash2.benchmarks.speed --device cuda)
  step first-process 90 "${speed[@]}" --methods dflash2 --quick --out "$S/first-process.json"
  step batch8-dflash2 220 "${speed[@]}" --sections batches --batch-sizes 8 --methods dflash2 \
    --out "$S/batch8-dflash2.json"
  step batch8-plain 170 "${speed[@]}" --sections batches --batch-sizes 8 --methods plain --out "$S/batch8-plain.json"
  ls -la "$DFLASH2_CACHE"/* > "$S/cache.txt" 2>&1
  step later-process 80 "${speed[@]}" --methods dflash2 --quick --out "$S/later-process.json"
  ;;
batch8-one)  # one GPU, one process: batch 8, the default loop (its batch-8 round fused first) and plain batched
             # generate with a static cache, each warmed up with the timed call, median of three calls
  [ -e /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "target not staged"; exit 3; }
  step batch8-both 400 -m dflash2.benchmarks.speed --device cuda --sections batches --batch-sizes 8 \
    --methods dflash2,plain --out "$S/batch8-both.json"
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
tar cf "$OUT/$phase.tar" -C "$S" . && tar tf "$OUT/$phase.tar"
