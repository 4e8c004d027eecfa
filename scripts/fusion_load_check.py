"""Where does loading a compiled round crash on a GPU? (compile="background" segfaulted inside `aoti_load_package` on
the H200 image, torch 2.11 with CUDA; on a CPU with torch 2.13 it works. The round is now saved by `aot_compile`
instead; the `module` cases still test AOTInductor itself, the `round` cases the round as it is built now.)

    python scripts/fusion_load_check.py --out /tmp/fusion-load-check        # every case, each in its own process

Each case runs in a fresh process (a segfault ends only that case) and reports its exit status and last lines:
  module            a two-layer module compiled and loaded in one process (does AOTI load at all here?)
  module-fresh      that package loaded in a fresh process
  module-threaded   the same, loaded with run_single_threaded=False (the default)
  round             the tiny round core's compiled round (weights as inputs) built and loaded in one process
  round-fresh       that package loaded by a fresh process that builds the same core
  round-after-graph the same after a CUDA graph was captured in the process (as the runner does)
When gdb is installed, a crashing case is re-run under it for the native backtrace.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
CASES = ("module", "module-fresh", "module-threaded", "round", "round-fresh", "round-after-graph")


def tiny_core(device: str):
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    import torch
    from transformers import GenerationConfig

    from dflash2.generation.round_core import RoundCore
    from dflash2.generation.sampling import Sampling
    from helpers import VOCAB, tiny_drafter, tiny_target

    target = tiny_target("llama", seed=2).to(device)
    drafter = tiny_drafter(target, seed=3, block_size=4).to(device).attach(target)
    core = RoundCore(target, drafter, 1, 64)
    core.set_sampling(Sampling.from_generation_config(GenerationConfig(do_sample=False)), (2,))
    ids = torch.randint(4, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0)).to(device)
    core.prefill(ids, torch.ones_like(ids), 40)
    return core


def run_case(case: str, folder: Path, device: str) -> None:
    import torch

    from dflash2.generation import fusion

    module_path, round_path = folder / "module.pt2", folder / "fused.round"
    if case == "module":
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)
        x = torch.randn(4, 64, device=device)
        exported = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(exported, package_path=str(module_path))
        print("compiled", flush=True)
        loaded = torch._inductor.aoti_load_package(str(module_path), run_single_threaded=True)
        print("loaded; max difference", float((loaded(x) - model(x)).abs().max()), flush=True)
    elif case in ("module-fresh", "module-threaded"):
        loaded = torch._inductor.aoti_load_package(str(module_path), run_single_threaded=case == "module-fresh")
        print("loaded; output", tuple(loaded(torch.randn(4, 64, device=device)).shape), flush=True)
    elif case == "round":
        core = tiny_core(device)
        fusion.build_package(fusion.spec_of(core), round_path)
        print("built", round_path.stat().st_size, "bytes", flush=True)
        print("used" if fusion.load_fused_rounds(core, round_path) is not None else "refused", flush=True)
    elif case in ("round-fresh", "round-after-graph"):
        core = tiny_core(device)
        if case == "round-after-graph" and device == "cuda":
            x = torch.zeros(8, device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                x.add_(1)
            graph.replay()
            print("captured a graph", flush=True)
        print("used" if fusion.load_fused_rounds(core, round_path) is not None else "refused", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/fusion-load-check")
    parser.add_argument("--device", default="cuda", help="cuda (what it is for) or cpu (to try the script)")
    parser.add_argument("--case", choices=CASES, default=None, help="run one case in this process")
    args = parser.parse_args(argv)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    if args.case:
        run_case(args.case, folder, args.device)
        return 0
    report = {}
    for case in CASES:
        command = [sys.executable, "-X", "faulthandler", str(HERE), "--case", case, "--out", str(folder), "--device", args.device]
        done = subprocess.run(command, capture_output=True, text=True, timeout=400)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "Extension modules" not in line]
        report[case] = {"exit": done.returncode, "tail": lines[-12:]}
        if done.returncode < 0 or done.returncode == 139:
            if shutil.which("gdb"):
                traced = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *command],
                                        capture_output=True, text=True, timeout=400)
                report[case]["gdb"] = [line for line in traced.stdout.splitlines() if line.startswith("#")][:40]
        print(case, json.dumps(report[case]), flush=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
