"""Where one DFlash 2 round's time goes: the round and each of its parts, timed on their own.

    python -m dflash2.benchmarks.round_profile --shape smollm2-135m --out runs/round-135m.json     # one GPU
    python -m dflash2.benchmarks.round_profile --shape qwen3-8b --out runs/round-8b.json
    python -m dflash2.benchmarks.round_profile --shape qwen3-8b --compile --out runs/round-8b-fused.json
    python -m dflash2.benchmarks.round_profile --smoke --out /tmp/round.json                      # CPU, tiny shapes

Random weights (timing does not depend on them): `smollm2-135m` is a Llama of SmolLM2-135M-Instruct's shape (the
default target) with a drafter of the shipped drafter's config; `qwen3-8b` is the scale benchmark's Qwen3-8B shape
with its 5-layer drafter (`benchmarks/scale.py`: selector rank 256, top-k 16). Batch 1, block 16 by default, greedy,
a prompt of `--context` random tokens, buffers of the capacity DFlash 2's own loop gives such a request.

A `RoundCore` is built and prefilled; one eager round fills the inputs of every part, then each part -- the same
functions `RoundCore.round` calls, in its order -- is captured as a CUDA graph of its own (with `--compile`: compiled
by inductor first, like `compile=True`'s round) and replayed back to back, timed by CUDA events:

- `round`: the whole round (`RoundCore.round`);
- `drafter forward`: `RoundCore.draft_block` (the drafter over [anchor, MASK ...], the last block's features stored);
- `LM head + top-k`: the target's LM head over the draft rows (`unary_logits`) and the selector's top-k;
- `pair scores`: the selector's low-rank pair scores of every row's candidates;
- `selector walk`: the sequential walk through the rows (`walk_path`) and the proposal logits;
- `verify forward`: `RoundCore.verify`, the target over the block at the round's columns (fp32 logits, taps);
- `greedy accept`: the accepted length and the next token (`greedy_accept`);
- `bookkeeping`: `RoundCore.accept` (tokens into the output stream, state advanced);
with `--tree-nodes N` (a round that verifies a tree of N nodes, `RoundCore.tree_round`), the parts are `drafter
forward`, `candidate scores` (LM head, top-k, pair scores), `draft tree` (the beam and the kept nodes), `tree masks`
(part of `verify tree`), `verify tree`, `accept tree`, `keep path` (the accepted path's keys moved to its depths'
columns) and `bookkeeping`;
and, for the round-vs-verify ratio, the target's plain one-token step and 16-token forward in transformers' static
cache (`plain_graph.forward_fn`, captured the same way, and with `--compile` fused the same way too). The rows are
asked for few new tokens, so they finish within the first replays and freeze: a frozen round runs the same kernels,
and no replay writes past the buffers.
On a CPU the parts run as plain calls (a smoke test of the code, not a measurement).
"""

from __future__ import annotations

import argparse

import torch

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True)
SMOKE_LLAMA = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True)
SHAPES = ("smollm2-135m", "qwen3-8b")


# ------------------------------------------------------------------------------------------------ models
def build_pair(shape: str, device, dtype, block_size: int, smoke: bool):
    """(target, drafter) of random weights at `shape`, the drafter attached."""
    from dflash2.benchmarks import scale

    if shape == "qwen3-8b":
        sizes = scale.SMOKE_SHAPES if smoke else scale.SHAPES
        target = scale.build_target(scale.target_config(sizes["qwen3-8b"], max_positions=40960), device, dtype)
        return target, scale.build_drafter(target, block_size, device, dtype, rank=16 if smoke else 256)
    return smollm2_pair(device, dtype, block_size, smoke)


def smollm2_pair(device, dtype, block_size: int, smoke: bool):
    """A Llama of SmolLM2-135M's shape and a drafter of the shipped drafter's config (layers, taps, selector)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash2.model_args import DEFAULT_DRAFTER
    from dflash2.configuration_dflash2 import DFlash2Config
    from dflash2.generation import DFlash2Drafter

    sizes = dict(SMOKE_LLAMA if smoke else SMOLLM2_135M)
    theta = sizes.pop("rope_theta")
    config = LlamaConfig(**sizes, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    shipped = DFlash2Config.from_pretrained(DEFAULT_DRAFTER)
    layers = config.num_hidden_layers
    taps = sorted({min(i, layers - 1) for i in shipped.target_layer_ids}) if smoke else shipped.target_layer_ids
    drafter_config = DFlash2Config.for_target(
        config, num_hidden_layers=shipped.num_hidden_layers, block_size=block_size, target_layer_ids=taps,
        selector_rank=shipped.selector_rank, selector_top_k=shipped.selector_top_k,
        conv_group_size=shipped.conv_group_size, intermediate_size=128 if smoke else shipped.intermediate_size,
        mask_token_id=config.vocab_size - 1)
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlash2Drafter._from_config(drafter_config, dtype=dtype)
    return target, drafter.eval().attach(target)


# ------------------------------------------------------------------------------------------------ the parts
def round_parts(core) -> dict:
    """Name -> a function of no arguments running that part of `core.round` on fixed inputs (filled by one eager
    round's pieces here), in the order the round runs them. Every function reads and writes fixed buffers only."""
    from dflash2.generation.sampling import greedy_accept
    from dflash2.modeling_dflash2 import scatter_scores, walk_path

    drafter = core.drafter
    selector = drafter.candidate_selector
    with torch.no_grad():
        hidden = core.draft_block().clone()
        rows = hidden[:, 1:]
        top_scores, candidates = drafter.unary_logits(rows).float().topk(selector.top_k, dim=-1)
        pairs = selector(rows, top_scores, candidates, core.anchor)
        tokens, _ = walk_path(pairs, candidates)
        block = torch.cat([core.anchor.view(-1, 1), tokens], dim=1)
        logits, features = core.verify(block)
        accepted, next_token = greedy_accept(tokens, logits)
    vocab = drafter.config.vocab_size

    # each part returns what it computes: a compiled part whose results went nowhere would be optimised away
    def lm_head_topk():
        return drafter.unary_logits(rows).float().topk(selector.top_k, dim=-1)

    def pair_scores():
        return selector(rows, top_scores, candidates, core.anchor)

    def selector_walk():
        chosen, row_scores = walk_path(pairs, candidates)
        return chosen, scatter_scores(row_scores, candidates, vocab)

    return {"round": core.round,
            "drafter forward": core.draft_block,
            "LM head + top-k": lm_head_topk,
            "pair scores": pair_scores,
            "selector walk": selector_walk,
            "verify forward": lambda: core.verify(block),
            "greedy accept": lambda: greedy_accept(tokens, logits),
            "bookkeeping": lambda: core.accept(block, accepted, next_token, features)}


def tree_round_parts(core) -> dict:
    """`round_parts` for a core that verifies a tree (`tree_nodes` > 0): the parts of `RoundCore.tree_round`."""
    from dflash2.generation.tree import accept_tree, draft_tree

    drafter = core.drafter
    with torch.no_grad():
        hidden = core.draft_block().clone()
        candidates, pairs = drafter.candidate_scores(core.anchor, hidden)
        tree = draft_tree(core.anchor, candidates, pairs, core.tree_nodes, core.tree_width)
        logits, features = core.verify_tree(tree)
        target_tokens = logits.argmax(-1)
        accepted, next_token, path = accept_tree(tree, target_tokens, core.block_size)
        path_features = features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        block = tree.tokens.gather(1, path)
    return {"round": core.round,
            "drafter forward": core.draft_block,
            "candidate scores": lambda: drafter.candidate_scores(core.anchor, hidden),
            "draft tree": lambda: draft_tree(core.anchor, candidates, pairs, core.tree_nodes, core.tree_width),
            "tree masks": lambda: core.tree_masks(tree),
            "verify tree": lambda: core.verify_tree(tree),
            "accept tree": lambda: accept_tree(tree, target_tokens, core.block_size),
            "keep path": lambda: core.keep_path(path),
            "bookkeeping": lambda: core.accept(block, accepted, next_token, path_features)}


def runnable(fn, compile: bool, capture: bool):
    """`fn` without gradients, compiled by inductor when asked, captured as a CUDA graph when `capture`."""
    from dflash2.generation.graphs import CapturedGraph

    step = torch.compile(fn, mode="default", dynamic=False) if compile else fn  # each part its own code object

    def part():
        with torch.no_grad():
            step()

    return CapturedGraph(part) if capture else part


# the target's own forwards timed beside the round, by key: (new tokens, name, cache columns: None for the plain
# loop's, "round" for the round's capacity)
FORWARDS = {"step": (1, "target step (1 token)", None), "forward16": (16, "target forward (16 tokens)", None),
            "forward16-capacity": (16, "target forward (16 tokens, round's capacity)", "round")}


def kernel_table(fn, calls: int = 20, top: int = 40) -> dict:
    """The device kernels one call of `fn` launches (run uncaptured, `calls` times under torch.profiler): kernels per
    call, device microseconds per call, and the `top` kernels by device time (name, launches and microseconds per
    call). Comparing two functions' tables shows which kernels one adds to the other."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        micros = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if micros and event.count:
            rows.append({"kernel": event.key[:120], "per_call": round(event.count / calls, 2),
                         "us_per_call": round(micros / calls, 2)})
    rows.sort(key=lambda r: -r["us_per_call"])
    return {"kernels_per_call": round(sum(r["per_call"] for r in rows), 1),
            "us_per_call": round(sum(r["us_per_call"] for r in rows), 1), "top": rows[:top]}


def profile(target, drafter, context: int, compile: bool, replays: int, capacity: int | None = None,
            parts: tuple[str, ...] | None = None, kernels: bool = False,
            forwards: tuple[str, ...] | None = None, tree_nodes: int = 0) -> dict:
    """Milliseconds of the round, each of its parts and the target's plain step and 16-token forward (in the plain
    loop's cache, and in a static cache of the round's capacity). `capacity`: the round's buffer columns (default:
    what DFlash 2's own loop gives the request). `parts`: only these of the round's parts (default: all). `kernels`:
    each part's and the 16-token forward's kernel table (`kernel_table`, uncaptured) too. `forwards`: only these of
    the target's forwards (FORWARDS keys; default: all). `tree_nodes`: a round that verifies a tree of that many nodes
    (`tree_round_parts`; 0: the path round)."""
    from dflash2.benchmarks.plain_graph import device_ms, forward_fn
    from dflash2.generation.graphs import CapturedGraph
    from dflash2.generation.loop import capacity_for, uses_graphs
    from dflash2.generation.round_core import RoundCore, prefill_width

    capture = uses_graphs(target, drafter)
    device, block = drafter.device, drafter.config.block_size
    max_new_tokens = 2 * block  # the rows finish within the first replays, then freeze (same kernels, no overrun)
    width = prefill_width(context, block, bucketed=capture)
    capacity = capacity or capacity_for(width + max_new_tokens + block, capture)
    core = RoundCore(target, drafter, 1, capacity, bucketed_prefill=capture,  # greedy, no EOS: its initial settings
                     tree_nodes=tree_nodes)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    core.prefill(ids, torch.ones_like(ids), max_new_tokens)
    every_part = (tree_round_parts if tree_nodes else round_parts)(core)  # (one eager round fills their inputs)
    parts = {name: fn for name, fn in every_part.items() if parts is None or name in parts}
    result = {"capacity": capacity, "block_size": block, "tree_nodes": tree_nodes, "context": context, "captured": capture,
              "compiled": compile, "ms": {}}
    for name, fn in parts.items():
        result["ms"][name] = round(device_ms(runnable(fn, compile, capture), device, replays), 4)
        print(f"  {name:18} {result['ms'][name]:8.3f} ms", flush=True)
    if len(parts) == len(every_part):
        result["ms"]["sum of parts"] = round(sum(v for k, v in result["ms"].items() if k != "round"), 4)
    kernel_tables = {name: kernel_table(runnable(fn, compile, capture=False)) for name, fn in parts.items()} \
        if kernels else {}
    with torch.no_grad():
        for key, (tokens, name, columns) in FORWARDS.items():
            if forwards is not None and key not in forwards:
                continue
            forward = forward_fn(target, tokens, context, capacity if columns == "round" else None, compile)
            result["ms"][name] = round(device_ms(CapturedGraph(forward) if capture else forward, device, replays), 4)
            print(f"  {name:18} {result['ms'][name]:8.3f} ms", flush=True)
            if kernels and tokens == 16:
                kernel_tables[name] = kernel_table(forward)  # the same compiled forward, uncaptured
    if kernels:
        result["kernels"] = kernel_tables
    ms = result["ms"]
    for ratio, forward in (("round_over_verify16", "target forward (16 tokens)"),
                           ("round_over_verify16_round_capacity", "target forward (16 tokens, round's capacity)"),
                           ("round_over_step", "target step (1 token)")):
        if "round" in ms and forward in ms:
            result[ratio] = round(ms["round"] / ms[forward], 3)
    return result


def table(report: dict) -> str:
    lines = []
    for shape, result in report["shapes"].items():
        ms = result["ms"]
        tree = f", a tree of {result['tree_nodes']} nodes" if result.get("tree_nodes") else ""
        lines += [f"{shape} (block {result['block_size']}{tree}, context {result['context']}, capacity {result['capacity']}, "
                  f"{'fused' if result['compiled'] else 'eager kernels'}, "
                  f"{'CUDA graphs' if result['captured'] else 'plain calls'})", "", "| part | ms | share of round |",
                  "| --- | --- | --- |"]
        base = ms.get("round") or max(ms.values())
        lines += [f"| {name} | {value:.3f} | {value / base:.0%} |" for name, value in ms.items()]
        lines += [""] + [f"{name}: {value}" for name, value in result.items() if name.startswith("round_over")] + [""]
        for name, kernels in result.get("kernels", {}).items():
            lines += [f"{name}: {kernels['kernels_per_call']} kernels, {kernels['us_per_call']} us per call"]
            lines += [f"    {k['per_call']:6.2f} x {k['us_per_call']:8.2f} us  {k['kernel']}" for k in kernels["top"]]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dflash2.benchmarks.round_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the round")
    parser.add_argument("--capacity", type=int, default=None,
                        help="the round's buffer columns (default: what DFlash 2's own loop gives the request)")
    parser.add_argument("--compile", action="store_true", help="fuse the round and each part with inductor first")
    parser.add_argument("--replays", type=int, default=50, help="back-to-back replays per timing (3 timings each)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a test, not a measurement)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated parts to time (default: all), e.g. 'round,verify forward'")
    parser.add_argument("--forwards", default=None,
                        help=f"comma-separated target forwards to time, of {', '.join(FORWARDS)} (default: all)")
    parser.add_argument("--kernels", action="store_true",
                        help="also each part's kernels (launches, device time; torch.profiler, uncaptured) and the "
                             "16-token forward's, to see which kernels the round adds (CUDA only)")
    parser.add_argument("--tree-nodes", default="0",
                        help="comma-separated tree sizes, each profiled in turn (0: the path round), e.g. '0,16'")
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    args.parts = tuple(p.strip() for p in args.parts.split(",")) if args.parts else None
    args.forwards = tuple(p.strip() for p in args.forwards.split(",")) if args.forwards else None
    args.shape = [s.strip() for s in args.shape.split(",") if s.strip()]
    args.tree_nodes = [int(n) for n in args.tree_nodes.split(",") if n.strip()]
    unknown = sorted(set(args.shape) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; use {', '.join(SHAPES)}")
    if args.smoke:
        args.device, args.dtype, args.context, args.replays = args.device or "cpu", "float32", 24, 2
    args.device = torch.device(args.device or "cuda")
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv=None) -> dict:
    from dflash2.benchmarks.common import command_line, write_report

    args = parse_args(argv)
    report = {"command": command_line("dflash2.benchmarks.round_profile", argv), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
              "dtype": str(args.dtype), "shapes": {}}
    for shape in args.shape:
        print(f"== {shape}", flush=True)
        target, drafter = build_pair(shape, args.device, args.dtype, args.block_size, args.smoke)
        for nodes in args.tree_nodes:
            name = f"{shape}, tree {nodes}" if nodes else shape
            report["shapes"][name] = profile(target, drafter, args.context, args.compile, args.replays,
                                             args.capacity, args.parts, args.kernels, args.forwards, nodes)
        drafter.detach(target)
        del target, drafter
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_report(report, args.out)
    print(table(report))
    return report


if __name__ == "__main__":
    main()
