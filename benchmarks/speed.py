"""Speed as a user meets it: DFlash 2's own loop against compiled plain decoding (`cache_implementation="static"`).

    python -m dflash2.benchmarks.speed --device cuda --out runs/speed.json            # in a fresh process

Reports, in one process on one machine:
- cold start: the wall time of the first call of `--first` (compile or capture included), then of the other method;
- a first pass over the prompts (what the first minutes look like; `kind` says which round ran each call);
- the steady state (after DFlash 2's fused round exists): tokens/s, tau, speedup, per-prompt median and max;
- `--sweep N`: N prompts of N distinct token lengths, fixed new-token count (EOS ignored), at batch 1 and batch 8:
  slowest over median per-prompt time (a recompile or a capture would show as a stall);
- `--batch-sizes`: throughput of plain batched `generate` (static cache) and DFlash 2's batched loop;
- the round's device time (back-to-back graph replays) against its wall time inside a generate call.
Run it twice in fresh processes (the second finds torch's on-disk compile caches warm) and once with
`--first plain --quick` against a fresh TORCHINDUCTOR_CACHE_DIR for compiled plain decoding's own cold start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROCESS_STARTED = time.perf_counter()

import torch  # noqa: E402


def timed(target, ids, device, **kwargs):
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    started = time.perf_counter()
    out = target.generate(ids, **kwargs)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return out, time.perf_counter() - started


def left_pad(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def new_tokens(new: torch.Tensor, eos: int) -> int:
    """Tokens of each row up to and including its first EOS (plain and ours pad after it)."""
    is_eos = (new == eos).long()
    ended = is_eos.cumsum(-1) - is_eos > 0  # positions after the first EOS
    return int((~ended).sum())


def summary(times, tokens):
    return {"seconds_total": round(sum(times), 4), "tokens": tokens, "tokens_per_s": round(tokens / sum(times), 2),
            "per_prompt_median_s": round(statistics.median(times), 4), "per_prompt_max_s": round(max(times), 4),
            "max_over_median": round(max(times) / statistics.median(times), 3)}


def main(argv=None):
    from dflash2.benchmarks.common import add_model_arguments, load_pair
    from dflash2.tasks import chat_prompt_ids, task_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts per task (default 10)")
    parser.add_argument("--skip-humaneval", type=int, default=100, help="HumanEval prompts to leave out first")
    parser.add_argument("--skip-mtbench", type=int, default=40, help="MT-Bench prompts to leave out first")
    parser.add_argument("--first", choices=("dflash2", "plain"), default="dflash2", help="method called first")
    parser.add_argument("--quick", action="store_true", help="cold starts and the first pass only")
    parser.add_argument("--sweep", type=int, default=30, help="prompts of distinct lengths for the stall check (0: "
                        "skip)")
    parser.add_argument("--sweep-tokens", type=int, default=128, help="new tokens per sweep call (EOS ignored)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.set_defaults(max_new_tokens=256)
    args = parser.parse_args(argv)

    target, tokenizer, drafter = load_pair(args)
    device = drafter.device
    loaded = time.perf_counter() - PROCESS_STARTED
    pad = tokenizer.eos_token_id
    prompts = {"humaneval": task_prompts("humaneval", args.num_prompts, skip=args.skip_humaneval),
               "mtbench": task_prompts("mtbench", args.num_prompts, skip=args.skip_mtbench)}
    encoded = {task: [torch.tensor([chat_prompt_ids(tokenizer, p)], device=device) for p in ps]
               for task, ps in prompts.items()}
    common = dict(do_sample=False, pad_token_id=pad, max_new_tokens=args.max_new_tokens)
    methods = {"plain": dict(cache_implementation="static"),
               "dflash2": dict(cache_implementation="static", assistant_model=drafter)}
    results = {"settings": {"command": "python -m dflash2.benchmarks.speed " + " ".join(argv or []),
                            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            "dtype": str(drafter.dtype), "torch": torch.__version__,
                            "max_new_tokens": args.max_new_tokens, "prompts": {k: len(v) for k, v in prompts.items()},
                            "skip": {"humaneval": args.skip_humaneval, "mtbench": args.skip_mtbench},
                            "process_start_to_models_loaded_s": round(loaded, 2)}}

    def runner_kind():
        entries = getattr(drafter, "_round_cores", {})
        return next((entry[1].kind for entry in entries.values() if entry[0].batch == 1), None)

    def call(method, ids, **extra):
        out, seconds = timed(target, ids, device, **{"attention_mask": torch.ones_like(ids), **common,
                                                     **methods[method], **extra})
        stats = drafter.last_stats if method == "dflash2" else None
        return out, seconds, out.shape[1] - ids.shape[1], stats

    # ---- cold start: the first call of each method in this process (prompt 0 of HumanEval)
    first_ids = encoded["humaneval"][0]
    order = [args.first, "plain" if args.first == "dflash2" else "dflash2"]
    cold = {}
    for method in order:
        _, seconds, tokens, _ = call(method, first_ids)
        cold[method] = {"first_call_s": round(seconds, 3), "tokens": tokens,
                        "since_process_start_s": round(time.perf_counter() - PROCESS_STARTED, 2)}
        if method == "dflash2":
            cold[method]["round"] = runner_kind()
    results["cold_start"] = {"order": order, **cold}
    print("cold start:", json.dumps(results["cold_start"]), flush=True)

    # ---- first pass: every prompt once, as a user's first minutes go
    first_pass = []
    for task, items in encoded.items():
        for index, ids in enumerate(items):
            row = {"task": task, "prompt": index + (args.skip_humaneval if task == "humaneval" else args.skip_mtbench)}
            for method in order:
                _, seconds, tokens, _ = call(method, ids)
                row[method] = {"s": round(seconds, 4), "tokens": tokens}
            row["dflash2_round"] = runner_kind()
            first_pass.append(row)
    results["first_pass"] = first_pass
    runner = next(entry[1] for entry in drafter._round_cores.values() if entry[0].batch == 1)
    if args.quick:
        results["fusion"] = {"ready_after_first_pass": runner.kind == "graph (fused)",
                             "fuse_seconds": runner.fuse_seconds}
        return finish(results, args.out)

    # ---- steady state
    waited = time.perf_counter()
    fused = runner.wait_for_fusion()
    results["fusion"] = {"fused": fused, "fuse_seconds": runner.fuse_seconds,
                         "waited_after_first_pass_s": round(time.perf_counter() - waited, 2),
                         "error": repr(runner.fuse_error) if runner.fuse_error else None}
    steady = {}
    for task, items in encoded.items():
        rows = {"plain": [], "dflash2": []}
        taus, forwards, agree = [], 0, 0
        for ids in items:
            plain_out, plain_s, plain_tokens, _ = call("plain", ids)
            out, s, tokens, stats = call("dflash2", ids)
            rows["plain"].append((plain_s, plain_tokens))
            rows["dflash2"].append((s, tokens))
            forwards += stats.target_forwards
            agree += int(torch.equal(out, plain_out))
        entry = {}
        for method, pairs in rows.items():
            entry[method] = summary([p[0] for p in pairs], sum(p[1] for p in pairs))
        entry["dflash2"]["tau"] = round(entry["dflash2"]["tokens"] / forwards, 3)
        entry["speedup"] = round(entry["dflash2"]["tokens_per_s"] / entry["plain"]["tokens_per_s"], 3)
        entry["identical_outputs_bf16"] = f"{agree}/{len(items)}"
        steady[task] = entry
        print(task, json.dumps(entry), flush=True)
    results["steady"] = steady

    # ---- the round's device time against its wall time (batch 1, one prompt, EOS ignored)
    ids = encoded["humaneval"][0]
    _, total, tokens, stats = call("dflash2", ids, eos_token_id=None)
    rounds_full = stats.target_forwards - 1
    _, head, _, stats2 = call("dflash2", ids, eos_token_id=None, max_new_tokens=2)
    rounds_head = stats2.target_forwards - 1
    core = next(entry[0] for entry in drafter._round_cores.values() if entry[0].batch == 1)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    for _ in range(5):
        runner()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    started = time.perf_counter()
    for _ in range(50):
        runner()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    replay = (time.perf_counter() - started) / 50
    wall = (total - head) / max(rounds_full - rounds_head, 1)
    results["round"] = {"kind": runner.kind, "replay_ms": round(replay * 1e3, 3), "wall_ms": round(wall * 1e3, 3),
                        "wall_over_replay": round(wall / replay, 3), "capacity": core.capacity,
                        "tau": round(stats.acceptance_length, 3)}
    print("round:", json.dumps(results["round"]), flush=True)

    # ---- stall check: prompts of distinct lengths, fixed new-token count
    if args.sweep:
        pool = [ids for items in encoded.values() for ids in items]
        pool += [torch.tensor([chat_prompt_ids(tokenizer, p)], device=device)
                 for task in ("humaneval", "mtbench") for p in task_prompts(task, 40, skip=60 if task == "humaneval"
                                                                              else 0)]
        by_length = {}
        for ids in pool:
            by_length.setdefault(ids.shape[1], ids)
        lengths = sorted(by_length)[: args.sweep]
        sweep = {}
        for batch in (1, 8):
            times = {"plain": [], "dflash2": []}
            for i, length in enumerate(lengths):
                rows = [by_length[lengths[(i + j) % len(lengths)]][0].tolist() for j in range(batch)]
                ids, mask = left_pad(rows, pad)
                ids, mask = ids.to(device), mask.to(device)
                for method in ("plain", "dflash2"):
                    _, seconds = timed(target, ids, device, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                       max_new_tokens=args.sweep_tokens, eos_token_id=None, **methods[method])
                    times[method].append(seconds)
            sweep[f"batch{batch}"] = {m: summary(t, len(t) * batch * args.sweep_tokens) for m, t in times.items()}
            sweep[f"batch{batch}"]["distinct_widths"] = len(lengths)
            print(f"sweep batch {batch}:", json.dumps(sweep[f"batch{batch}"]), flush=True)
        results["sweep"] = sweep

    # ---- batches: throughput on MT-Bench + HumanEval prompts, natural ends
    if args.batch_sizes:
        drafter.config.max_speculative_batch_size = max(args.batch_sizes)  # measure beyond the default limit too
        pool = [ids[0].tolist() for items in encoded.values() for ids in items]
        batches = {}
        for batch in args.batch_sizes:
            rows = (pool * ((batch // len(pool)) + 1))[:batch]
            ids, mask = left_pad(rows, pad)
            ids, mask = ids.to(device), mask.to(device)
            entry = {}
            for method in ("plain", "dflash2"):
                kwargs = dict(attention_mask=mask, **common, **methods[method])
                target.generate(ids, **{**kwargs, "max_new_tokens": 16})  # compile / capture for this batch size
                if method == "dflash2":
                    for core, batch_runner in drafter._round_cores.values():
                        if core.batch >= batch:
                            batch_runner.wait_for_fusion()
                out, seconds = timed(target, ids, device, **kwargs)
                tokens = new_tokens(out[:, ids.shape[1]:], pad)
                entry[method] = {"s": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}
                if method == "dflash2":
                    entry[method]["tau"] = round(drafter.last_stats.acceptance_length, 3)
            entry["speedup"] = round(entry["dflash2"]["tokens_per_s"] / entry["plain"]["tokens_per_s"], 3)
            batches[str(batch)] = entry
            print(f"batch {batch}:", json.dumps(entry), flush=True)
        results["batches"] = batches
    return finish(results, args.out)


def finish(results, out):
    text = json.dumps(results, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
