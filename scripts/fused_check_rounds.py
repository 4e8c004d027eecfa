"""Round by round, the eager round against a fused one on real prompts: what the check of a loaded package
(`fusion.agreement`) compares, shown per round.

    python scripts/fused_check_rounds.py --device cpu --dtype bfloat16 --package /tmp/fused-check   # builds it once
    python scripts/fused_check_rounds.py --device cuda --batch 8 --tree-nodes 32 --humaneval-skip 120 --mtbench-skip 50

For each batch of prompts (`--batch` of MT-Bench from `--mtbench-skip`, then of HumanEval from `--humaneval-skip`,
left-padded) it prefills the default target's round core and runs `--rounds` rounds; each round runs eager and fused
from the same state and prints the rows whose fused tokens parted from the eager round's (`fusion.parting`: how many
tokens they shared) and what the check found (`fusion.round_comparison`: a parting that is no near tie names its
margin), then continues from the eager round's state.
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
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mtbench-skip", type=int, default=0)
    parser.add_argument("--humaneval-skip", type=int, default=100)
    parser.add_argument("--tree-nodes", type=int, default=0)
    parser.add_argument("--package", default=None, help="folder of the package (built there when missing)")
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    target, tokenizer = load_target(drafter.config, dtype=dtype)
    target.to(device).eval()
    drafter.attach(target)
    core = RoundCore(target, drafter, args.batch, 1024, bucketed_prefill=device.type == "cuda",
                     tree_nodes=args.tree_nodes)
    core.set_sampling(Sampling(), (tokenizer.eos_token_id,))
    texts = {"mtbench": task_prompts("mtbench", args.prompts * args.batch, skip=args.mtbench_skip),
             "humaneval": task_prompts("humaneval", args.prompts * args.batch, skip=args.humaneval_skip)}
    batches = [(task, rows[i: i + args.batch]) for task, rows in texts.items() for i in range(0, len(rows), args.batch)]

    def prefill(rows):
        ids = [chat_prompt_ids(tokenizer, text) for text in rows]
        width = max(len(r) for r in ids)
        padded = torch.tensor([[0] * (width - len(r)) + r for r in ids], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=device)
        core.prefill(padded, mask, 256)

    prefill(batches[0][1])
    path = Path(args.package or tempfile.mkdtemp()) / "fused.round"
    if not path.exists():
        started = time.perf_counter()
        fusion.build_package(fusion.spec_of(core), path)
        print(f"built {path} in {time.perf_counter() - started:.0f} s")
    program = fusion.RoundProgram(core)
    with zipfile.ZipFile(path) as package:
        fused = fusion.loaded_round(program, package.open(fusion.ROUND_ENTRIES[False]))
    passed = rounds = 0
    for task, rows in batches:
        prefill(rows)
        for index in range(args.rounds):
            comparison = fusion.round_comparison(core, program, fused)
            parted, differences = comparison["parted"], comparison["differences"]
            program.eager()  # the next round starts where the eager round left off
            passed, rounds = passed + (not differences), rounds + 1
            shared = [(row, int(parted["tokens"][row])) for row in range(args.batch) if parted["rows"][row]]
            print(f"{task} round {index}: rows parted (row, tokens shared) {shared}; check "
                  f"{'passes' if not differences else 'fails: ' + '; '.join(differences[:3])}", flush=True)
    print(f"rounds the check passed: {passed}/{rounds}")


if __name__ == "__main__":
    main()
