"""The first minutes of a fresh process, call by call: how soon DFlash 2's own loop runs its fused round.

    python -m dflash2.benchmarks.first_minute --seconds 300 --out first_minute.jsonl              # greedy, batch 1
    python -m dflash2.benchmarks.first_minute --seconds 300 --temperature 0.7 --top-p 0.9 --out sampled.jsonl
    python -m dflash2.benchmarks.first_minute --seconds 120 --batch 8 --prompts 16 --mtbench-skip 50 \
        --humaneval-skip 120 --out batch8.jsonl      # MT-Bench 50-57 and HumanEval 120-127, 8 rows a call
    python -m dflash2.benchmarks.first_minute --export fused-rounds --batch-sizes 1 8    # build the shipped packages

`--export DIR` builds, from empty caches, the fused packages a 256-token answer needs (every buffer capacity up to a
768-token request's, for each of `--batch-sizes`, side by side) into DIR under their portable keys (`dflash2
precompile --artifacts`); DIR = dflash2's `fused-rounds/` ships them in the package.

The compile caches (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`) and dflash2's `fused-rounds/` start empty (fetched
data files and converted targets are reused): a fresh machine, with whatever packages ship in the drafter folder's or
dflash2's `fused-rounds/`. `--keep-caches` uses the caches as they are. It cycles MT-Bench first turns and HumanEval
prompts (half each of `--prompts`) for `--seconds` from the first call, one line per call (its start, tokens/s, how
the rounds ran), then each prompt's steady fused speed (the median of its fused calls) and how many calls from
`--after` seconds on ran at 0.8x of it or more. `--out` keeps every call as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def fresh_caches() -> None:
    """Empty compile caches and an empty fused-rounds/ (data files and converted targets linked from the usual
    cache), for this process and the children it starts; inductor and triton read them when they first compile."""
    from dflash2.generation.fused_package import cache_root

    usual, fresh = cache_root(), Path(tempfile.mkdtemp(prefix="dflash2-first-minute-"))
    for kept in ("packages", "targets"):
        if (usual / kept).is_dir():
            (fresh / kept).symlink_to(usual / kept)
    os.environ["DFLASH2_CACHE"] = str(fresh)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(fresh / "triton")
    print(f"fresh caches under {fresh}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300, help="keep calling this long from the first call")
    parser.add_argument("--after", type=float, default=60, help="the calls judged start this late or later")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (left-padded)")
    parser.add_argument("--prompts", type=int, default=32, help="MT-Bench and HumanEval prompts cycled, half each")
    parser.add_argument("--mtbench-skip", type=int, default=0, help="the first MT-Bench prompt")
    parser.add_argument("--humaneval-skip", type=int, default=100, help="the first HumanEval prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="sample (default: greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--keep-caches", action="store_true", help="use the caches as they are")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU runs the eager rounds: a smoke test)")
    parser.add_argument("--out", default=None, help="JSON lines, one per call")
    parser.add_argument("--export", default=None, metavar="DIR", help="build and export the packages instead")
    parser.add_argument("--batch-sizes", nargs="+", default=["1", "8"], help="with --export")
    args = parser.parse_args(argv)
    if not args.keep_caches:
        fresh_caches()
    if args.export is not None:
        started = time.perf_counter()  # `dflash2 precompile` in a child: the benchmarks sit below the CLI
        subprocess.run([sys.executable, "-m", "dflash2.cli", "precompile", "--dtype", "bfloat16", "--batch-sizes",
                        *args.batch_sizes, "--max-length", "768", "--artifacts", args.export], check=True)
        print(f"built and exported in {time.perf_counter() - started:.0f} s", flush=True)
        from dflash2.generation.fused_package import cache_dir

        for log in sorted(cache_dir().glob("*.log")):  # each child's timings
            print(log.name, "|", " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:]), flush=True)
        return
    import torch

    from dflash2.generation import DFlash2Drafter, load_target
    from dflash2.model_args import DEFAULT_DRAFTER
    from dflash2.tasks import chat_prompt_ids, left_padded, task_prompts

    device = torch.device(args.device)
    drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=torch.bfloat16).to(device).eval()
    target, tokenizer = load_target(drafter.config, dtype=torch.bfloat16)
    target.to(device).eval()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    drafter.attach(target)
    texts = (task_prompts("mtbench", args.prompts // 2, skip=args.mtbench_skip)
             + task_prompts("humaneval", args.prompts - args.prompts // 2, skip=args.humaneval_skip))
    prompts = [chat_prompt_ids(tokenizer, text) for text in texts]
    sampling = (dict(do_sample=True, temperature=args.temperature, top_p=args.top_p or 1.0)
                if args.temperature is not None else dict(do_sample=False))
    calls, first, index = [], None, 0
    out = open(args.out, "w") if args.out else None
    while first is None or time.perf_counter() - first < args.seconds:
        rows = [prompts[(index + row) % len(prompts)] for row in range(args.batch)]
        ids, mask = (t.to(device) for t in left_padded(rows, tokenizer.eos_token_id))
        width = ids.shape[1]
        synchronize()
        started = time.perf_counter()
        first = started if first is None else first
        output = target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                 assistant_model=drafter, cache_implementation="static",
                                 pad_token_id=tokenizer.eos_token_id, **sampling)
        synchronize()
        seconds = time.perf_counter() - started
        tokens = int((output[:, width:] != tokenizer.eos_token_id).sum())  # every row's new tokens before EOS
        call = {"call": len(calls), "prompt": index % len(prompts), "start_s": round(started - first, 2),
                "seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                "kind": drafter.round_kind(1 << (args.batch - 1).bit_length())}
        calls.append(call)
        print(f"{call['start_s']:7.1f} s  prompt {call['prompt']:2d}  {call['tokens_per_s']:7.1f} tok/s  "
              f"{call['kind']}", flush=True)
        if out:
            out.write(json.dumps(call) + "\n")
        index += args.batch
    summarize(calls, args.after)


def summarize(calls: list[dict], after: float) -> None:
    """Each prompt's steady fused speed, and how many of the calls from `after` seconds on reached 0.8x of it."""
    fused = [call for call in calls if "fused" in (call["kind"] or "")]
    steady = {prompt: statistics.median(call["tokens_per_s"] for call in fused if call["prompt"] == prompt)
              for prompt in {call["prompt"] for call in fused}}
    judged = [call for call in calls if call["start_s"] >= after]
    fast = [call for call in judged if call["tokens_per_s"] >= 0.8 * steady.get(call["prompt"], float("inf"))]
    switch = next((call["start_s"] for call in fused), None)
    print(f"first fused call at {switch} s; calls from {after:.0f} s on at >= 0.8x their prompt's steady fused speed: "
          f"{len(fast)}/{len(judged)}; {len(calls)} calls", flush=True)


if __name__ == "__main__":
    main()
