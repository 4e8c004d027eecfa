"""`dflash2 bench`: every decoding method on the same prompts, machine and run.

Methods: plain `generate` (eager), plain with a static cache (transformers compiles the forward; optional), the plain
CUDA-graph loop (`plain-graph`, with `static`: no `generate`, the step captured as a CUDA graph, no host read per token,
greedy or sampling at the same settings; benchmarks/plain_graph.py), HF prompt lookup, transformers' built-in
`speculation_type="dflash"` running our drafter as DFlash 1, a DFlash 1 drafter (when given) and DFlash 2 (assisted
loop; with `static`, its own loop too, and on CUDA the same loop with the inductor-fused round). Per task: tau
(completion tokens / target forwards), tokens/s, speedup over plain (and over plain-static and plain-graph when they
ran: `speedup_vs_<method>`), greedy agreement with plain, acceptance by block position, per-prompt median and max
seconds. Per method: its cold start, the wall time of its first call in this process (compile or capture included; the
first task's longest prompt).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash2.benchmarks.common import settle, wall_timed
from dflash2.model_args import sampling_kwargs
from dflash2.tasks import chat_prompt_ids, left_padded, task_prompts


@dataclass
class MethodResult:
    tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    prompts: int = 0
    exact_matches: int = 0
    matched_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafting_rounds: int = 0
    per_prompt_seconds: list[float] = field(default_factory=list)

    def as_dict(self, plain: "MethodResult | None", greedy: bool) -> dict:
        row = {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
            "tau": round(self.tokens / max(self.target_forwards, 1), 3),
            "target_forwards": self.target_forwards,
        }
        if self.per_prompt_seconds:
            row["per_prompt_median_s"] = round(statistics.median(self.per_prompt_seconds), 4)
            row["per_prompt_max_s"] = round(max(self.per_prompt_seconds), 4)
        if plain is not None and plain.seconds and self.seconds:
            row["speedup"] = round((self.tokens / self.seconds) / (plain.tokens / plain.seconds), 3)
        if greedy and plain is not None:
            row["greedy_exact_match"] = round(self.exact_matches / max(self.prompts, 1), 3)
            row["greedy_token_agreement"] = round(self.matched_tokens / max(plain.tokens, 1), 3)
        if self.accepted_per_position:
            rounds = max(self.drafting_rounds, 1)
            row["acceptance_by_position"] = [round(a / rounds, 3) for a in self.accepted_per_position]
        return row


class ForwardCounter:
    """Counts target forwards during a call (a forward hook), whatever decoding method runs them."""

    def __init__(self, model):
        self.model, self.count, self.handle = model, 0, None

    def __enter__(self):
        def hook(*_):
            self.count += 1

        self.handle = self.model.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def timed_generate(target, ids, kwargs, device):
    """One generate call: output, wall seconds (device synchronised), target forwards."""
    with ForwardCounter(target) as counter:
        out, seconds = wall_timed(lambda: target.generate(ids, **kwargs), device)
    return out, seconds, counter.count


def timed_call(name: str, target, ids, kwargs, device):
    """`timed_generate`, or for `plain-graph` one call of the plain CUDA-graph loop (one target forward per new
    token: the prefill's, then one per step)."""
    if name != "plain-graph":
        return timed_generate(target, ids, kwargs, device)
    from dflash2.benchmarks.plain_graph import timed_plain_graph_call

    out, seconds = timed_plain_graph_call(target, ids, kwargs)
    return out, seconds, out.shape[1] - ids.shape[1]


def speedups_against(rows: dict, baselines=("plain-static", "plain-graph")) -> None:
    """Add `speedup_vs_<baseline>` (tokens/s over the baseline's) to every other method's row."""
    for baseline in baselines:
        base = rows.get(baseline, {}).get("tokens_per_s")
        for name, row in rows.items():
            if base and name != baseline and row.get("tokens_per_s"):
                row[f"speedup_vs_{baseline}"] = round(row["tokens_per_s"] / base, 3)


def method_kwargs(name: str, drafters: dict) -> dict:
    if name in ("plain", "plain-graph"):
        return {}
    if name == "plain-static":
        return {"cache_implementation": "static"}
    if name == "prompt-lookup":
        return {"prompt_lookup_num_tokens": drafters["dflash2"].config.block_size - 1}
    if name == "hf-dflash":
        return {"assistant_model": drafters["dflash2"], "speculation_type": "dflash"}
    if name == "dflash2-static":
        return {"assistant_model": drafters["dflash2"], "cache_implementation": "static"}
    if name == "dflash2-fused":
        return {"assistant_model": drafters["dflash2"], "cache_implementation": "static", "compile": True}
    return {"assistant_model": drafters[name]}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_benchmark(target, tokenizer, drafters: dict, tasks=("humaneval", "mtbench"), num_prompts: int = 8,
                  command: str | None = None,
                  max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, static=False,
                  progress: bool = True, seed: int = 0, on_task_done=None) -> dict:
    """drafters: {"dflash2": drafter, optional "dflash1": drafter}, attached to `target`."""
    device = target.get_output_embeddings().weight.device
    greedy = temperature == 0
    sampling = sampling_kwargs(temperature, top_p, top_k)
    methods = ["plain"] + (["plain-static", "plain-graph"] if static else [])
    methods += ["prompt-lookup", "hf-dflash"]
    methods += [name for name in ("dflash1", "dflash2") if name in drafters] + (["dflash2-static"] if static else [])
    methods += ["dflash2-fused"] if static and device.type == "cuda" else []  # inductor on a CPU: minutes, no gain
    results = {"settings": {"command": command, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
                            "temperature": temperature, "top_p": top_p, "top_k": top_k, "batch_size": 1,
                            "device": str(device), "dtype": str(target.dtype),
                            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)
                            if device.type == "cuda" else None},
               "tasks": {}}
    import transformers

    results["settings"]["transformers"] = transformers.__version__
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks) * num_prompts * len(methods), desc="bench", mininterval=2)
    for task in tasks:
        prompts = task_prompts(task, num_prompts)
        encoded = [torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device) for prompt in prompts]
        longest = max(encoded, key=lambda ids: ids.shape[1])
        failed = results.setdefault("failed", {})
        cold = results.setdefault("cold_start", {})
        for name in methods:  # warm-up outside the timed runs: kernels, allocator, and static caches at full size
            if name in failed:
                continue
            try:
                kwargs = dict(attention_mask=torch.ones_like(longest), max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.eos_token_id, **sampling, **method_kwargs(name, drafters))
                _, seconds, _ = timed_call(name, target, longest, kwargs, device)
                if name not in cold:  # the method's first call in this process
                    cold[name] = {"first_call_s": round(seconds, 3), "task": task, "prompt_tokens": longest.shape[1]}
            except Exception as error:  # one broken method must not cost the others' numbers; plain must work
                if name == "plain":
                    raise
                failed[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
                print(f"[bench] {name} failed and is left out: {failed[name]}", flush=True)
        if "dflash2-static" in methods and "dflash2-static" not in failed:
            # its default round is fused in the background: time the loop a user has once the fused round is there
            waited = settle(drafters["dflash2"], lambda: timed_generate(target, longest, dict(
                attention_mask=torch.ones_like(longest), max_new_tokens=8, pad_token_id=tokenizer.eos_token_id,
                **sampling, **method_kwargs("dflash2-static", drafters)), device))
            results.setdefault("waited_for_fused_round_s", {})[task] = waited
            results.setdefault("round_kind", {})[task] = drafters["dflash2"].round_kind(1)
        active = [name for name in methods if name not in failed]
        per_method = {name: MethodResult() for name in active}
        if bar is not None:
            bar.total -= len(prompts) * (len(methods) - len(active))
        for index, ids in enumerate(encoded):
            plain_tokens = None
            for name in active:
                # the mask is explicit: the chat template's end-of-turn token is also the pad token, and some
                # transformers versions (5.17) would mask it out of an unmasked prompt
                kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.eos_token_id, **sampling, **method_kwargs(name, drafters))
                torch.manual_seed(seed + index)
                out, seconds, forwards = timed_call(name, target, ids, kwargs, device)
                new = out[0, ids.shape[1]:].tolist()
                result = per_method[name]
                drafter = kwargs.get("assistant_model")
                stats = drafter.last_stats if drafter is not None and name != "hf-dflash" else None
                result.tokens += len(new)
                result.seconds += seconds
                result.per_prompt_seconds.append(seconds)
                # CUDA-graph replays run no module hooks: our loops count their own forwards
                result.target_forwards += stats.target_forwards if stats is not None else forwards
                result.prompts += 1
                if name == "plain":
                    plain_tokens = new
                if plain_tokens is not None:
                    result.exact_matches += int(new == plain_tokens)
                    result.matched_tokens += common_prefix(new, plain_tokens)
                if stats is not None:
                    if not result.accepted_per_position:
                        result.accepted_per_position = [0] * len(stats.accepted_per_position)
                    result.accepted_per_position = [a + b for a, b in zip(result.accepted_per_position,
                                                                           stats.accepted_per_position)]
                    result.drafting_rounds += stats.drafting_rounds
                if bar is not None:
                    bar.update(1)
        plain = per_method["plain"]
        results["tasks"][task] = {name: r.as_dict(plain, greedy) for name, r in per_method.items()}
        speedups_against(results["tasks"][task])
        if on_task_done is not None:  # partial results survive an interrupted run
            on_task_done(results)
    if bar is not None:
        bar.close()
    return results


def run_batched_benchmark(target, tokenizer, drafter, batch_sizes=(1, 8, 32), task: str = "mtbench",
                          max_new_tokens: int = 128, progress: bool = True) -> dict:
    """Throughput of plain batched `generate` against batched DFlash 2 (greedy, left-padded prompts)."""
    device = target.get_output_embeddings().weight.device
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = task_prompts(task)
    rows = {}
    limit = drafter.config.max_speculative_batch_size
    drafter.config.max_speculative_batch_size = max(batch_sizes)  # measure speculation at every size, then restore
    try:
        for batch in batch_sizes:
            rows[str(batch)] = batched_row(target, tokenizer, drafter, prompts, batch, max_new_tokens, pad, device)
            if progress:
                row = rows[str(batch)]
                print(f"batch {batch}: plain {row['plain']['tokens_per_s']} tok/s, dflash2 "
                      f"{row['dflash2']['tokens_per_s']} tok/s, speedup {row['speedup']}", flush=True)
    finally:
        drafter.config.max_speculative_batch_size = limit
    return {"task": task, "max_new_tokens": max_new_tokens, "batches": rows}


def batched_row(target, tokenizer, drafter, prompts, batch: int, max_new_tokens: int, pad: int, device) -> dict:
    """One batch size: plain batched generate and batched DFlash 2 on the same left-padded prompts."""
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    ids, mask = left_padded([chat_prompt_ids(tokenizer, p) for p in chosen], pad)
    ids, mask = ids.to(device), mask.to(device)
    row = {}
    for name, extra in (("plain", {}), ("dflash2", {"assistant_model": drafter})):
        kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **extra)
        target.generate(ids, **{**kwargs, "max_new_tokens": 8})  # warm-up
        out, seconds, forwards = timed_generate(target, ids, kwargs, device)
        generated = out[:, ids.shape[1]:]
        tokens = int((generated != pad).sum())
        row[name] = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2),
                     "target_forwards": forwards}
    row["dflash2"]["tau_per_row"] = round(row["dflash2"]["tokens"] / batch / max(row["dflash2"]["target_forwards"],
                                                                                 1), 3)
    row["speedup"] = round(row["dflash2"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
    return row


def markdown_table(results: dict) -> str:
    lines = []
    cold = results.get("cold_start", {})
    if cold:
        lines += ["### cold start (first call of each method in this process, compile or capture included)", "",
                  "| method | first call s | prompt tokens |", "| --- | --- | --- |"]
        lines += [f"| {name} | {row['first_call_s']} | {row['prompt_tokens']} |" for name, row in cold.items()]
        lines.append("")
    for task, waited in results.get("waited_for_fused_round_s", {}).items():
        kind = results.get("round_kind", {}).get(task)
        lines += [f"dflash2-static on {task}: rounds run as {kind}"
                  + (f" (waited {waited} s for the round fused in the background)" if waited else ""), ""]
    for task, methods in results.get("tasks", {}).items():
        lines += [f"### {task}", "",
                  "| method | tau | tokens/s | speedup | per-prompt median s | per-prompt max s | greedy exact match "
                  "| greedy token agreement |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, row in methods.items():
            lines.append(f"| {name} | {row['tau']:.2f} | {row['tokens_per_s']} | {row.get('speedup', '')} | "
                         f"{row.get('per_prompt_median_s', '')} | {row.get('per_prompt_max_s', '')} | "
                         f"{row.get('greedy_exact_match', 'n/a')} | {row.get('greedy_token_agreement', 'n/a')} |")
        against = [b for b in ("plain-static", "plain-graph") if any(f"speedup_vs_{b}" in r for r in methods.values())]
        if against:
            lines += ["", "| method | " + " | ".join(f"speedup vs {b}" for b in against) + " |",
                      "| --- |" + " --- |" * len(against)]
            lines += [f"| {name} | " + " | ".join(str(row.get(f"speedup_vs_{b}", "")) for b in against) + " |"
                      for name, row in methods.items()]
        positions = {n: r["acceptance_by_position"] for n, r in methods.items() if "acceptance_by_position" in r}
        if positions:
            lines += ["", "Acceptance rate by block position (share of drafting rounds accepting that draft):", "",
                      "| method | " + " | ".join(str(k + 1) for k in range(len(next(iter(positions.values()))))) + " |",
                      "| --- |" + " --- |" * len(next(iter(positions.values())))]
            for name, rates in positions.items():
                lines.append(f"| {name} | " + " | ".join(f"{r:.2f}" for r in rates) + " |")
        lines.append("")
    if "batched" in results:
        lines += ["### batched (greedy)", "", "| batch | plain tok/s | DFlash 2 tok/s | speedup | τ per row |",
                  "| --- | --- | --- | --- | --- |"]
        for batch, row in results["batched"]["batches"].items():
            lines.append(f"| {batch} | {row['plain']['tokens_per_s']} | {row['dflash2']['tokens_per_s']} | "
                         f"{row['speedup']} | {row['dflash2']['tau_per_row']} |")
        lines.append("")
    for name, error in results.get("failed", {}).items():
        lines.append(f"Left out: {name} failed ({error}).")
    return "\n".join(lines)


def write_reports(results: dict, out_dir) -> list[Path]:
    """results.json, results.md and two PNG plots (speedup per method, acceptance by block position)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    written[0].write_text(json.dumps(results, indent=2) + "\n")
    written[1].write_text(markdown_table(results))
    if "tasks" not in results:
        return written
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    tasks = list(results["tasks"])
    methods = list(next(iter(results["tasks"].values())))
    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(tasks)
    for i, task in enumerate(tasks):
        values = [results["tasks"][task].get(m, {}).get("speedup", 0) or 0 for m in methods]
        axis.bar([x + i * width for x in range(len(methods))], values, width, label=task)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xticks([x + width * (len(tasks) - 1) / 2 for x in range(len(methods))], methods, rotation=15)
    axis.set_ylabel("speedup over plain generate")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "speedup.png", dpi=120)
    written.append(out_dir / "speedup.png")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for task in tasks:
        for name, row in results["tasks"][task].items():
            if "acceptance_by_position" in row:
                rates = row["acceptance_by_position"]
                axis.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} / {task}")
    axis.set_xlabel("draft position in the block")
    axis.set_ylabel("acceptance rate")
    axis.set_ylim(0, 1)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out_dir / "acceptance.png", dpi=120)
    written.append(out_dir / "acceptance.png")
    return written
