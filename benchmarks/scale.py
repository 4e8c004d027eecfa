"""Real model shapes, random weights: what one round of every DFlash 2 loop costs on the GPU, against plain decoding.

    python -m dflash2.benchmarks.scale --parts 8b --out runs/scale-8b.json          # one GPU
    python -m dflash2.benchmarks.scale --parts 8b-long --out runs/scale-8b-long.json
    python -m dflash2.benchmarks.scale --parts 32b --out runs/scale-32b.json        # two GPUs (layers split)
    python -m dflash2.benchmarks.scale --parts lossless --out runs/scale-lossless.json
    python -m dflash2.benchmarks.scale --smoke --out /tmp/scale.json               # tiny shapes on the CPU

Targets and drafters are built from configs only (no download), with random weights: the Qwen3-8B and Qwen3-32B shapes,
each with a 5-layer DFlash 2 drafter. A random drafter accepts about nothing, so the script reports the cost of one full
round (`per_round_ms`) against one plain decoding step (`per_token_ms`) and projects the speedup a trained drafter would
give at the published tau values. docs/scale.md says what each number is, how it is taken, and what the loops
`assisted`, `graph`, `fused` (one compile, batch 1, first block size), `batched`, `plain-eager`, `plain-static` and
`plain-graph` (eager on a split target) run. On a target split over GPUs the own loops cannot be captured and run their
round eagerly (`kind` says so). `plain-static` runs last in a part: a fused DFlash 2 graph replayed after transformers'
compiled plain decoding in the same process once hit an illegal memory access (docs/benchmarks.md); `--methods` selects
methods for a process of its own.

Parts (one invocation each; `--budget` skips what would overrun, and says so):
- `8b`: every loop at block sizes 8 and 16, batch 1 (and 4, 8 for batched and plain), peak memory per method; the
  fused round compiles for minutes, so it runs only when asked, in an invocation of its own:
  `--parts 8b --methods plain-eager,fused` (its projection is then against plain eager; compare per-round times with
  the other report's plain-static by hand);
- `8b-long`: prompts of 8k and 32k tokens, graph loop and plain eager: prefill time, time per round, peak memory, the
  drafter's context buffers and the target's cache;
- `32b`: the 32B shape over two GPUs (`device_map` via accelerate's `dispatch_model`, layers split in halves);
- `lossless`: fp32 (TF32 off), a smaller Qwen3 shape: every loop's greedy output equals plain greedy on random prompts,
  with the random drafter and with oracle drafts (a random-length prefix of the true continuation, so rounds accept
  0 .. B-1 drafts); also with the target split over two GPUs when there are two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from dflash2.benchmarks.common import wall_timed

PUBLISHED_TAU = (4.0, 5.0, 6.5)
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936),
    "lossless": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=64, intermediate_size=3072, vocab_size=151936),
}
SMOKE_SHAPES = {
    "qwen3-8b": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=512),
    "qwen3-32b": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512),
    "lossless": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=256),
}
PARTS = ("8b", "8b-long", "32b", "lossless")
METHODS = ("plain-eager", "plain-graph", "assisted", "graph", "batched", "fused", "plain-static")
# fused: an invocation of its own
DEFAULT_METHODS = ("plain-eager", "plain-graph", "assisted", "graph", "batched", "plain-static")
COMPILING = {"fused": 240.0, "plain-static": 150.0}  # seconds a method may need beyond its runs (compile)


# ------------------------------------------------------------------------------------------------ models
def target_config(shape: dict, max_positions: int):
    from transformers import Qwen3Config

    return Qwen3Config(**shape, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, use_cache=True)


def build_target(config, device, dtype, seed: int = 0):
    """A random-weight Qwen3 causal LM built directly on `device` (transformers' own initialisation)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def split_layers(config, devices: list) -> dict:
    """Decoder layers in equal consecutive shares over `devices`; embeddings on the first, norm on the last, the LM
    head beside the embeddings when they are tied (accelerate keeps tied weights together)."""
    layers, count = config.num_hidden_layers, len(devices)
    device_map = {f"model.layers.{i}": devices[i * count // layers] for i in range(layers)}
    device_map.update({"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                       "lm_head": devices[0] if getattr(config, "tie_word_embeddings", False) else devices[-1]})
    return device_map


def build_split_target(config, devices: list, dtype, seed: int = 0):
    """The same model with its layers split over `devices`: built on the meta device, each module materialised on its
    device, weights drawn there (norms 1, matrices N(0, initializer_range)), then dispatched by accelerate."""
    from accelerate import dispatch_model
    from transformers import Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with torch.device("meta"):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    device_map = split_layers(config, devices)
    for name, device in device_map.items():
        if name != "model.rotary_emb":
            model.get_submodule(name).to_empty(device=device)
    model.model.rotary_emb = Qwen3RotaryEmbedding(config=config).to(device_map["model.rotary_emb"])
    generator_seed = seed
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            generator = torch.Generator(device=parameter.device).manual_seed(generator_seed)
            generator_seed += 1
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, config.initializer_range, generator=generator)
    left = [name for name, tensor in list(model.named_parameters()) + list(model.named_buffers())
            if tensor.device.type == "meta"]
    if left:
        raise RuntimeError(f"left on the meta device: {left[:4]}")
    model = dispatch_model(model, device_map=device_map)
    model.hf_device_map = dict(device_map)
    return model.eval()


def build_drafter(target, block_size: int, device, dtype, rank: int, seed: int = 1):
    """A 5-layer DFlash 2 drafter for `target` (random weights), attached to it."""
    from dflash2.configuration_dflash2 import DFlash2Config
    from dflash2.generation import DFlash2Drafter

    config = DFlash2Config.for_target(target.config, num_hidden_layers=5, block_size=block_size, selector_rank=rank,
                                      selector_top_k=16, max_speculative_batch_size=64)
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = DFlash2Drafter._from_config(config, dtype=dtype)
    return drafter.eval().attach(target)


def parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def release_drafter(drafter, target) -> None:
    """Detach (which releases the drafter's buffers and graphs): its weights and buffers must not stay alive into the
    next method's peak memory."""
    drafter.detach(target)


def present(devices) -> bool:
    """Every device exists on this machine."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return all(d.type != "cuda" or (d.index or 0) < count for d in devices)


# ------------------------------------------------------------------------------------------------ measuring
def reset_peaks(devices) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


def peak_gb(devices):
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    return round(sum(torch.cuda.max_memory_allocated(d) for d in cuda) / 2 ** 30, 3)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def generate(target, ids, new_tokens: int, devices, **kwargs):
    """One greedy generate call of exactly `new_tokens` tokens (no EOS): output and wall seconds."""
    if kwargs.pop("plain_graph", False):  # the plain CUDA-graph loop (rows of one length: no mask)
        from dflash2.benchmarks.plain_graph import plain_graph_generate

        return wall_timed(lambda: plain_graph_generate(target, ids, new_tokens), *devices)
    return wall_timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                              do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs), *devices)


def own_loop_state(drafter) -> dict:
    """The round core the last own-loop call used: how its round ran and what its buffers hold."""
    runners = drafter.round_runners()
    if not runners:
        return {}
    runner = runners[-1]
    core = runner.core

    def held(cache):
        return sum(t.numel() * t.element_size() for t in cache.keys + cache.values if t is not None)

    return {"kind": runner.kind, "capacity": core.capacity, "draft_context_bytes": held(core.draft_cache)
            + core.features.numel() * core.features.element_size(), "target_cache_bytes": held(core.target_cache)}


def free_memory(drafter=None) -> None:
    """Release the drafter's round cores (when given) and what Python and the CUDA allocator still hold: none of it
    may count in the next method's peak memory."""
    import gc

    if drafter is not None:
        drafter.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_method(method: str, target, drafter, ids, args, devices, extra=None) -> dict:
    """Warm-up call, then two timed calls of `short` and `long` new tokens: per round (speculative) or per token
    (plain) from their difference, prefill from the short call."""
    batch, prompt = ids.shape
    short, long = args.short_tokens, args.new_tokens
    result = {"method": method, "batch": batch, "prompt_tokens": prompt, "new_tokens": long,
              "block_size": drafter.config.block_size if drafter is not None else None}
    kwargs = dict(extra or {})
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    reset_peaks(devices)
    try:
        _, result["first_call_s"] = generate(target, ids, short, devices, **kwargs)
        rounds = []
        times = []
        for count in (short, long):
            _, seconds = generate(target, ids, count, devices, **kwargs)
            times.append(seconds)
            if drafter is None:
                rounds.append(count - 1)  # the first token comes from the prefill
            else:
                stats = drafter.last_stats
                rounds.append(stats.drafting_rounds / stats.rows)
                result["tau"] = round(stats.acceptance_length, 3)
        per_step = (times[1] - times[0]) / max(rounds[1] - rounds[0], 1e-9)
        result["per_round_ms" if drafter is not None else "per_token_ms"] = round(per_step * 1e3, 3)
        result["prefill_s"] = round(max(times[0] - rounds[0] * per_step, 0.0), 4)
        result["seconds"] = [round(t, 4) for t in times]
        result["rounds"] = rounds
        if drafter is not None and method != "assisted":
            result.update(own_loop_state(drafter))
    except Exception as error:  # one failing method must not end the part: it is named in the report
        result["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    result["peak_memory_gb"] = peak_gb(devices)
    if drafter is not None:
        free_memory(drafter)
    if method == "plain-graph":
        from dflash2.benchmarks.plain_graph import forget_plain_graph_loops

        forget_plain_graph_loops(target)
        free_memory()
    return result


class Budget:
    """Seconds left in this invocation; a method that would overrun is skipped and named."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def allows(self, method: str, typical: float) -> bool:
        return time.perf_counter() + typical + COMPILING.get(method, 0.0) < self.deadline


def run_methods(plan, target, args, devices, budget, results, part_label):
    """plan: (method, drafter or None, ids, extra generate kwargs); the selected methods, in order."""
    for method, drafter, ids, extra in plan:
        if method not in args.methods:
            continue
        label = f"{part_label} {method} b{ids.shape[0]}" + (f" B{drafter.config.block_size}" if drafter else "")
        if not budget.allows(method, args.typical_method_s):
            results.append({"method": method, "batch": ids.shape[0], "prompt_tokens": ids.shape[1],
                            "block_size": drafter.config.block_size if drafter else None,
                            "skipped": "time budget (--budget)"})
            print(f"  {label}: skipped (time budget)", flush=True)
            continue
        started = time.perf_counter()
        result = time_method(method, target, drafter, ids, args, devices, extra)
        results.append(result)
        summary = result.get("error") or ", ".join(f"{k} {result[k]}" for k in (
            "per_round_ms", "per_token_ms", "prefill_s", "tau", "peak_memory_gb", "kind") if k in result)
        print(f"  {label}: {summary} ({time.perf_counter() - started:.0f} s)", flush=True)


def speculative_plan(drafters, prompts, args, fused: bool):
    plan = []
    for index, drafter in enumerate(drafters):
        plan += [("assisted", drafter, prompts[1], {}),
                 ("graph", drafter, prompts[1], {"cache_implementation": "static", "compile": False})]
        plan += [("batched", drafter, prompts[b], {"compile": False}) for b in args.batch_sizes]
        if fused and index == 0:
            plan.append(("fused", drafter, prompts[1], {"cache_implementation": "static", "compile": True}))
    return plan


def projections(results: list[dict]) -> list[dict]:
    """tau * plain per-token time / per-round time, against plain eager and plain static of the same batch and
    prompt length, for the published tau values."""
    plain = {(r["method"], r["batch"], r["prompt_tokens"]): r["per_token_ms"] for r in results if "per_token_ms" in r}
    rows = []
    for r in results:
        if "per_round_ms" not in r:
            continue
        for baseline in ("plain-eager", "plain-static", "plain-graph"):
            token_ms = plain.get((baseline, r["batch"], r["prompt_tokens"]))
            if token_ms is None:
                continue
            rows.append({"method": r["method"], "block_size": r["block_size"], "batch": r["batch"],
                         "prompt_tokens": r["prompt_tokens"], "against": baseline,
                         "speedup": {str(tau): round(tau * token_ms / r["per_round_ms"], 3) for tau in PUBLISHED_TAU}})
    return rows


# ------------------------------------------------------------------------------------------------ parts
def part_speed(name: str, args, budget, split: bool) -> dict:
    shape = args.shapes["qwen3-32b" if split else "qwen3-8b"]
    config = target_config(shape, max_positions=40960)
    started = time.perf_counter()
    if split:
        places = args.split_devices
        target = build_split_target(config, places, args.dtype)
        devices = sorted({torch.device(p) for p in places}, key=str)
    else:
        target = build_target(config, args.device, args.dtype)
        devices = [args.device]
    report = {"shape": shape, "dtype": str(args.dtype), "target_bytes": parameter_bytes(target),
              "build_s": round(time.perf_counter() - started, 2), "results": []}
    if split:
        report["device_map"] = {k: str(v) for k, v in list(target.hf_device_map.items())[:3]
                                + list(target.hf_device_map.items())[-3:]}
    first = devices[0]
    prompts = {b: random_prompts(b, args.prompt_tokens, shape["vocab_size"], seed=b).to(first)
               for b in sorted({1, *args.batch_sizes})}
    plain_plan = [("plain-eager", None, prompts[b], {}) for b in prompts]
    plain_plan += [("plain-graph", None, prompts[b], {"plain_graph": True}) for b in prompts]
    run_methods(plain_plan, target, args, devices, budget, report["results"], name)
    drafters = []
    for block in args.block_sizes:
        drafters.append(build_drafter(target, block, first, args.dtype, args.selector_rank))
        report.setdefault("drafter_bytes", {})[str(block)] = parameter_bytes(drafters[-1])
        run_methods(speculative_plan(drafters[-1:], prompts, args, fused=block == args.block_sizes[0]),
                    target, args, devices, budget, report["results"], name)
        release_drafter(drafters[-1], target)
        del drafters[-1]
        free_memory()
    run_methods([("plain-static", None, prompts[b], {"cache_implementation": "static"}) for b in prompts],
                target, args, devices, budget, report["results"], name)
    report["projected"] = projections(report["results"])
    del target
    free_memory()
    return report


def part_long(args, budget) -> dict:
    shape = args.shapes["qwen3-8b"]
    longest = max(args.long_prompts)
    config = target_config(shape, max_positions=max(40960, longest + 4 * args.new_tokens))
    target = build_target(config, args.device, args.dtype)
    devices = [args.device]
    drafter = build_drafter(target, args.long_block_size, args.device, args.dtype, args.selector_rank)
    report = {"shape": shape, "dtype": str(args.dtype), "block_size": args.long_block_size,
              "drafter_bytes": parameter_bytes(drafter), "results": []}
    long_args = argparse.Namespace(**{**vars(args), "short_tokens": args.long_short_tokens,
                                      "new_tokens": args.long_new_tokens})
    for length in args.long_prompts:
        ids = random_prompts(1, length, shape["vocab_size"], seed=length).to(args.device)
        plan = [("graph", drafter, ids, {"cache_implementation": "static", "compile": False}),
                ("plain-eager", None, ids, {})]
        run_methods(plan, target, long_args, devices, budget, report["results"], f"8b-long {length}")
    report["projected"] = projections(report["results"])
    release_drafter(drafter, target)
    return report


@contextlib.contextmanager
def oracle_drafts(references: dict, seed: int = 0):
    """Overwrite a random-length prefix of each round's drafts with the row's true continuation (new tokens of plain
    greedy), in transformers' loop and in the round core, so rounds accept anywhere from 0 to B-1 drafts. The
    overwrite reads the host every round, which no CUDA graph can hold: the own loops run their rounds eagerly
    meanwhile (the random-draft cases check the captured rounds)."""
    from dflash2.generation import loop
    from dflash2.generation.candidate_generator import DFlash2CandidateGenerator
    from dflash2.generation.round_core import RoundCore

    rng = random.Random(seed)
    propose, get_candidates, uses_graphs = RoundCore.propose, DFlash2CandidateGenerator.get_candidates, \
        loop.uses_graphs

    def overwrite(drafts, emitted, reference):
        usable = max(0, min(rng.randint(0, drafts.shape[0]), len(reference) - emitted))
        drafts[:usable] = torch.tensor(reference[emitted: emitted + usable], device=drafts.device)

    def oracle_propose(self, hidden):
        proposal = propose(self, hidden)
        tokens = proposal.tokens.clone()
        for row, emitted in enumerate(self.output_length.tolist()[: len(references["rows"])]):
            overwrite(tokens[row], emitted, references["rows"][row])
        proposal.tokens = tokens
        return proposal

    def oracle_get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafts = candidates[0, input_ids.shape[1]:].clone()
        overwrite(drafts, input_ids.shape[1] - references["prompt_length"], references["rows"][0])
        return torch.cat([input_ids, drafts[None]], dim=1), logits

    RoundCore.propose, DFlash2CandidateGenerator.get_candidates = oracle_propose, oracle_get_candidates
    loop.uses_graphs = lambda target, drafter: False
    try:
        yield
    finally:
        RoundCore.propose, DFlash2CandidateGenerator.get_candidates = propose, get_candidates
        loop.uses_graphs = uses_graphs


def lossless_cases(target, drafter, prompts, args, devices, label: str) -> list[dict]:
    """Every loop's greedy output against plain greedy, token for token, with random and with oracle drafts."""
    cases = []
    plain = [generate(target, p[None], args.lossless_new_tokens, devices)[0][0, p.shape[0]:].tolist()
             for p in prompts]
    loops = [("assisted", {}), ("graph", {"cache_implementation": "static", "compile": False})]
    for drafts in ("random", "oracle"):
        for loop, extra in loops:
            identical = 0
            for prompt, reference in zip(prompts, plain):
                oracle = oracle_drafts({"rows": [reference], "prompt_length": prompt.shape[0]}) if (
                    drafts == "oracle") else contextlib.nullcontext()
                with oracle:
                    out, _ = generate(target, prompt[None], args.lossless_new_tokens, devices, assistant_model=drafter,
                                      **extra)
                identical += int(out[0, prompt.shape[0]:].tolist() == reference)
            cases.append({"target": label, "loop": loop, "drafts": drafts, "identical": identical,
                          "prompts": len(prompts), "accepted_per_position": drafter.last_stats.accepted_per_position})
        # batched: left-padded rows of different lengths, each row against plain greedy of that row alone
        width = max(p.shape[0] for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=prompts[0].device)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - prompt.shape[0]:] = prompt
            mask[row, width - prompt.shape[0]:] = 1
        oracle = oracle_drafts({"rows": plain, "prompt_length": None}) if drafts == "oracle" else \
            contextlib.nullcontext()
        with oracle:
            out = target.generate(ids, attention_mask=mask, max_new_tokens=args.lossless_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, assistant_model=drafter, compile=False)
        identical = sum(int(out[row, width:].tolist() == plain[row]) for row in range(len(prompts)))
        cases.append({"target": label, "loop": "batched", "drafts": drafts, "identical": identical,
                      "prompts": len(prompts), "accepted_per_position": drafter.last_stats.accepted_per_position})
        free_memory(drafter)
    return cases


def part_lossless(args, budget) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = args.shapes["lossless"]
    config = target_config(shape, max_positions=4096)
    report = {"shape": shape, "dtype": "float32", "new_tokens": args.lossless_new_tokens, "cases": []}
    targets = [("one device", lambda: build_target(config, args.device, torch.float32), [args.device])]
    if (len({str(d) for d in args.split_devices}) > 1 and present(args.split_devices)) or args.smoke:
        targets.append(("split", lambda: build_split_target(config, args.split_devices, torch.float32),
                        sorted({torch.device(d) for d in args.split_devices}, key=str)))
    rng = random.Random(0)
    for label, build, devices in targets:
        if not budget.allows("lossless", args.typical_method_s * 2):
            report["cases"].append({"target": label, "skipped": "time budget (--budget)"})
            continue
        target = build()
        with torch.no_grad():  # sharpen the logits: a random target then has no near ties for rounding to flip
            target.lm_head.weight.mul_(8.0)
        drafter = build_drafter(target, args.block_sizes[0], devices[0], torch.float32, args.selector_rank)
        prompts = [random_prompts(1, rng.randint(8, args.lossless_prompt_max), shape["vocab_size"], seed=i)[0].to(
            devices[0]) for i in range(args.lossless_prompts)]
        report["cases"] += lossless_cases(target, drafter, prompts, args, devices, label)
        print(f"  lossless {label}: " + ", ".join(f"{c['loop']}/{c['drafts']} {c['identical']}/{c['prompts']}"
                                                 for c in report["cases"] if c.get("target") == label), flush=True)
        release_drafter(drafter, target)
        del target, drafter
        free_memory()
    checked = [c for c in report["cases"] if "identical" in c]
    report["all_identical"] = bool(checked) and all(c["identical"] == c["prompts"] for c in checked)
    return report


# ------------------------------------------------------------------------------------------------ report
def table(report: dict) -> str:
    lines = [f"{'part':9} {'method':13} {'B':>3} {'batch':>5} {'prompt':>6} {'round ms':>9} {'token ms':>9} "
             f"{'prefill s':>9} {'tau':>5} {'peak GB':>8}  projected speedup vs plain-static; vs plain-graph "
             "(tau 4.0/5.0/6.5)"]
    for part, data in report["parts"].items():
        projected = {}
        for p in data.get("projected", []):
            if p["against"] in ("plain-static", "plain-graph"):
                projected.setdefault((p["method"], p["block_size"], p["batch"], p["prompt_tokens"]), {})[
                    p["against"]] = "/".join(f"{v:.2f}" for v in p["speedup"].values())
        for r in data.get("results", []):
            if "skipped" in r or "error" in r:
                lines.append(f"{part:9} {r['method']:13} {r.get('block_size') or '':>3} {r['batch']:>5} "
                             f"{r['prompt_tokens']:>6}  {r.get('skipped') or r.get('error')}")
                continue
            key = (r["method"], r.get("block_size"), r["batch"], r["prompt_tokens"])
            speedup = "; ".join(f"{k} {v}" for k, v in projected.get(key, {}).items())
            lines.append(f"{part:9} {r['method']:13} {r.get('block_size') or '':>3} {r['batch']:>5} "
                         f"{r['prompt_tokens']:>6} {r.get('per_round_ms', ''):>9} {r.get('per_token_ms', ''):>9} "
                         f"{r.get('prefill_s', ''):>9} {r.get('tau', ''):>5} {str(r.get('peak_memory_gb')):>8}  "
                         f"{speedup}")
        for c in data.get("cases", []):
            lines.append(f"{part:9} {c.get('loop', ''):13} {c.get('target', '')}, {c.get('drafts', '')} drafts: "
                         + (f"{c['identical']}/{c['prompts']} identical" if "identical" in c else c.get("skipped")))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dflash2.benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="8b", help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, of {', '.join(METHODS)} (default: all but fused)")
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a test, not a measurement)")
    parser.add_argument("--device", default=None, help="default: cuda:0 (cpu with --smoke)")
    parser.add_argument("--split-devices", default=None, help="the 32B part's devices, default cuda:0,cuda:1")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--block-sizes", default="8,16")
    parser.add_argument("--batch-sizes", default="4,8", help="for the batched loop and batched plain decoding")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96, help="new tokens of the long timed call")
    parser.add_argument("--short-tokens", type=int, default=24, help="new tokens of the short timed call")
    parser.add_argument("--long-prompts", default="8192,32768")
    parser.add_argument("--long-block-size", type=int, default=8)
    parser.add_argument("--long-new-tokens", type=int, default=40)
    parser.add_argument("--long-short-tokens", type=int, default=8)
    parser.add_argument("--selector-rank", type=int, default=256, help="256 as in the published DFlash 2 configs")
    parser.add_argument("--lossless-prompts", type=int, default=4)
    parser.add_argument("--lossless-prompt-max", type=int, default=200)
    parser.add_argument("--lossless-new-tokens", type=int, default=48)
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for this invocation (default 560)")
    parser.add_argument("--typical-method-s", type=float, default=20.0, help="what a method takes besides compiling")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.parts) - set(PARTS)) + sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown parts/methods {unknown}; parts: {PARTS}, methods: {METHODS}")
    args.block_sizes = [int(b) for b in args.block_sizes.split(",")]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.long_prompts = [int(p) for p in args.long_prompts.split(",")]
    args.shapes = SHAPES
    if args.smoke:
        args.shapes = SMOKE_SHAPES
        args.device = args.device or "cpu"
        args.split_devices = args.split_devices or "cpu,cpu"
        args.dtype = "float32"
        args.prompt_tokens, args.new_tokens, args.short_tokens = 16, 14, 6
        args.long_prompts, args.long_new_tokens, args.long_short_tokens = [40, 72], 10, 4
        args.lossless_prompts, args.lossless_prompt_max, args.lossless_new_tokens = 3, 20, 16
        args.selector_rank = 16
    args.device = torch.device(args.device or "cuda:0")
    args.split_devices = [torch.device(d) for d in (args.split_devices or "cuda:0,cuda:1").split(",")]
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    budget = Budget(args.budget)
    import transformers

    report = {"meta": {"torch": torch.__version__, "transformers": transformers.__version__, "smoke": args.smoke,
                       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                       "argv": list(sys.argv[1:] if argv is None else argv), "published_tau": list(PUBLISHED_TAU)},
              "parts": {}}
    for part in args.parts:
        print(f"== {part}", flush=True)
        started = time.perf_counter()
        try:
            if part in ("8b", "32b"):
                if part == "32b" and not args.smoke and (len({str(d) for d in args.split_devices}) < 2
                                                         or not present(args.split_devices)):
                    raise RuntimeError(f"the 32b part needs two devices; --split-devices {args.split_devices} "
                                       f"(this machine has {torch.cuda.device_count()} GPUs)")
                report["parts"][part] = part_speed(part, args, budget, split=part == "32b")
            elif part == "8b-long":
                report["parts"][part] = part_long(args, budget)
            else:
                report["parts"][part] = part_lossless(args, budget)
        except Exception as error:  # a part that cannot run at all (too few GPUs, out of memory while building)
            report["parts"][part] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            print(f"  {part} failed: {report['parts'][part]['error']}", flush=True)
        report["parts"][part]["seconds"] = round(time.perf_counter() - started, 1)
        free_memory()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(table(report))
    print(f"wrote {args.out}")
    return report


def failed_parts(report: dict) -> list[str]:
    """Parts that ended in an error, or whose lossless cases were not all identical."""
    return [name for name, data in report["parts"].items()
            if "error" in data or data.get("all_identical") is False]


if __name__ == "__main__":
    failed = failed_parts(main())
    if failed:
        raise SystemExit(f"failed parts: {', '.join(failed)} (see the report)")
