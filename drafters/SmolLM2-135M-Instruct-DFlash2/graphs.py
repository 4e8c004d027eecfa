# Generated from generation/graphs.py by `python -m dflash2.generation.flat_code`; do not edit.
"""How a round of a `RoundCore` runs: eagerly, compiled, or replayed as a CUDA graph captured by hand.

On CUDA the round is captured as a CUDA graph over the core's fixed buffers. By default the graph holds the round's
eager kernels: the capture takes a fraction of a second, so the first call decodes without waiting for any compiler.
With `compile=True` the round is first compiled by inductor (fused kernels; torch keeps the result in its on-disk
caches, so later processes compile faster) and that is captured. With `compile="background"` a round compiled ahead
of time in a child process replaces it once it exists (`background_build.py`, `RoundRunner.use_fused`). A replayed graph
consults no dynamo guard: a prompt of a new length never compiles or captures anything.

A core has two rounds, greedy (`RoundCore.round`) and sampled (`RoundCore.sampled_round`). Where rounds are captured,
both are captured (compiled first with `compile=True`) when the runner is built, and both fused ones when it switches
to a package; the two graphs share one memory pool, since they never run at once. The sampling settings and EOS ids
are tensors the rounds read, so a new temperature, top-k, top-p or EOS set compiles and captures nothing either: each
call runs the round its request's `do_sample` picks.

The prefill is captured too, once per prefill bucket (`PREFILL_BUCKETS`: a prompt is left-padded to the next bucket),
all when the core is built: an eager prefill of a small target is bound by kernel launches (as long as dozens of
rounds), a replay is not. Prompts longer than the largest bucket prefill eagerly.

Compiling in a background thread while the first calls decode was tried and is not safe with torch 2.11: FX tracing
patches `torch.nn.Module.__call__` process-wide, so an eager target forward in the decoding thread (the prefill) was
traced by mistake ("module is not installed as a submodule"), and inductor failed with "Attempting to use a closed
pool". Fusion therefore never runs beside decoding in the caller's process: with
`compile=True` inductor compiles in the calling thread before the first round, which waits for it; with
`compile="background"` a child process compiles (`background_build.py`).
"""

from __future__ import annotations

import functools

import torch

from .round_core import PREFILL_BUCKETS, RoundCore, round_state

WARMUP_ROUNDS = 2  # runs before a capture (allocator, lazily built buffers, cuBLAS handles)


class CapturedGraph:
    """`fn` (reads and writes only fixed buffers) captured once as a CUDA graph; calling it replays the graph.
    Graphs given the same `pool` share their memory (they must never run at the same time)."""

    def __init__(self, fn, pool=None, warmup: int = WARMUP_ROUNDS):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # As inductor's cudagraph trees do: drop cuBLAS's cached workspaces first, so the workspace this capture needs
        # is allocated in the graph's own pool and stays valid for its replays. A graph that had baked in a workspace
        # from the general pool is exposed to anyone who clears them later -- cudagraph trees do, before each of their
        # captures -- and a replay after transformers' compiled plain decoding hit an illegal memory access.
        clear_cublas_workspaces()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()
        clear_cublas_workspaces()

    def __call__(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        """Free the graph (its memory returns to its pool); it must not be replayed after."""
        self.graph.reset()


def clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class RoundRunner:
    """Runs `core.round` (greedy) and `core.sampled_round` one of three ways, chosen once per core.

    "eager": plain calls (CPU, or a target spread over several devices). "graph": the eager rounds captured as CUDA
    graphs. "compile": `torch.compile` (inductor), then captured when `capture` (one CUDA device; both rounds compile
    before the first call), else compiled on each round's first use. With `capture`, the prefill is captured per
    bucket as well (`prefill`).

    Public, for benchmarks and tests (through `DFlash2Drafter.round_runners`): `kind` (how its rounds run now, e.g.
    "graph (eager kernels)", "graph (fused ahead of time)", "eager"), `core` (the `RoundCore`: its buffers, rounds
    and the current request's settings), `mode`, `fusion` (a `background_build.BackgroundFusion` with
    compile="background", else None), calling it (one round of the kind `core.do_sample` picks), `prefill` and
    `release`.
    """

    def __init__(self, core: RoundCore, mode: str, capture: bool = True):
        self.core, self.mode = core, mode
        self.state = round_state(core)  # the declared buffers every captured or compiled round reads and writes
        self.captured = captured = capture and mode != "eager"  # the caller's choice: one CUDA device holds both
        self.prefill_graphs = self._capture_prefills(core) if captured else {}
        self.fusion = None  # a BackgroundFusion when compile="background" (set by loop.round_runner_for)
        rounds = (core.round, core.sampled_round)
        if mode == "eager":
            steps, self.kind = rounds, "eager"
        elif mode == "graph":
            steps, self.kind = capture_rounds(rounds), "graph (eager kernels)"
        elif mode == "compile":
            compiled = [torch.compile(fn, mode="default", dynamic=False) for fn in rounds]
            if captured:
                core.round()  # eager once: builds the lazily allocated cache buffers outside the compiled graph
                steps, self.kind = capture_rounds(compiled), "graph (fused)"
            else:
                steps, self.kind = compiled, "compiled"
        else:
            raise ValueError(f"unknown round mode {mode!r}")
        self._steps = dict(zip((False, True), steps))  # do_sample -> its round
        if captured:
            core.warm_sampling_steps()  # so that a first sampled call costs what its second does
        self.check_state_in_place()

    def __call__(self) -> None:
        self._steps[self.core.do_sample]()

    def release(self) -> None:
        """Free the captured graphs now (rather than when the runner is collected); the runner is unusable after."""
        for graph in (*self._steps.values(), *self.prefill_graphs.values()):
            if isinstance(graph, CapturedGraph):
                graph.release()
        self._steps = {False: self.released, True: self.released}
        self.prefill_graphs, self.kind = {}, "released"

    @staticmethod
    def released() -> None:
        raise RuntimeError("This round runner was released (drafter.release() or detach); generate builds a new one.")

    def use_fused(self, fused: dict) -> None:
        """From now on run `fused` ({do_sample: the same round, compiled ahead of time over the core's own tensors}):
        captured when this runner captures, else called."""
        rounds = (fused[False], fused[True])
        self._steps = dict(zip((False, True), capture_rounds(rounds) if self.captured else rounds))
        self.kind = "graph (fused ahead of time)" if self.captured else "fused ahead of time"
        self.check_state_in_place()

    def check_state_in_place(self) -> None:
        """A captured round reads and writes the core's state tensors where they were at capture: a round that had
        replaced one (rather than written into it) would leave its graph on the stale tensor."""
        moved = [name for name, tensor in round_state(self.core).items() if tensor is not self.state[name]]
        if moved:
            raise RuntimeError(f"A round replaced the core's state tensors {moved} instead of writing into them.")

    def prefill(self, input_ids, attention_mask, max_new_tokens: int, generator=None) -> None:
        """`core.prefill`, with the prompt's encoding replayed from its bucket's graph when there is one."""
        width = self.core.prefill_width(input_ids.shape[1])
        self.core.prefill(input_ids, attention_mask, max_new_tokens, generator, encode=self.prefill_graphs.get(width))

    @staticmethod
    def _capture_prefills(core: RoundCore) -> dict:
        """One graph of `core.encode_prompt(width)` per bucket that fits the buffers, sharing one memory pool. The
        warm-up and capture encode whatever the staging buffer holds; the caches they write lie beyond any real
        prompt's columns or are overwritten by its own encoding."""
        if not core.bucketed_prefill:
            return {}  # prompts of any width: nothing to capture ahead
        pool = torch.cuda.graph_pool_handle()
        return {width: CapturedGraph(functools.partial(core.encode_prompt, width), pool=pool, warmup=1)
                for width in PREFILL_BUCKETS if width + core.block_size <= core.capacity}


def capture_rounds(rounds) -> list:
    """Each round captured as a graph, all in one memory pool: rounds never run at once, and every one writes its
    results into the core's fixed buffers, so their temporaries may share memory."""
    pool = torch.cuda.graph_pool_handle()
    graphs = [CapturedGraph(fn, pool=pool) for fn in rounds]
    for graph in graphs:  # a graph's first launch uploads it to the device: here, rather than in a request's first round
        graph()  # (it runs on the state the capture's warm-up ran on; a request's prefill writes the state anew)
    return graphs
