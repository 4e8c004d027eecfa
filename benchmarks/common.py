"""What the benchmark scripts share beyond the model arguments and the pair (`dflash2.model_args`): their reports, and
timing a call as a user waits for it, and waiting for the fused round so that what they time is the loop a user has."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def write_report(report: dict, out) -> None:
    """A benchmark's JSON report at `out` (folders made as needed); nothing when `out` is None."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")


def finish_report(report: dict, out) -> dict:
    """`write_report`, then the report on stdout; returns it."""
    write_report(report, out)
    print(json.dumps(report, indent=1))
    return report


def command_line(module: str, argv) -> str:
    """How this benchmark was called, for its report."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def synchronize(*devices) -> None:
    """Wait for the work queued on every CUDA device among `devices` (a CPU runs nothing ahead)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def wall_timed(function, *devices):
    """`function()` and its wall seconds, `devices` synchronised before and after: the time a user waits for it."""
    synchronize(*devices)
    started = time.perf_counter()
    out = function()
    synchronize(*devices)
    return out, time.perf_counter() - started


def settle(drafter, again) -> float | None:
    """compile="background" (the default on one CUDA device): wait for every child still building a fused round, then
    `again()` (a call) switches to it, so that what is timed next is the loop a user has after the switch. Returns
    the seconds spent waiting and switching, None when no runner had a switch ahead of it."""
    started = time.perf_counter()
    if not drafter.wait_for_fusion():
        return None
    again()
    return round(time.perf_counter() - started, 1)
