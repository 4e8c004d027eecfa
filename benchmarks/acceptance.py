"""τ of a drafter over whole tasks (no timing): the acceptance length alone, on as many prompts as asked.

    python -m dflash2.benchmarks.acceptance --task humaneval [--num-prompts N] [--max-new-tokens 128] [--device cpu]
    python -m dflash2.benchmarks.acceptance --task humaneval,mtbench --skip 100,40 --num-prompts 10 \
        --max-new-tokens 256 --temperature 1      # issue #13's prompts, sampled (top-p with --top-p)

Runs the fixed-shape loop (same drafts, same τ and output as transformers' assisted loop, less overhead) and prints,
per task, τ = completion tokens / target forwards (prefill included) over all its prompts, plus its spread over
prompts. Greedy at --temperature 0 (the default); sampled above it (seeded by --seed).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main(argv=None):
    from dflash2.benchmarks.common import write_report
    from dflash2.pairs import add_model_arguments, load_pair
    from dflash2.tasks import TASKS, prompt_ids, task_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--task", default="humaneval", help=f"one task or a comma-separated list of {TASKS}, or "
                        "prompts (the --prompt-file's prompts)")
    parser.add_argument("--prompt-file", default=None, help="task `prompts`: a prompt file (python -m "
                        "dflash2.training.prompts writes them) read in a seeded shuffle, e.g. training-distribution "
                        "prompts to set the real loop's τ beside the trainer's held-out estimate")
    parser.add_argument("--skip", default="0", help="prompts left out first: one number, or one per task (comma list)")
    parser.add_argument("--num-prompts", type=int, default=None, help="per task; default: every prompt of the task")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature above 0)")
    parser.add_argument("--out", default=None, help="write per-prompt results as JSON here")
    parser.add_argument("--no-fusion", action="store_true", help="compile=False: no round is fused in the background "
                        "(the drafts and τ are the same; several measuring processes then share a GPU without "
                        "compiling children)")
    args = parser.parse_args(argv)
    tasks = args.task.split(",")
    skips = [int(s) for s in args.skip.split(",")]
    if "prompts" in tasks and not args.prompt_file:
        parser.error("--task prompts reads --prompt-file: give one")
    if any(task not in (*TASKS, "prompts") for task in tasks) or len(skips) not in (1, len(tasks)):
        parser.error(f"--task takes names from {TASKS}, and --skip one number or one per task; got --task "
                     f"{args.task} --skip {args.skip}")
    skips = skips * len(tasks) if len(skips) == 1 else skips
    target, tokenizer, drafter = load_pair(args)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 else (
        dict(do_sample=False))
    torch.manual_seed(args.seed)
    from tqdm.auto import tqdm

    report = {"drafter": args.drafter, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "top_p": args.top_p if args.temperature > 0 else None, "device": str(drafter.device),
              "dtype": str(target.dtype), "tasks": {}}
    for task, skip in zip(tasks, skips):
        tokens = forwards = 0
        per_prompt = []
        if task == "prompts":
            prompts = file_prompts(args.prompt_file)[skip:][:args.num_prompts]
        else:
            prompts = task_prompts(task, args.num_prompts, skip=skip)
        for prompt in tqdm(prompts, desc=task, mininterval=10):
            ids = torch.tensor([prompt_ids(tokenizer, prompt, 512)], device=drafter.device)
            target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                            cache_implementation="static", max_new_tokens=args.max_new_tokens,
                            **({"compile": False} if args.no_fusion else {}),
                            pad_token_id=tokenizer.eos_token_id, **sampling)
            stats = drafter.last_stats
            tokens += stats.completion_tokens
            forwards += stats.target_forwards
            per_prompt.append({"tokens": stats.completion_tokens, "target_forwards": stats.target_forwards,
                               "tau": round(stats.acceptance_length, 3)})
        taus = [row["tau"] for row in per_prompt]
        report["tasks"][task] = {"skip": skip, "prompts": len(per_prompt), "tau": round(tokens / forwards, 3),
                                 "tokens": tokens, "target_forwards": forwards,
                                 "tau_per_prompt_median": round(statistics.median(taus), 3),
                                 "tau_per_prompt_min": round(min(taus), 3), "tau_per_prompt_max": round(max(taus), 3),
                                 "per_prompt": per_prompt}
        print(json.dumps({task: {k: v for k, v in report["tasks"][task].items() if k != "per_prompt"}}), flush=True)
    write_report(report, args.out)
    return report


def file_prompts(path) -> list:
    """The prompts of a prompt file (texts or conversations) in a shuffle seeded by 0, so that a few of them mix its
    sources."""
    import random

    from dflash2.tasks import read_prompts

    prompts = read_prompts(path)
    random.Random(0).shuffle(prompts)
    return prompts


if __name__ == "__main__":
    main()
