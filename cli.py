"""The `dflash2` command: generate, bench, train.

    dflash2 generate --prompt "Write a haiku about GPUs."      # SmolLM2-135M-Instruct + the shipped drafter
    dflash2 bench --num-prompts 8 --out runs/bench
    dflash2 train --target ... --prompts prompts.jsonl --out runs/x
"""

from __future__ import annotations

import argparse
import sys

from dflash2.benchmarks.common import add_model_arguments, load_pair

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def command_generate(args) -> None:
    import torch
    from transformers import TextStreamer

    from dflash2.benchmarks.bench import timed_generate
    from dflash2.tasks import chat_prompt_ids

    target, tokenizer, drafter = load_pair(args)
    ids = torch.tensor([chat_prompt_ids(tokenizer, args.prompt)], device=drafter.device)
    sampling = {"do_sample": False} if args.temperature == 0 else {
        "do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                  pad_token_id=tokenizer.eos_token_id, **sampling)
    if args.static:  # both sides get static caches: the fixed-shape DFlash 2 loop against compiled plain decoding
        kwargs["cache_implementation"] = "static"
    # warm-up outside the timed runs (allocator, kernels)
    target.generate(ids, assistant_model=drafter, **{**kwargs, "max_new_tokens": 8})
    if not args.no_baseline:
        target.generate(ids, **{**kwargs, "max_new_tokens": 8})

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds, _ = timed_generate(target, ids, dict(assistant_model=drafter, streamer=streamer, **kwargs),
                                     drafter.device)
    new_tokens = out.shape[1] - ids.shape[1]
    stats = drafter.last_stats
    line = (f"[dflash2] tau {stats.acceptance_length:.2f} | {new_tokens} tokens in {seconds:.2f} s = "
            f"{new_tokens / seconds:.1f} tok/s")
    if not args.no_baseline:
        plain, plain_seconds, _ = timed_generate(target, ids, kwargs, drafter.device)
        plain_rate = (plain.shape[1] - ids.shape[1]) / plain_seconds
        line += f" | plain generate {plain_rate:.1f} tok/s | speedup {new_tokens / seconds / plain_rate:.2f}x"
        if args.temperature == 0:
            line += " | identical to plain greedy" if torch.equal(out, plain) else " | differs from plain greedy"
    line += f" | {drafter.device}, {str(drafter.dtype).replace('torch.', '')}"
    print(line, flush=True)


def command_bench(args) -> None:
    from dflash2.benchmarks.bench import markdown_table, run_batched_benchmark, run_benchmark, write_reports
    from dflash2.generation import DFlash2Drafter

    target, tokenizer, drafter = load_pair(args)
    command = "dflash2 " + " ".join(sys.argv[1:])
    if args.batch_sizes:  # throughput at several batch sizes instead of the per-method table
        results = {"settings": {"command": command, "device": str(drafter.device), "dtype": str(drafter.dtype)},
                   "batched": run_batched_benchmark(target, tokenizer, drafter, args.batch_sizes, args.tasks[-1],
                                                    args.max_new_tokens)}
        written = write_reports(results, args.out)
        print(markdown_table(results))
        print("wrote " + ", ".join(str(p) for p in written))
        return
    drafters = {"dflash2": drafter}
    if args.dflash1_drafter:
        dflash1 = DFlash2Drafter.from_pretrained(args.dflash1_drafter, dtype=drafter.dtype)
        drafters["dflash1"] = dflash1.to(drafter.device).eval().attach(target)
    results = run_benchmark(target, tokenizer, drafters, tasks=args.tasks, num_prompts=args.num_prompts, command=command,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            static=args.static,
                            on_task_done=lambda partial: write_reports(partial, args.out))
    written = write_reports(results, args.out)
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in written))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description="DFlash 2 speculative decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate with speculation and print speed statistics")
    generate.add_argument("--prompt", default=DEFAULT_PROMPT)
    add_model_arguments(generate)
    generate.add_argument("--no-baseline", action="store_true", help="skip the plain-generate comparison")
    generate.add_argument("--static", action="store_true",
                          help="static caches on both sides: the fixed-shape DFlash 2 loop (compiled on CUDA)")
    generate.set_defaults(run=command_generate)

    bench = commands.add_parser("bench", help="compare decoding methods on HumanEval and MT-Bench prompts")
    add_model_arguments(bench)
    bench.add_argument("--dflash1-drafter", default=None, help="a DFlash 1 drafter folder to compare as well")
    bench.add_argument("--tasks", nargs="+", default=["humaneval", "mtbench"], choices=["humaneval", "mtbench"])
    bench.add_argument("--num-prompts", type=int, default=8, help="prompts per task")
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                       help="instead of the method table: plain vs DFlash 2 throughput at these batch sizes (greedy)")
    bench.add_argument("--static", action="store_true",
                       help="also time plain generate and DFlash 2 with static caches (compiled on CUDA)")
    bench.add_argument("--out", default="runs/bench", help="folder for results.json, results.md and plots")
    bench.set_defaults(run=command_bench)

    from dflash2.training.recipe import add_arguments, run

    train = add_arguments(commands.add_parser("train", help="train a drafter for a target (self-distillation)"))
    train.set_defaults(run=lambda args: print(run(args)))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
