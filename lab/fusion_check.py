"""compile="background" in one process: how long the child takes to build the round's package, then the unfused
round (graph of eager kernels on a GPU, eager on a CPU) against the package's round on the same prompts.

    python -m dflash2.lab.fusion_check --device cpu --out runs/fusion-check.json

As a user's first minutes go: the first call of the process (`first_call_s`: the core built and captured, the child
started) and then calls on the prompts in turn while the child builds (`while_building`: their times and what ran),
until the package exists; the next call loads, checks and switches (`switch_call_s`, and the device memory it added).
Then every prompt runs unfused (a core of its own) and fused. The package goes to a fresh folder (DFLASH2_CACHE) unless
one is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch


def main(argv=None):
    from dflash2.benchmarks.common import command_line, write_report
    from dflash2.pairs import add_model_arguments, load_pair
    from dflash2.benchmarks.speed import timed
    from dflash2.tasks import chat_prompt_ids, task_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, max_new_tokens=64)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--skip", type=int, default=120, help="HumanEval prompts to leave out first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("DFLASH2_CACHE", tempfile.mkdtemp(prefix="dflash2-fusion-check-"))

    target, tokenizer, drafter = load_pair(args)
    device = drafter.device
    encoded = [torch.tensor([chat_prompt_ids(tokenizer, p)], device=device)
               for p in task_prompts("humaneval", args.num_prompts, skip=args.skip)]
    # the tokenizer's EOS, as a user's calls (and speed.py's cold start and steady state) have it (the package built
    # here, the one a second process's first call finds, serves every EOS set and sampling setting)
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id,
                  cache_implementation="static", assistant_model=drafter)

    def call(ids, **extra):
        out, seconds = timed(target, ids, device, attention_mask=torch.ones_like(ids), **common, **extra)
        return out[0, ids.shape[1]:].tolist(), seconds

    started = time.perf_counter()
    _, first = call(encoded[0], compile="background")
    runner = next(r for r in drafter.round_runners() if r.fusion is not None)
    building = []  # (seconds, round kind) of each call made while the child builds
    while runner.fusion.state == "building" and runner.fusion.process.poll() is None:
        building.append((call(encoded[len(building) % len(encoded)], compile="background")[1], runner.kind))
    build = time.perf_counter() - started
    memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with warnings.catch_warnings(record=True) as caught:  # a refused package says why
        warnings.simplefilter("always")
        _, switch = call(encoded[0], compile="background")
    memory = torch.cuda.memory_allocated(device) - memory if device.type == "cuda" else None
    times = sorted(s for s, _ in building)
    unfused = [call(ids, compile=False) for ids in encoded]
    fused = [call(ids, compile="background") for ids in encoded]
    report = {"command": command_line("dflash2.lab.fusion_check", argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "dtype": str(drafter.dtype), "torch": torch.__version__,
              "first_call_s": round(first, 3), "child_build_s": round(build, 1),
              "while_building": {"calls": len(times), "kinds": sorted({k for _, k in building}),
                                 "median_s": round(times[len(times) // 2], 4) if times else None,
                                 "max_s": round(times[-1], 4) if times else None},
              "switch_call_s": round(switch, 3), "switch_memory_mb": None if memory is None else
              round(memory / 2 ** 20, 1), "kind": runner.kind, "fusion_state": runner.fusion.state,
              "switch_warnings": [str(w.message) for w in caught],
              "failure": runner.fusion.reason,
              "unfused_s": [round(s, 4) for _, s in unfused], "fused_s": [round(s, 4) for _, s in fused],
              "unfused_tokens": sum(len(ids) for ids, _ in unfused), "fused_tokens": sum(len(ids) for ids, _ in fused),
              "speedup": round(sum(len(ids) for ids, _ in fused) / sum(s for _, s in fused)
                               / (sum(len(ids) for ids, _ in unfused) / sum(s for _, s in unfused)), 3),
              "identical_outputs": sum(a == b for (a, _), (b, _) in zip(unfused, fused))}
    print(json.dumps(report, indent=1))
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
