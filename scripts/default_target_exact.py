"""The default target's 20 test prompts (HumanEval 100-109, MT-Bench 40-49) in fp32: DFlash 2's own loop, batch 1 and
batch 4 left-padded, against plain greedy, token for token -- what `tests/test_gpu.py` checks on a GPU, on any device.

    python scripts/default_target_exact.py --tree-nodes 32 [--device cpu] [--max-new-tokens 128]
"""

import argparse
import time

import torch

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import chat_prompt_ids, task_prompts
from dflash2.training.decoding import left_padded


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree-nodes", type=int, default=0, help="0: verify a path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).to(args.device).eval()
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    target.to(args.device).eval()
    drafter.attach(target)
    drafter.config.max_speculative_batch_size = 4  # speculate at batch 4 on a CPU too (its default stops at 2)
    prompts = task_prompts("humaneval", 10, skip=100) + task_prompts("mtbench", 10, skip=40)
    rows = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    pad = tokenizer.eos_token_id
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    plain, single, taus = [], 0, []
    for row in rows:
        ids = torch.tensor([row], device=args.device)
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), **greedy)[0, len(row):].tolist()
        plain.append(reference)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              cache_implementation="static", tree_nodes=args.tree_nodes, **greedy)
        single += out[0, len(row):].tolist() == reference
        taus.append(drafter.last_stats.acceptance_length)
    batched = 0
    for begin in range(0, len(rows), 4):
        group = rows[begin: begin + 4]
        ids, mask = left_padded(group, pad)
        out = target.generate(ids.to(args.device), attention_mask=mask.to(args.device), assistant_model=drafter,
                              cache_implementation="static", tree_nodes=args.tree_nodes, **greedy)
        for offset, want in enumerate(plain[begin: begin + 4]):
            batched += out[offset, ids.shape[1]: ids.shape[1] + len(want)].tolist() == want
    print(f"fp32, {args.device}, tree_nodes={args.tree_nodes}, {len(rows)} prompts, {args.max_new_tokens} new tokens: "
          f"identical to plain greedy at batch 1 {single}/{len(rows)}, at batch 4 {batched}/{len(rows)}; "
          f"mean tau (batch 1) {sum(taus) / len(taus):.2f}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
