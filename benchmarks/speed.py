"""Speed as a user meets it: DFlash 2's own loop against compiled plain decoding (`cache_implementation="static"`).

    python -m dflash2.benchmarks.speed --device cuda --out runs/speed.json            # in a fresh process

Reports, in one process on one machine:
- cold start: the wall time of the first call of `--first` (compile or capture included), then of the other method;
- a first pass over the prompts (what the first minutes look like; `kind` says which round ran each call);
- the steady state: tokens/s, tau, speedup, per-prompt median and max (`--compile`: DFlash 2's inductor-fused round);
- `settings`: a new temperature / top-k / top-p's first call against its second (ms per round; no core, graph or
  compile should be built for it);
- `assisted`: where a round of transformers' assisted loop spends its time.
Batched throughput is measured by `dflash2 bench --batch-sizes`; where a round's time goes, by
`python -m dflash2.benchmarks.round_profile`.
Methods (`--methods`): `dflash2` (the drafter's own settings), `dflash2-path` and `dflash2-tree` (rounds that verify one
path, or a tree of `--tree-nodes` nodes: side by side in one run), `dflash2-card` (the model card's call: one prompt,
default kwargs, no `cache_implementation`), `dflash2-assisted` (transformers' assisted loop, `loop="transformers"`),
`plain` (compiled `generate` with a static cache) and `plain-graph`, the expert baseline: a plain loop with the step
captured as a CUDA graph, no `generate`, no host read per token (`benchmarks/plain_graph.py`; `--plain-graph-compile`:
the step fused by inductor first). Steady-state speedups of every DFlash 2 method are reported against every baseline in
the run, and the tree's tau and tokens/s over the path's.
Greedy by default; `--temperature T` (and `--top-p`, `--top-k`: no top-k cut unless given) samples in every timed call
but the settings section's, `plain-graph` too (its step samples at the same settings). Run it in fresh processes:
`--first dflash2` and `--first plain` against a fresh TORCHINDUCTOR_CACHE_DIR each give that method's own cold start (a
second process finds torch's compile caches warm); compiled `generate` runs in a process of its own (`--methods plain`,
then `--merge`; docs/benchmarks.md says why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROCESS_STARTED = time.perf_counter()

import torch  # noqa: E402

from dflash2.benchmarks.common import finish_report, settle, synchronize, wall_timed, write_report  # noqa: E402


METHODS = ("dflash2", "plain", "plain-graph", "dflash2-card", "dflash2-assisted")  # in the cold start's order


def timed(target, ids, device, **kwargs):
    return wall_timed(lambda: target.generate(ids, **kwargs), device)


def summary(times, tokens):
    return {"seconds_total": round(sum(times), 4), "tokens": tokens, "tokens_per_s": round(tokens / sum(times), 2),
            "per_prompt_median_s": round(statistics.median(times), 4), "per_prompt_max_s": round(max(times), 4),
            "max_over_median": round(max(times) / statistics.median(times), 3)}


def main(argv=None):
    from dflash2.benchmarks.common import command_line
    from dflash2.model_args import add_model_arguments, load_pair, sampling_kwargs
    from dflash2.benchmarks.plain_graph import timed_plain_graph_call
    from dflash2.tasks import chat_prompt_ids, task_categories, task_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=10, help="prompts per task (default 10)")
    parser.add_argument("--skip-humaneval", type=int, default=100, help="HumanEval prompts to leave out first")
    parser.add_argument("--skip-mtbench", type=int, default=40, help="MT-Bench prompts to leave out first")
    parser.add_argument("--skip-math", type=int, default=0, help="math word problems to leave out first")
    parser.add_argument("--tasks", default="humaneval,mtbench", help="comma-separated tasks of dflash2.tasks.TASKS "
                        "(humaneval, mtbench, math); the first one's first prompt is the cold-start call's")
    parser.add_argument("--first", choices=METHODS, default="dflash2", help="method called first")
    fusion = parser.add_mutually_exclusive_group()
    fusion.add_argument("--compile", action="store_const", const=True, help="DFlash 2 with compile=True: the "
                        "inductor-fused round, compiled on the first call, captured as a CUDA graph")
    fusion.add_argument("--background-fusion", action="store_const", const="background", dest="compile",
                        help="DFlash 2 with compile='background' (the default on one CUDA device): unfused at once, "
                             "the round compiled ahead of time in a child process and switched to when ready "
                             "(generation/fused_package.py)")
    fusion.add_argument("--no-fusion", action="store_const", const=False, dest="compile", help="DFlash 2 with "
                        "compile=False: the graph of the eager round's kernels (on a CPU: the eager round)")
    parser.add_argument("--tree-nodes", type=int, default=32, help="nodes of the tree the `dflash2-tree` method "
                        "verifies (default 32)")
    parser.add_argument("--plain-graph-compile", action="store_true",
                        help="plain-graph: compile the step with inductor before capturing it")
    parser.add_argument("--methods", default="dflash2,plain",
                        help="methods to run in this process (one per process keeps transformers' cudagraph-tree "
                             "compile of plain decoding and DFlash 2's captured graphs apart; see docs/benchmarks.md)")
    parser.add_argument("--quick", action="store_true", help="cold starts and the first pass only")
    parser.add_argument("--sections", default="cold,steady,settings",
                        help="comma-separated parts to run (cold = cold start and first pass; settings = a new "
                             "sampling setting's first call against its second; assisted = where a round of "
                             "transformers' assisted loop spends its time)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each part)")
    parser.add_argument("--merge", nargs=2, metavar=("DFLASH2_JSON", "PLAIN_JSON"), default=None,
                        help="load no model: merge the reports of a `--methods dflash2` and a `--methods plain` "
                             "process (same prompts) into speedups and output agreement, written to --out")
    parser.set_defaults(max_new_tokens=256)
    args = parser.parse_args(argv)
    skips = {"humaneval": args.skip_humaneval, "mtbench": args.skip_mtbench, "math": args.skip_math}
    tasks = args.tasks.split(",")
    if not tasks or any(task not in skips for task in tasks):
        parser.error(f"--tasks takes names from {', '.join(skips)}; got {args.tasks}")
    if args.merge:
        return finish_report(merge(*(json.loads(Path(f).read_text()) for f in args.merge)), args.out)

    target, tokenizer, drafter = load_pair(args)
    device = drafter.device
    loaded = time.perf_counter() - PROCESS_STARTED
    pad = tokenizer.eos_token_id
    prompts = {task: task_prompts(task, args.num_prompts, skip=skips[task]) for task in tasks}
    encoded = {task: [torch.tensor([chat_prompt_ids(tokenizer, p)], device=device) for p in ps]
               for task, ps in prompts.items()}
    categories = {task: task_categories(task, args.num_prompts, skip=skips[task]) for task in tasks}
    # --temperature / --top-p: every timed call samples so, but the settings section's (it brings its own settings)
    sampling = sampling_kwargs(args.temperature, args.top_p, args.top_k)
    common = dict(pad_token_id=pad, max_new_tokens=args.max_new_tokens)
    methods = {"plain": dict(cache_implementation="static"),
               "dflash2": dict(cache_implementation="static", assistant_model=drafter,
                               **({} if args.compile is None else {"compile": args.compile}))}
    methods["dflash2-path"] = dict(methods["dflash2"], tree_nodes=0)
    methods["dflash2-tree"] = dict(methods["dflash2"], tree_nodes=args.tree_nodes)
    # the model card's call: one prompt, default kwargs (no cache_implementation); and transformers' assisted loop
    methods["dflash2-card"] = {k: v for k, v in methods["dflash2"].items() if k != "cache_implementation"}
    methods["dflash2-assisted"] = dict(assistant_model=drafter, loop="transformers")
    results = {"settings": {"command": command_line("dflash2.benchmarks.speed", argv),
                            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            "dtype": str(drafter.dtype), "torch": torch.__version__,
                            "max_new_tokens": args.max_new_tokens, "sampling": sampling,
                            "prompts": {k: len(v) for k, v in prompts.items()},
                            "skip": {task: skips[task] for task in tasks},
                            "process_start_to_models_loaded_s": round(loaded, 2)}}

    def call(method, ids, **extra):
        own = {} if "do_sample" in extra else sampling  # a call that names its own sampling setting keeps it whole
        if method == "plain-graph":
            out, seconds = timed_plain_graph_call(target, ids, {**common, **own, **extra}, args.plain_graph_compile)
            return out, seconds, out.shape[1] - ids.shape[1], None
        out, seconds = timed(target, ids, device, **{"attention_mask": torch.ones_like(ids), **common, **own,
                                                     **methods[method], **extra})
        stats = drafter.last_stats if is_dflash2(method) else None
        return out, seconds, out.shape[1] - ids.shape[1], stats

    # ---- cold start and first pass, one method after the other: the first call of each in this process (prompt 0
    # of HumanEval), then every prompt once, as a user's first minutes go.
    sections = set(args.sections.split(","))
    selected = args.methods.split(",")
    order = [m for m in dict.fromkeys([args.first, *METHODS]) if m in selected]
    cold, first_pass = {}, []
    for method in order if "cold" in sections else []:
        _, seconds, tokens, _ = call(method, encoded[tasks[0]][0])
        cold[method] = {"first_call_s": round(seconds, 3), "tokens": tokens,
                        "since_process_start_s": round(time.perf_counter() - PROCESS_STARTED, 2)}
        if method in ("dflash2", "dflash2-card"):
            cold[method]["round"] = drafter.round_kind(1)
        for task, items in encoded.items():
            for index, ids in enumerate(items):
                _, seconds, tokens, _ = call(method, ids)
                first_pass.append({"method": method, "task": task, "s": round(seconds, 4), "tokens": tokens,
                                   "prompt": index + skips[task],
                                   "round": drafter.round_kind(1) if method in ("dflash2", "dflash2-card") else None})
    results["cold_start"] = {"order": order, **cold}
    results["first_pass"] = first_pass
    results["first_pass_tokens_per_s"] = first_pass_rates(first_pass)
    print("cold start:", json.dumps(results["cold_start"]), flush=True)
    write_report(results, args.out)
    if "dflash2" in selected:
        call("dflash2", encoded[tasks[0]][0], max_new_tokens=8)  # (builds the batch-1 core when cold was skipped)
        results["round_kind"] = drafter.round_runners(batch=1)[-1].kind
    if args.quick:
        return finish_report(results, args.out)

    # ---- steady state: every selected method on every prompt (DFlash 2 first on each), after a warm-up call of each
    # method for every shape the prompts need, so that no timed call builds, captures or fuses anything
    steady = {}
    if "steady" in sections:
        results["steady_warm_up_calls"] = warm_up(call, encoded, selected, drafter.config.block_size,
                                                  args.max_new_tokens)
        if any(is_dflash2(method) for method in selected):  # a fused round built meanwhile: warm up again to switch
            settle(drafter, lambda: warm_up(call, encoded, selected, drafter.config.block_size, args.max_new_tokens))
            results["steady_round_kind"] = drafter.round_kind(1)  # (`round_kind` above: the first call's)
    for task, items in encoded.items() if "steady" in sections else []:
        rows = {method: [] for method in selected}  # (seconds, tokens, new token ids, target forwards) per prompt
        agree = 0
        for ids in items:
            outs = {}
            for method in selected:
                outs[method], s, tokens, stats = call(method, ids)
                rows[method].append((s, tokens, outs[method][0, ids.shape[1]:].tolist(),
                                     stats.target_forwards if stats is not None else None))
            agree += int("dflash2" in outs and "plain" in outs and torch.equal(outs["dflash2"], outs["plain"]))
        entry = {method: {**summary([r[0] for r in runs], sum(r[1] for r in runs)), "outputs": [r[2] for r in runs],
                          "per_prompt": [{"s": round(r[0], 4), "tokens": r[1], "target_forwards": r[3]}
                                         for r in runs]}
                 for method, runs in rows.items()}
        for method, runs in rows.items():
            if is_dflash2(method):
                entry[method]["tau"] = round(sum(r[1] for r in runs) / sum(r[3] for r in runs), 3)
        if "dflash2" in entry and "plain" in entry:
            entry["speedup"] = round(entry["dflash2"]["tokens_per_s"] / entry["plain"]["tokens_per_s"], 3)
            if not sampling["do_sample"]:  # sampled outputs differ between methods by design
                entry["identical_outputs_bf16"] = f"{agree}/{len(items)}"
        entry.update(against_plain_graph(entry, compare_outputs=not sampling["do_sample"]))
        entry.update(tree_over_path(entry))
        for method in ("dflash2-card", "dflash2-assisted"):
            if method in entry and "dflash2" in entry:
                entry[f"{method}_over_own_loop"] = round(entry[method]["tokens_per_s"] / entry["dflash2"]["tokens_per_s"],
                                                         3)
        entry["by_category"] = by_category(entry, categories[task])
        steady[task] = entry
        shown = {m: {k: v for k, v in e.items() if k not in ("outputs", "per_prompt")} if isinstance(e, dict) else e
                 for m, e in entry.items()}
        print(task, json.dumps(shown), flush=True)
    results["steady"] = steady
    write_report(results, args.out)

    if "assisted" in sections:
        results["assisted_round_split"] = assisted_round_split(call, encoded, target, device)
        print("assisted loop, per round:", json.dumps(results["assisted_round_split"]), flush=True)
        write_report(results, args.out)
    if "settings" in sections and "dflash2" in selected:
        results["settings_change"] = settings_change(call, encoded, drafter)
        write_report(results, args.out)
    return finish_report(results, args.out)


def first_pass_rates(first_pass: list[dict]) -> dict:
    """Tokens/s of each method over its first pass (every prompt once, right after its cold start)."""
    rates = {}
    for method in dict.fromkeys(row["method"] for row in first_pass):
        rows = [row for row in first_pass if row["method"] == method]
        rates[method] = round(sum(r["tokens"] for r in rows) / sum(r["s"] for r in rows), 2)
    if "dflash2-card" in rates and "dflash2" in rates:
        rates["dflash2-card_over_own_loop"] = round(rates["dflash2-card"] / rates["dflash2"], 3)
    return rates


def assisted_round_split(call, encoded, target, device) -> dict:
    """Where a round of transformers' assisted loop (`loop="transformers"`) spends its time, per round in ms: drafting
    (our candidate generator's `get_candidates`), the target's verification forward, and the rest of transformers'
    loop (acceptance, cache crop, stopping criteria, host reads). Every prompt once, after a short call of the same
    shape; each part is timed between device synchronisations, which adds a little to the whole."""
    from dflash2.generation import DFlash2CandidateGenerator

    spent, started, forwards = {"draft": 0.0, "verify": 0.0, "prefill": 0.0}, [0.0], [0]

    def begin(*_):
        synchronize(device)
        started[0] = time.perf_counter()

    def end(part):
        synchronize(device)
        spent[part] += time.perf_counter() - started[0]

    def timed_draft(*args, **kwargs):
        begin()
        out = get_candidates(*args, **kwargs)
        end("draft")
        return out

    def forward_done(*_):
        end("verify" if forwards[0] else "prefill")
        forwards[0] += 1

    get_candidates, total, rounds, calls = DFlash2CandidateGenerator.get_candidates, 0.0, 0, 0
    hooks = [target.register_forward_pre_hook(begin), target.register_forward_hook(forward_done)]
    DFlash2CandidateGenerator.get_candidates = timed_draft
    try:
        for ids in [ids for items in encoded.values() for ids in items]:
            before = dict(spent)
            call("dflash2-assisted", ids, max_new_tokens=2)  # untimed: this prompt's shapes once
            spent.update(before)
            forwards[0] = 0
            _, seconds, _, stats = call("dflash2-assisted", ids)
            total, rounds, calls = total + seconds, rounds + stats.drafting_rounds, calls + 1
    finally:
        DFlash2CandidateGenerator.get_candidates = get_candidates
        for hook in hooks:
            hook.remove()
    rounds = max(rounds, 1)
    rest = total - spent["draft"] - spent["verify"] - spent["prefill"]
    return {"calls": calls, "rounds": rounds, "round_ms": round(1000 * (total - spent["prefill"]) / rounds, 3),
            "draft_ms": round(1000 * spent["draft"] / rounds, 3), "verify_ms": round(1000 * spent["verify"] / rounds, 3),
            "rest_ms": round(1000 * rest / rounds, 3), "draft_step": stats.draft_step if calls else None,
            "prefill_ms_per_call": round(1000 * spent["prefill"] / max(calls, 1), 3)}


def is_dflash2(method: str) -> bool:
    return method.startswith("dflash2")


def by_category(entry: dict, categories: list[str]) -> dict:
    """Per prompt category: each method's tokens/s, each DFlash 2 method's tau (`tau` for `dflash2`, `tau_<method>`
    for the others) and its speedup over every baseline, and the tree's tau and tokens/s over the path's."""
    methods = [m for m in entry if isinstance(entry[m], dict) and "per_prompt" in entry[m]]
    table = {}
    for category in dict.fromkeys(categories):
        picked = [i for i, c in enumerate(categories) if c == category]
        row = {"prompts": len(picked)}
        for method in methods:
            runs = [entry[method]["per_prompt"][i] for i in picked]
            row[method] = round(sum(r["tokens"] for r in runs) / sum(r["s"] for r in runs), 2)
            if is_dflash2(method):
                tau = round(sum(r["tokens"] for r in runs) / sum(r["target_forwards"] for r in runs), 3)
                row["tau" if method == "dflash2" else f"tau_{method}"] = tau
        for ours in filter(is_dflash2, methods):
            for method in methods:
                if not is_dflash2(method):
                    name = "speedup" if ours == "dflash2" else f"{ours}_speedup"
                    row[f"{name}_vs_{method}"] = round(row[ours] / row[method], 3)
        if "dflash2-tree" in row and "dflash2-path" in row:
            row["tree_over_path_tau"] = round(row["tau_dflash2-tree"] / row["tau_dflash2-path"], 3)
            row["tree_over_path_tokens_per_s"] = round(row["dflash2-tree"] / row["dflash2-path"], 3)
        table[category] = row
    return table


def tree_over_path(entry: dict) -> dict:
    """The tree's tau and tokens/s over the path's, same prompts, same run."""
    if "dflash2-tree" not in entry or "dflash2-path" not in entry:
        return {}
    tree, path = entry["dflash2-tree"], entry["dflash2-path"]
    return {"tree_over_path_tau": round(tree["tau"] / path["tau"], 3),
            "tree_over_path_tokens_per_s": round(tree["tokens_per_s"] / path["tokens_per_s"], 3)}


def against_plain_graph(entry: dict, compare_outputs: bool = True) -> dict:
    """Speedups over the plain CUDA-graph loop, and (`compare_outputs`: greedy runs) its agreement with compiled plain
    generate (same prompts)."""
    if "plain-graph" not in entry:
        return {}
    graph = entry["plain-graph"]
    extra = {}
    for ours in filter(is_dflash2, entry):
        name = "speedup_vs_plain_graph" if ours == "dflash2" else f"{ours}_speedup_vs_plain_graph"
        extra[name] = round(entry[ours]["tokens_per_s"] / graph["tokens_per_s"], 3)
    if "plain" in entry:
        extra["plain_graph_vs_plain"] = round(graph["tokens_per_s"] / entry["plain"]["tokens_per_s"], 3)
    if "plain" in entry and compare_outputs:
        same = sum(a == b for a, b in zip(graph.get("outputs", []), entry["plain"].get("outputs", [])))
        extra["plain_graph_identical_to_plain_bf16"] = f"{same}/{len(graph.get('outputs', []))}"
    return extra


def warm_up(call, encoded, methods, block_size: int, max_new_tokens: int) -> int:
    """One call of every method per distinct shape among the prompts: DFlash 2's prefill bucket (which, with the new
    tokens, sets the capacity of the buffers it runs in) and the plain loops' cache capacity. Returns the calls per
    method."""
    from dflash2.benchmarks.plain_graph import capacity_for
    from dflash2.generation.round_core import prefill_width

    shapes = {}
    for items in encoded.values():
        for ids in items:
            length = ids.shape[1]
            shapes.setdefault((prefill_width(length, block_size, bucketed=True),
                               capacity_for(length, max_new_tokens)), ids)
    for ids in shapes.values():
        for method in methods:
            call(method, ids)
    return len(shapes)


SAMPLING_SETTINGS = ({"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
                     {"do_sample": True, "temperature": 1.0, "top_k": 50}, {"do_sample": True, "temperature": 0.3})


def settings_change(call, encoded, drafter) -> dict:
    """Each of SAMPLING_SETTINGS in turn on one prompt (EOS ignored, so every call decodes `max_new_tokens`): the first
    call with a setting this process has not run before, then a second call with it, both seeded alike (so both decode
    the same tokens in as many rounds). Milliseconds per round of each, the first over the second, and the batch-1
    round runners (their kind and count) before and after: a setting that built a core, captured a graph or compiled
    would show as a first call slower than the second and a runner more."""
    ids = next(iter(encoded.values()))[-1]  # the first task's last prompt
    before = [r.kind for r in drafter.round_runners(batch=1)]
    rows = []
    for setting in SAMPLING_SETTINGS:
        row = {"setting": setting}
        for name in ("first", "second"):
            torch.manual_seed(0)  # both calls draw the same noise: the same tokens, the same rounds
            _, seconds, tokens, stats = call("dflash2", ids, eos_token_id=None, **setting)
            row[f"{name}_ms_per_round"] = round(seconds * 1e3 / stats.target_forwards, 3)
            row[f"{name}_tau"] = round(stats.acceptance_length, 3)
        row["first_over_second"] = round(row["first_ms_per_round"] / row["second_ms_per_round"], 3)
        rows.append(row)
        print("settings:", json.dumps(row), flush=True)
    after = [r.kind for r in drafter.round_runners(batch=1)]
    return {"prompt_tokens": ids.shape[1], "runners_before": before, "runners_after": after, "calls": rows}


def merge(ours: dict, plain: dict) -> dict:
    """One report from a `--methods dflash2` (or `dflash2,plain-graph`) process and a `--methods plain` process over
    the same prompts."""
    def strip(entry):
        return {k: v for k, v in entry.items() if k != "outputs"}

    merged = {"settings": {"dflash2": ours["settings"], "plain": plain["settings"]},
              "cold_start": {**ours.get("cold_start", {}), **{k: v for k, v in plain.get("cold_start", {}).items()
                                                              if k != "order"}},
              "round_kind": ours.get("round_kind"), "steady_round_kind": ours.get("steady_round_kind"),
              "steady": {}}
    greedy = not any(report["settings"].get("sampling", {}).get("do_sample") for report in (ours, plain))
    for task, entry in ours.get("steady", {}).items():
        if task not in plain.get("steady", {}):
            continue
        a, b = entry["dflash2"], plain["steady"][task]["plain"]
        merged["steady"][task] = {"dflash2": strip(a), "plain": strip(b),
                                  "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 3)}
        if greedy:  # sampled outputs differ between methods by design
            same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
            merged["steady"][task]["identical_outputs_bf16"] = f"{same}/{len(a['outputs'])}"
        if "plain-graph" in entry:  # run in the DFlash 2 process (`--methods dflash2,plain-graph`)
            merged["steady"][task]["plain-graph"] = strip(entry["plain-graph"])
            merged["steady"][task].update(against_plain_graph({"dflash2": a, "plain": b,
                                                               "plain-graph": entry["plain-graph"]}, greedy))
    return merged


if __name__ == "__main__":
    main()
