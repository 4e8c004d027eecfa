# Generated from generation/loop.py by `python -m dflash2.generation.flat_code`; do not edit.
"""DFlash 2's own decoding loop around the round core: prefill, queue rounds, read the token stream, stop.

`target.generate(..., assistant_model=drafter)` lands here for a batch (left-padded rows, each accepting its own
number of drafts) and for one prompt wherever this loop honours the call (`dispatch.py`); the rest runs in
transformers' assisted loop (`candidate_generator.py`), which honours every logits processor.

The host reads the device once every few rounds: how many tokens each row has and whether it is done (EOS or
max_new_tokens). Rounds queued between two reads never overshoot max_new_tokens (at most a block per round), and a
row that finished earlier freezes on the device, so the output is exact whatever the read interval.
"""

from __future__ import annotations

import weakref

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .background_build import BackgroundFusion
from .graphs import RoundRunner
from .modeling_dflash2 import CACHE_NAME
from .round_core import RoundCore, check_tree_nodes, columns_per_round, prefill_width
from .sampling import Sampling, eos_token_ids
from .stats import DFlash2Stats, truncate_at_eos

ROUNDS_PER_READ = 4  # rounds queued between two host reads of the token stream
# Runners (each with its core's buffers and graphs) a drafter keeps, one per (target, batch bucket, mode, tree size,
# capacity), each serving greedy search and every sampling setting and EOS set; beyond it the least recently used one
# is released
MAX_RUNNERS = 4
# Columns of the buffers. A round attends over every column of its core, so capacities stay close to the request: on
# CUDA powers of two from 512 up to 8192 (few captured graphs and fused packages, one per capacity), then steps of
# 8192; on a CPU steps of 256 (docs/benchmarks.md: a round's cost by capacity).
MIN_CAPACITY = {"cuda": 512, "cpu": 256}
CUDA_CAPACITY_STEP = 8192


def own_loop_generate(target, drafter, input_ids, attention_mask, generation_config, streamer=None,
                      compile: bool | str | None = None, generator: torch.Generator | None = None,
                      past_key_values=None, tree_nodes: int | None = None):
    """Decode `input_ids` [b, P] (left-padded when b > 1) with the round core. Returns [b, P + new] like generate, or
    with `generation_config.return_dict_in_generate` an output whose cache (a `LoopCache`, under `CACHE_NAME`: `cache`
    from transformers 5.24, else `past_key_values`) continues the conversation: passed back with the whole
    conversation's ids, the next turn encodes only what follows.
    `tree_nodes`: rounds verify a tree of so many nodes (0: a path; None: `drafter.config.tree_nodes`)."""
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}. With the cache of an earlier turn, pass the whole conversation's "
                         "ids and their mask: the cached part is not encoded again.")
    check_left_padded(attention_mask)
    if streamer is not None and batch > 1:
        raise ValueError("Streaming shows one sequence; pass a streamer with a single prompt.")
    max_new_tokens = generation_config.max_new_tokens or (generation_config.max_length - length)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one new token.")
    sampling = Sampling.from_generation_config(generation_config)
    eos = eos_token_ids(generation_config)
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)

    tree_nodes = drafter.config.tree_nodes if tree_nodes is None else tree_nodes
    check_tree_nodes(tree_nodes, drafter.config)
    bucket = batch_bucket(batch)
    graphs = uses_graphs(target, drafter)
    needed = columns_needed(drafter.config, length, max_new_tokens, tree_nodes, graphs)
    earlier = past_key_values.core() if isinstance(past_key_values, LoopCache) else None
    runner = round_runner_for(target, drafter, bucket, needed, compile, graphs, tree_nodes, prefer=earlier)
    if bucket > batch:  # empty rows: no real token, done from the start
        input_ids = torch.cat([input_ids, input_ids.new_full((bucket - batch, length), pad)])
        attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(bucket - batch, length)])
    core = runner.core
    core.set_sampling(sampling, eos)  # data of the rounds: no new core, graph or compile for a new setting
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids[:batch], attention_mask[:batch])]
    keep = held_prefix(past_key_values, core, rows)
    if keep is None or not core.resume(rows, keep, max_new_tokens, generator):
        runner.prefill(input_ids, attention_mask, max_new_tokens, generator)
    if runner.fusion is not None:
        runner.fusion.poll(runner)  # switches to the fused round once its package is built
    if bucket > batch:
        core.done[batch:] = True
    if streamer is not None:
        streamer.put(input_ids[:1].cpu())
    streamed = 0
    remaining = max_new_tokens - 1
    while True:
        for _ in range(rounds_before_read(remaining, drafter.config.block_size)):
            if sampling.do_sample:
                core.draw_noise(generator)
            runner()
        # the one host read: done flags and lengths (and row 0's new tokens when streaming)
        read = [core.done.long(), core.output_length]
        if streamer is not None:
            read.append(core.output[0, streamed: max_new_tokens])
        values = torch.cat(read).tolist()
        done, lengths = values[:bucket], values[bucket: 2 * bucket]
        if streamer is not None:
            new = truncate_at_eos(values[2 * bucket: 2 * bucket + lengths[0] - streamed], set(eos))
            if new:
                streamer.put(torch.tensor(new))
            streamed = lengths[0]
        if all(done):
            break
        remaining = min(max_new_tokens - n for n, d in zip(lengths, done) if not d)
    if streamer is not None:
        streamer.end()
    sequences = finish(core, drafter, input_ids[:batch], batch, max_new_tokens, eos, pad)
    if not generation_config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, **{CACHE_NAME: LoopCache(core, core.held_tokens(rows))})


class LoopCache:
    """The `past_key_values` DFlash 2's own loop returns: per row, the tokens whose target keys and drafter context its
    buffers hold. Valid while no other request ran on the same buffers; else the next turn encodes everything."""

    def __init__(self, core: RoundCore, rows: list[list[int]]):
        self.core, self.serial, self.rows = weakref.ref(core), core.serial, rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(len(row) for row in self.rows)


def held_prefix(cache, core: RoundCore, rows: list[list[int]]) -> list[int] | None:
    """Per row, how many leading tokens of `rows` the buffers of `core` still hold from the earlier turn `cache` (the
    newest token is always encoded); None when `cache` is not the latest turn on these buffers."""
    if not isinstance(cache, LoopCache) or cache.core() is not core or cache.serial != core.serial:
        return None
    if len(cache.rows) != len(rows):
        return None
    keep = []
    for held, ids in zip(cache.rows, rows):
        limit = min(len(held), len(ids) - 1)
        keep.append(next((i for i in range(limit) if held[i] != ids[i]), limit))
    return keep


def finish(core: RoundCore, drafter, input_ids, batch: int, max_new_tokens: int, eos, pad: int) -> torch.Tensor:
    """Rows' tokens cut at their EOS and at max_new_tokens, right-padded with `pad`; statistics into last_stats."""
    lengths = core.output_length[:batch].tolist()
    outputs = [truncate_at_eos(row[:n], set(eos))[:max_new_tokens]
               for row, n in zip(core.output[:batch].tolist(), lengths)]
    stats = DFlash2Stats(drafter.config.block_size, rows=batch, loop="dflash2")
    stats.target_forwards = batch + int(core.rounds[:batch].sum())
    stats.accepted_per_position = core.accepted_per_position[:batch].sum(0).tolist()
    stats.completion_tokens = sum(len(t) for t in outputs)
    drafter.last_stats = stats
    width = max(len(t) for t in outputs)
    generated = torch.full((batch, width), pad, dtype=torch.long)
    for row, tokens in enumerate(outputs):
        generated[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return torch.cat([input_ids, generated.to(input_ids.device)], dim=1)


def rounds_before_read(remaining: int, per_round: int, most: int = ROUNDS_PER_READ) -> int:
    """Rounds to queue before the next host read: `most`, fewer when the nearest token limit (`remaining` tokens, at
    most `per_round` emitted a round) comes sooner, at least one; none when no token remains."""
    return max(1, min(most, remaining // per_round)) if remaining > 0 else 0


def batch_bucket(batch: int) -> int:
    """Batch buckets 1, 2, 4, 8, ...: rows beyond the batch are empty."""
    return 1 << (batch - 1).bit_length()


def columns_needed(config, length: int, max_new_tokens: int, tree_nodes: int, graphs: bool) -> int:
    """Buffer columns a request of `length` prompt tokens and `max_new_tokens` needs."""
    block = config.block_size
    return prefill_width(length, block, bucketed=graphs) + max_new_tokens + columns_per_round(block, tree_nodes)


def fuse_ahead(target, drafter, input_ids: torch.Tensor, max_new_tokens: int, tree_nodes: int | None = None,
               timeout: float | None = None, wait: bool = True):
    """The fused round for calls of this shape (`input_ids` [b, P], `max_new_tokens`): found on disk, or built by a
    child process while this one waits (`wait`), decoding nothing (on a CPU a build beside decoding slows both several
    times). Later calls of the shape with the default `compile` load it, check it and run it. Returns the
    `BackgroundFusion` (its `job` and `log` say how a build went; `wait()` waits for it)."""
    tree_nodes = drafter.config.tree_nodes if tree_nodes is None else tree_nodes
    check_tree_nodes(tree_nodes, drafter.config)
    graphs = uses_graphs(target, drafter)
    needed = columns_needed(drafter.config, input_ids.shape[1], max_new_tokens, tree_nodes, graphs)
    runner = round_runner_for(target, drafter, batch_bucket(input_ids.shape[0]), needed, "background", graphs,
                              tree_nodes)
    if wait:
        runner.fusion.wait(timeout)
    cores = runners_of(drafter)
    for key in [key for key, kept in cores.items() if kept is runner]:
        cores.pop(key).release()  # the package is on disk; the call that needs it loads and checks it
    return runner.fusion


def round_runner_for(target, drafter, batch: int, needed: int, compile: bool | str | None, graphs: bool,
                     tree_nodes: int = 0, prefer: RoundCore | None = None):
    """The runner (and its core) for this shape: one per (target, batch bucket, mode, tree size, capacity), built at
    its first use and kept among the drafter's `MAX_RUNNERS` most recently used; it serves greedy search and every
    sampling setting and EOS set (the caller writes them into the core: `RoundCore.set_sampling`). `graphs`: rounds
    and prefills are captured (`uses_graphs`).

    A round attends over every column of its buffers, so a request takes the smallest kept core that holds `needed`
    columns -- `prefer` (the core an earlier turn's cache lives in) when it does -- else a new one of `capacity_for`.
    """
    cores = runners_of(drafter)
    # CUDA: the round captured as a graph of its eager kernels, or of inductor-fused ones with compile=True.
    # CPU or a target spread over devices: plain calls, or inductor when compile=True.
    # compile="background": as with compile=False, until a package compiled ahead of time replaces it
    # (background_build.py).
    # The default (None): "background" where rounds are captured (one CUDA device); elsewhere a package already on
    # disk for this shape (`dflash2 precompile`, `dflash2 generate` on a CPU) when there is one, else unfused.
    if compile not in (None, False, True, "background"):
        raise ValueError(f"compile={compile!r}: use True (fuse the round now, waiting for inductor), 'background' (fuse "
                         "it ahead of time in a child process while decoding unfused), or False (never fuse).")
    if compile is None:
        compile = "background" if graphs else "found"
    mode = "compile" if compile is True else ("graph" if graphs else "eager")
    shape = (id(target), batch, mode, compile if isinstance(compile, str) else None, tree_nodes)
    fitting = sorted((key for key, runner in cores.items() if key[:-1] == shape and key[-1] >= needed),
                     key=lambda key: (cores[key].core is not prefer, key[-1]))
    if fitting:
        key = fitting[0]
        runner = cores.pop(key)
    else:
        while len(cores) >= MAX_RUNNERS:
            cores.pop(next(iter(cores))).release()
        capacity = capacity_for(needed, graphs)
        key = shape + (capacity,)
        core = RoundCore(target, drafter, batch, capacity, bucketed_prefill=graphs, tree_nodes=tree_nodes)
        runner = RoundRunner(core, mode, capture=graphs)
        if isinstance(compile, str):
            runner.fusion = BackgroundFusion(runner, build=compile == "background")
    cores[key] = runner  # the most recently used last
    return runner


def runners_of(drafter) -> dict:
    """The drafter's runners, least recently used first (kept in the drafter's __dict__: no module state)."""
    return drafter.__dict__.setdefault("_round_runners", {})


def release_runners(drafter, target=None) -> None:
    """Release the drafter's runners (for `target` only, when given): their buffers and graphs are freed once nothing
    else holds them. A child still building a fused round finishes it for the next call or process."""
    cores = runners_of(drafter)
    for key in [key for key, runner in cores.items() if target is None or runner.core.target is target]:
        cores.pop(key).release()


def capacity_for(needed: int, graphs: bool) -> int:
    """Buffer columns for a request needing `needed` (see MIN_CAPACITY)."""
    if not graphs:
        return -(-needed // MIN_CAPACITY["cpu"]) * MIN_CAPACITY["cpu"]
    capacity = max(MIN_CAPACITY["cuda"], 1 << (needed - 1).bit_length())
    return capacity if capacity <= CUDA_CAPACITY_STEP else -(-needed // CUDA_CAPACITY_STEP) * CUDA_CAPACITY_STEP


def uses_graphs(target, drafter) -> bool:
    """Rounds (and prefills) are captured as CUDA graphs: one CUDA device holds the target and the drafter."""
    return drafter.device.type == "cuda" and single_device(target, drafter)


def single_device(target, drafter) -> bool:
    devices = {p.device for p in target.parameters()} | {p.device for p in drafter.parameters()}
    return len(devices) == 1


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Each row's mask must be zeros (padding) then ones (the prompt): anything else would hide prompt tokens."""
    mask = attention_mask.bool()
    if not bool(((mask[:, 1:] >= mask[:, :-1]).all() & mask[:, -1].all())):  # one read from the device
        raise ValueError("DFlash 2 needs left-padded prompts: each row's attention_mask must be 0 (padding) before "
                         "its prompt and 1 from its first token to the end. Set tokenizer.padding_side = 'left', or "
                         "drop the mask if the prompt has no padding.")
