"""How a round of a `RoundCore` runs: eagerly, compiled, or replayed as a CUDA graph captured by hand.

On CUDA the round is captured at once from its eager kernels (a fraction of a second), so the first call decodes
without waiting for any compiler. Meanwhile a background thread compiles the same round with inductor on a scratch
core of the same shapes (torch keeps the result in its on-disk caches, so a later process compiles faster); the next
call captures the fused round and replays that instead. A replayed graph consults no dynamo guard: a prompt of a new
length never compiles or captures anything.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

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
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            round_fn()
        self.capture_seconds = time.perf_counter() - started

    def __call__(self) -> None:
        self.graph.replay()


class RoundRunner:
    """Runs `core.round` the fastest way available right now.

    mode "eager": plain calls (CPU). "compile": `torch.compile` (inductor), compiled on first use; on CUDA the compiled
    round is then captured. "graph": the eager round captured as a CUDA graph; with `fuse` the inductor-compiled round
    replaces it once a background compile has finished (`begin_call` swaps it in, never in the middle of a call).
    """

    def __init__(self, core: RoundCore, mode: str, fuse: bool = False, make_scratch=None):
        self.core, self.mode = core, mode
        self.kind = mode
        self._fused = None
        self._fuse_thread = None
        self.fuse_error: BaseException | None = None
        self.fuse_seconds: float | None = None
        if mode == "eager":
            self._step = core.round
        elif mode == "compile":
            compiled = compile_round()
            if core.device.type == "cuda":
                self._step = CapturedRound(lambda: compiled(core))
                self.kind = "graph (fused)"
            else:
                self._step = lambda: compiled(core)
        elif mode == "graph":
            self._step = CapturedRound(core.round)
            self.kind = "graph (eager kernels)"
            if fuse and make_scratch is not None:
                self._fuse_thread = threading.Thread(target=self._fuse, args=(make_scratch,), daemon=True,
                                                     name="dflash2-fuse")
                self._fuse_thread.start()
        else:
            raise ValueError(f"unknown round mode {mode!r}")

    def _fuse(self, make_scratch) -> None:
        """Background thread: compile the round on a scratch core (own buffers, own stream)."""
        started = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 0.0005))  # keep the decoding thread's host work prompt meanwhile
        try:
            compiled = compile_round()
            scratch = make_scratch()
            stream = torch.cuda.Stream(device=scratch.device)
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_ROUNDS):
                    compiled(scratch)
            stream.synchronize()
            del scratch
            self._fused = compiled
            self.fuse_seconds = time.perf_counter() - started
        except Exception as error:  # the eager graph keeps working; say why the fused one never came
            self.fuse_error = error
            warnings.warn(f"DFlash 2: compiling the round failed ({type(error).__name__}: {error}); decoding goes on "
                          "with the captured eager round.", stacklevel=1)
        finally:
            sys.setswitchinterval(interval)

    def wait_for_fusion(self, timeout: float | None = None) -> bool:
        """Block until the background compile is done (benchmarks use this to time the steady state)."""
        if self._fuse_thread is not None:
            self._fuse_thread.join(timeout)
        self.begin_call()
        return self._fused is not None

    def begin_call(self) -> None:
        """At the start of a generate call: capture the fused round if it has become available."""
        if self._fused is not None and self.kind != "graph (fused)":
            compiled, core = self._fused, self.core
            self._step = CapturedRound(lambda: compiled(core))
            self.kind = "graph (fused)"

    def __call__(self) -> None:
        self._step()


_COMPILED_ROUND = None


def compile_round():
    """One compiled round function for every core: shapes are guarded, so cores of one shape share the compile."""
    global _COMPILED_ROUND
    if _COMPILED_ROUND is None:
        _COMPILED_ROUND = torch.compile(RoundCore.round, mode="default", dynamic=False)
    return _COMPILED_ROUND
