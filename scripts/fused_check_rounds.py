"""Round by round, the eager round against a fused one on real prompts: what the check of a loaded package
(`fusion.agreement`) compares, shown per round.

    python scripts/fused_check_rounds.py --device cpu --dtype bfloat16 --package /tmp/fused-check   # builds it once

For each prompt (MT-Bench 0.., HumanEval 100..) it prefills the default target's round core and runs `--rounds`
rounds; each round runs eager and fused from the same state (`fusion.round_differences`) and prints the tokens the eager
round emitted, whether the whole state agreed and whether the live state (`RoundCore.live_entries`) agreed, then
continues from the eager round's state.
"""

import argparse
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from dflash2.generation import DFlash2Drafter, fusion, load_target
from dflash2.generation.round_core import RoundCore
from dflash2.generation.sampling import Sampling
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import chat_prompt_ids, task_prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="per task")
    parser.add_argument("--tree-nodes", type=int, default=0)
    parser.add_argument("--package", default=None, help="folder of the package (built there when missing)")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    target, tokenizer = load_target(drafter.config, dtype=dtype)
    target.to(device).eval()
    drafter.attach(target)
    core = RoundCore(target, drafter, 1, 512, bucketed_prefill=device.type == "cuda", tree_nodes=args.tree_nodes)
    core.set_sampling(Sampling(), (tokenizer.eos_token_id,))
    prompts = [("mtbench", text) for text in task_prompts("mtbench", args.prompts, skip=0)]
    prompts += [("humaneval", text) for text in task_prompts("humaneval", args.prompts, skip=100)]

    def prefill(text):
        ids = torch.tensor([chat_prompt_ids(tokenizer, text)], device=device)
        core.prefill(ids, torch.ones_like(ids), 256)

    prefill(prompts[0][1])
    path = Path(args.package or tempfile.mkdtemp()) / "fused.round"
    if not path.exists():
        started = time.perf_counter()
        fusion.build_package(fusion.spec_of(core), path)
        print(f"built {path} in {time.perf_counter() - started:.0f} s")
    program = fusion.RoundProgram(core)
    with zipfile.ZipFile(path) as package:
        fused = fusion.loaded_round(program, package.open(fusion.ROUND_ENTRIES[False]))
    totals = {"whole": 0, "live": 0, "rounds": 0}
    for task, text in prompts:
        prefill(text)
        for index in range(args.rounds):
            whole = fusion.round_differences(core, program, fused, live_only=False)
            in_live = fusion.round_differences(core, program, fused)
            begin = int(core.output_length[0])
            program.eager()  # the next round starts where the eager round left off
            totals["whole"] += not whole
            totals["live"] += not in_live
            totals["rounds"] += 1
            print(f"{task} round {index}: eager {core.output[0, begin: int(core.output_length[0])].tolist()}; whole "
                  f"state {'agrees' if not whole else 'differs: ' + '; '.join(whole[:3])}; live state "
                  f"{'agrees' if not in_live else 'differs: ' + '; '.join(in_live[:3])}", flush=True)
    print(f"rounds agreeing: whole state {totals['whole']}/{totals['rounds']}, live state {totals['live']}/"
          f"{totals['rounds']}")


if __name__ == "__main__":
    main()
