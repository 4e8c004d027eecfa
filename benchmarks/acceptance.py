"""τ of a drafter over a whole task (greedy, no timing): the acceptance length alone, on as many prompts as asked.

    python -m dflash2.benchmarks.acceptance --task humaneval [--num-prompts N] [--max-new-tokens 128] [--device cpu]

Runs the fixed-shape loop (same drafts, same τ and output as transformers' assisted loop, less overhead) and prints
τ = completion tokens / target forwards (prefill included) over all prompts, plus its spread over prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main(argv=None):
    from dflash2.tasks import TASKS, task_prompts
    from dflash2.benchmarks.common import add_model_arguments, load_pair
    from dflash2.tasks import chat_prompt_ids

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--task", choices=TASKS, default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: every prompt of the task")
    parser.add_argument("--out", default=None, help="write per-prompt results as JSON here")
    args = parser.parse_args(argv)
    target, tokenizer, drafter = load_pair(args)
    tokens = forwards = 0
    per_prompt = []
    from tqdm.auto import tqdm

    for prompt in tqdm(task_prompts(args.task, args.num_prompts), desc=args.task, mininterval=10):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=drafter.device)
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                        cache_implementation="static", do_sample=False, max_new_tokens=args.max_new_tokens,
                        pad_token_id=tokenizer.eos_token_id)
        stats = drafter.last_stats
        tokens += stats.completion_tokens
        forwards += stats.target_forwards
        per_prompt.append({"tokens": stats.completion_tokens, "target_forwards": stats.target_forwards,
                           "tau": round(stats.acceptance_length, 3)})
    taus = [row["tau"] for row in per_prompt]
    report = {"task": args.task, "prompts": len(per_prompt), "max_new_tokens": args.max_new_tokens,
              "tau": round(tokens / forwards, 3), "tokens": tokens, "target_forwards": forwards,
              "tau_per_prompt_median": round(statistics.median(taus), 3),
              "tau_per_prompt_min": round(min(taus), 3), "tau_per_prompt_max": round(max(taus), 3),
              "device": str(drafter.device), "dtype": str(target.dtype)}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({**report, "per_prompt": per_prompt}, handle, indent=1)


if __name__ == "__main__":
    main()
