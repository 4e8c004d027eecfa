"""Where one `generate` call of DFlash 2's own loop spends its wall time: prefill, rounds, host reads, finishing.

    python -m dflash2.lab.profile_call --device cuda [--compile] --out runs/profile-call.json

After two warm-up calls, each prompt's call is timed whole and in parts (the prefill and `finish` are wrapped with
device synchronisations; the rest of the call is the rounds and the host reads). The round's replay time comes from
back-to-back replays, so `loop_s - rounds * replay` is what the host adds between rounds. One call more runs under
`torch.profiler`; its busiest host and device operations are printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import torch


def main(argv=None):
    from dflash2.benchmarks.bench import synchronize
    from dflash2.benchmarks.common import command_line, write_report
    from dflash2.pairs import add_model_arguments, load_pair
    from dflash2.generation import decode
    from dflash2.tasks import chat_prompt_ids, task_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per task (default 5)")
    parser.add_argument("--skip", type=int, default=110, help="prompts of each task to leave out first")
    parser.add_argument("--compile", action="store_true", help="the inductor-fused round")
    parser.add_argument("--out", default=None)
    parser.set_defaults(max_new_tokens=256)
    args = parser.parse_args(argv)

    target, tokenizer, drafter = load_pair(args)
    device = drafter.device
    prompts = task_prompts("humaneval", args.num_prompts, skip=args.skip) + task_prompts(
        "mtbench", args.num_prompts, skip=args.skip - 60)
    encoded = [torch.tensor([chat_prompt_ids(tokenizer, p)], device=device) for p in prompts]
    kwargs = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id, max_new_tokens=args.max_new_tokens,
                  cache_implementation="static", assistant_model=drafter, **({"compile": True} if args.compile else {}))
    for ids in encoded[:2]:
        target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    runner = drafter.round_runners(batch=1)[-1]
    core = runner.core

    parts = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            synchronize(device)
            started = time.perf_counter()
            result = fn(*a, **k)
            synchronize(device)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - started
            return result
        return wrapper

    original_prefill, original_finish = core.prefill, decode.finish
    core.prefill = timed("prefill_s", core.prefill)
    decode.finish = timed("finish_s", decode.finish)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(50):
        runner()
    synchronize(device)
    replay = (time.perf_counter() - started) / 50

    rows = []
    try:
        for ids in encoded:
            parts.clear()
            synchronize(device)
            started = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            synchronize(device)
            total = time.perf_counter() - started
            rounds = int(core.rounds[0])
            loop = total - parts.get("prefill_s", 0.0) - parts.get("finish_s", 0.0)
            rows.append({"prompt_tokens": ids.shape[1], "new_tokens": out.shape[1] - ids.shape[1], "rounds": rounds,
                         "total_s": round(total, 4), **{k: round(v, 4) for k, v in parts.items()},
                         "loop_s": round(loop, 4), "loop_over_replays": round(loop / max(rounds * replay, 1e-9), 3)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        core.prefill, decode.finish = original_prefill, original_finish

    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profiler:
        ids = encoded[0]
        target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        synchronize(device)
    table_cpu = profiler.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    table_device = profiler.key_averages().table(
        sort_by="cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=25)
    print(table_cpu, table_device, sep="\n")
    report = {"command": command_line("dflash2.lab.profile_call", argv), "round_kind": runner.kind,
              "replay_ms": round(replay * 1e3, 3), "capacity": core.capacity, "calls": rows,
              "profile_cpu_top": table_cpu, "profile_device_top": table_device}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
