"""How a round of a `RoundCore` runs: eagerly, compiled, or replayed as a CUDA graph captured by hand.

On CUDA the round is captured as a CUDA graph over the core's fixed buffers. By default the graph holds the round's
eager kernels: the capture takes a fraction of a second, so the first call decodes without waiting for any compiler.
With `compile=True` the round is first compiled by inductor (fused kernels; torch keeps the result in its on-disk
caches, so later processes compile faster) and that is captured. A replayed graph consults no dynamo guard: a prompt
of a new length never compiles or captures anything.

Compiling in a background thread while the first calls decode was tried and is not safe with torch 2.11: FX tracing
patches `torch.nn.Module.__call__` process-wide, so an eager target forward in the decoding thread (the prefill) was
traced by mistake ("module is not installed as a submodule"), and inductor failed with "Attempting to use a closed
pool" (H200, docs/benchmarks.md). Fusion therefore happens in the calling thread, only when asked for.
"""

from __future__ import annotations

import time

import torch

from .round_core import RoundCore

WARMUP_ROUNDS = 2  # runs before a capture (allocator, lazily built buffers, cuBLAS handles)


class CapturedRound:
    """`round_fn` (reads and writes only fixed buffers) captured once as a CUDA graph; calling it replays the graph."""

    def __init__(self, round_fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ROUNDS):
                round_fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        started = time.perf_counter()
        # As inductor's cudagraph trees do: drop cuBLAS's cached workspaces first, so the workspace this capture needs
        # is allocated in the graph's own pool and stays valid for its replays. A graph that had baked in a workspace
        # from the general pool is exposed to anyone who clears them later -- cudagraph trees do, before each of their
        # captures -- and a replay after transformers' compiled plain decoding hit an illegal memory access (H200).
        clear_cublas_workspaces()
        with torch.cuda.graph(self.graph):
            round_fn()
        clear_cublas_workspaces()
        self.capture_seconds = time.perf_counter() - started

    def __call__(self) -> None:
        self.graph.replay()


def clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class RoundRunner:
    """Runs `core.round` one of three ways, chosen once per core.

    "eager": plain calls (CPU, or a target spread over several devices). "graph": the eager round captured as a CUDA
    graph. "compile": `torch.compile` (inductor) on first use, then captured when `capture` (one CUDA device).
    """

    def __init__(self, core: RoundCore, mode: str, capture: bool = True):
        self.core, self.mode = core, mode
        if mode == "eager":
            self._step, self.kind = core.round, "eager"
        elif mode == "graph":
            self._step, self.kind = CapturedRound(core.round), "graph (eager kernels)"
        elif mode == "compile":
            compiled = torch.compile(core.round, mode="default", dynamic=False)
            if capture and core.device.type == "cuda":
                core.round()  # eager once: builds the lazily allocated cache buffers outside the compiled graph
                self._step, self.kind = CapturedRound(compiled), "graph (fused)"
            else:
                self._step, self.kind = compiled, "compiled"
        else:
            raise ValueError(f"unknown round mode {mode!r}")

    def __call__(self) -> None:
        self._step()
