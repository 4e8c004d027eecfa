"""compile="background" in one process: how long the child takes to build the round's package, then the unfused
round (graph of eager kernels on a GPU, eager on a CPU) against the package's round on the same prompts.

    python -m dflash2.benchmarks.fusion_check --device cpu --out runs/fusion-check.json

The first call starts the child and the script waits for it (a user's calls would go on unfused meanwhile); the
next call loads, checks and switches (`switch_call_s`). Then every prompt runs unfused (a core of its own) and fused.
The package goes to a fresh folder (DFLASH2_CACHE) unless one is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def main(argv=None):
    from dflash2.benchmarks.common import add_model_arguments, command_line, load_pair, write_report
    from dflash2.benchmarks.bench import synchronize
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
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=None,
                  pad_token_id=tokenizer.eos_token_id, cache_implementation="static", assistant_model=drafter)

    def call(ids, **extra):
        synchronize(device)
        started = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)
        synchronize(device)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - started

    started = time.perf_counter()
    call(encoded[0], compile="background")
    runner = next(r for r in drafter._round_cores.values() if getattr(r, "fusion", None) is not None)
    if runner.fusion.job is not None:
        runner.fusion.job.wait()
    build = time.perf_counter() - started
    _, switch = call(encoded[0], compile="background")
    unfused = [call(ids) for ids in encoded]
    fused = [call(ids, compile="background") for ids in encoded]
    report = {"command": command_line("dflash2.benchmarks.fusion_check", argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "dtype": str(drafter.dtype), "torch": torch.__version__,
              "child_build_s": round(build, 1), "switch_call_s": round(switch, 3), "kind": runner.kind,
              "failure": runner.fusion.job.failure() if runner.fusion.job is not None else None,
              "unfused_s": [round(s, 4) for _, s in unfused], "fused_s": [round(s, 4) for _, s in fused],
              "speedup": round(sum(s for _, s in unfused) / sum(s for _, s in fused), 3),
              "identical_outputs": sum(a == b for (a, _), (b, _) in zip(unfused, fused))}
    print(json.dumps(report, indent=1))
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
