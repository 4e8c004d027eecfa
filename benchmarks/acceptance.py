"""τ of a drafter over whole tasks (no timing): the acceptance length alone, on as many prompts as asked.

    python -m dflash2.benchmarks.acceptance --task humaneval [--num-prompts N] [--max-new-tokens 128] [--device cpu]
    python -m dflash2.benchmarks.acceptance --task humaneval,mtbench --skip 100,40 --num-prompts 10 \
        --max-new-tokens 256 --temperature 1      # issue #13's prompts, sampled (top-p with --top-p)
    python -m dflash2.benchmarks.acceptance --task mtbench,humaneval,math --skip 0,100,0 --max-new-tokens 256 \
        --drafter A --drafter B --out t0.json   # the category table of two drafters (then --temperature 1)
    python -m dflash2.benchmarks.acceptance --table t0.json t1.json   # one Markdown table of saved reports

Runs DFlash 2's own loop (`cache_implementation="static"`) with the drafter's rounds: a tree of the config's
`tree_nodes` (the shipped drafter: 32), or what --tree-nodes asks for (0: one path, the drafts of transformers'
assisted loop). Prints, per task, τ = completion tokens / target forwards (prefill included) over all its prompts, its
spread over prompts, and τ per prompt category (`tasks.task_categories`: MT-Bench's eight, "code", "math word
problems"). Greedy at --temperature 0 (the default); sampled above it, with no top-k cut (seeded by --seed, the same
for every drafter). With several --drafter, each is measured in turn on the same prompts and the report holds one run
per drafter; every run ends with the Markdown table of τ by category (the categories' mean too, the average a balanced
drafter is judged by).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch


def main(argv=None):
    from dflash2.benchmarks.common import write_report
    from dflash2.model_args import DEFAULT_DRAFTER, UsageError, add_model_arguments, check_model_arguments
    from dflash2.tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     conflict_handler="resolve")
    add_model_arguments(parser)
    parser.add_argument("--drafter", action="append", default=None, help="drafter folder; repeat it to measure "
                        "several, one after the other on the same prompts (default: the shipped one)")
    parser.add_argument("--table", nargs="+", default=None, metavar="REPORT",
                        help="load no model: print the Markdown table of τ by category of saved reports (--out)")
    parser.add_argument("--task", default="humaneval", help=f"one task or a comma-separated list of {TASKS}, or "
                        "prompts (the --prompt-file's prompts)")
    parser.add_argument("--prompt-file", default=None, help="task `prompts`: a prompt file (python -m "
                        "dflash2.training.prompts writes them) read in a seeded shuffle, e.g. training-distribution "
                        "prompts to set the real loop's τ beside the trainer's held-out estimate")
    parser.add_argument("--skip", default="0", help="prompts left out first: one number, or one per task (comma list)")
    parser.add_argument("--num-prompts", type=int, default=None, help="per task; default: every prompt of the task")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature above 0)")
    parser.add_argument("--out", default=None, help="write per-prompt results as JSON here")
    parser.add_argument("--tree-nodes", type=int, default=None, help="verify a tree of so many nodes per round (0: "
                        "one path); default: each drafter's config")
    parser.add_argument("--no-fusion", action="store_true", help="compile=False: no round is fused in the background "
                        "(the drafts and τ are the same; several measuring processes then share a GPU without "
                        "compiling children)")
    args = parser.parse_args(argv)
    if args.table:
        reports = [json.loads(Path(path).read_text()) for path in args.table]
        runs = [run for report in reports for run in report.get("runs", [report])]  # one run, or several
        print(category_table(runs))
        return runs
    tasks = args.task.split(",")
    skips = [int(s) for s in args.skip.split(",")]
    if "prompts" in tasks and not args.prompt_file:
        parser.error("--task prompts reads --prompt-file: give one")
    if any(task not in (*TASKS, "prompts") for task in tasks) or len(skips) not in (1, len(tasks)):
        parser.error(f"--task takes names from {TASKS}, and --skip one number or one per task; got --task "
                     f"{args.task} --skip {args.skip}")
    skips = skips * len(tasks) if len(skips) == 1 else skips
    pairs = [argparse.Namespace(**{**vars(args), "drafter": drafter}) for drafter in args.drafter or
             [str(DEFAULT_DRAFTER)]]
    for pair in pairs:  # every drafter checked before the first is measured
        try:
            check_model_arguments(pair)
        except UsageError as error:
            parser.error(str(error))
    runs = [measure(pair, tasks, skips) for pair in pairs]
    print(category_table(runs))
    report = runs[0] if len(runs) == 1 else {"runs": runs}
    write_report(report, args.out)
    return report


def measure(args, tasks: list[str], skips: list[int]) -> dict:
    """One drafter's report: τ per task and per prompt category, and per prompt."""
    from dflash2.model_args import load_pair, sampling_kwargs
    from dflash2.tasks import prompt_ids, read_prompts, task_categories, task_prompts

    target, tokenizer, drafter = load_pair(args, check=False)
    sampling = sampling_kwargs(args.temperature, args.top_p, args.top_k)
    torch.manual_seed(args.seed)
    from tqdm.auto import tqdm

    tree_nodes = drafter.config.tree_nodes if args.tree_nodes is None else args.tree_nodes
    report = {"drafter": args.drafter, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "top_p": sampling.get("top_p"), "top_k": sampling.get("top_k"), "tree_nodes": tree_nodes,
              "device": str(drafter.device), "dtype": str(target.dtype), "tasks": {}}
    for task, skip in zip(tasks, skips):
        tokens = forwards = 0
        per_prompt = []
        if task == "prompts":  # the file's prompts in a shuffle seeded by 0, so that a few of them mix its sources
            prompts = read_prompts(args.prompt_file)
            random.Random(0).shuffle(prompts)
            prompts = prompts[skip:][:args.num_prompts]
            categories = ["prompt file"] * len(prompts)
        else:
            prompts = task_prompts(task, args.num_prompts, skip=skip)
            categories = task_categories(task, args.num_prompts, skip=skip)
        for prompt in tqdm(prompts, desc=task, mininterval=10):
            ids = torch.tensor([prompt_ids(tokenizer, prompt, 512)], device=drafter.device)
            target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                            cache_implementation="static", max_new_tokens=args.max_new_tokens, tree_nodes=tree_nodes,
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
                                 "by_category": by_category(per_prompt, categories), "per_prompt": per_prompt}
        print(json.dumps({task: {k: v for k, v in report["tasks"][task].items() if k != "per_prompt"}}), flush=True)
    return report


def by_category(per_prompt: list[dict], categories: list[str]) -> dict:
    """τ of each prompt category: its prompts' tokens over their target forwards."""
    table = {}
    for category in dict.fromkeys(categories):
        rows = [row for row, c in zip(per_prompt, categories) if c == category]
        tokens, forwards = sum(r["tokens"] for r in rows), sum(r["target_forwards"] for r in rows)
        table[category] = {"prompts": len(rows), "tau": round(tokens / forwards, 3)}
    return table


def category_table(runs: list[dict]) -> str:
    """Markdown: a row per prompt category, per task with several categories the mean of its categories' τ, per task its
    τ over all prompts, and for runs of several tasks the mean over all their categories (the average a drafter is
    judged by); a column per run (drafter and temperature)."""
    columns = [f"{run['drafter']}, T {run['temperature']:g}" + top_k_label(run)
               + (f", tree {run['tree_nodes']}" if run.get("tree_nodes") else ", path" if "tree_nodes" in run else "")
               for run in runs]
    rows: dict[str, list] = {}
    overall: dict[str, list] = {}  # the mean over every task's categories, for runs of several tasks
    for column, run in enumerate(runs):
        if len(run["tasks"]) > 1:
            every = [row["tau"] for entry in run["tasks"].values() for row in entry["by_category"].values()]
            overall.setdefault(f"every task: mean of its {len(every)} categories", [None] * len(runs))[column] = (
                statistics.mean(every))  # rounded once, when printed (2.0348 must not print as 2.035 -> 2.04)
        for task, entry in run["tasks"].items():
            cells = {name: row["tau"] for name, row in entry["by_category"].items()}
            if len(cells) > 1:
                cells[f"{task}: mean of its {len(cells)} categories"] = statistics.mean(cells.values())
            cells[f"{task}: all {entry['prompts']} prompts from {entry['skip']}"] = entry["tau"]
            for name, tau in cells.items():
                rows.setdefault(name, [None] * len(runs))[column] = tau
    lines = ["| τ | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    lines += [f"| {name} | " + " | ".join("" if tau is None else f"{tau:.2f}" for tau in taus) + " |"
              for name, taus in {**rows, **overall}.items()]
    return "\n".join(lines)


def top_k_label(run: dict) -> str:
    """A sampled run's top-k cut, when it had one. Reports written before `top_k` was recorded sampled with none: they
    left top_k unset, and the own loop did not apply transformers' default cut then."""
    if not run["temperature"]:
        return ""
    top_k = run.get("top_k", 0)
    return f", top-k {top_k}" if top_k else ""


if __name__ == "__main__":
    main()
