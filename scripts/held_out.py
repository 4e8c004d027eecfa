"""The trainer's held-out estimates for any drafters, on the held-out answers of a training data file: the same split
as `dflash2 train` (`--held-out`, `--seed`), the same estimate (`held_out_acceptance`: the greedy walk's tau, and the
T = 1 measures: the target's mass on each row's candidates and one sampled draft's chance of acceptance). The answers
scored: the held-out prompts' greedy answers (what the trainer scores), their sampled answers, or both.

    python scripts/held_out.py --data DATA.jsonl[.gz] --drafter A [--drafter B ...] [--answers greedy|sampled|all]
        [--held-out 64] [--seed 0] [--max-length 768] [--out FILE.jsonl]

One JSON line per drafter. On CUDA the target runs in bf16 and the drafter in fp32 under bf16 autocast, as in
training; on the CPU both in fp32.
"""
import argparse
import json

import torch

from dflash2.generation import load_target
from dflash2.modeling_dflash2 import DFlash2DraftModel
from dflash2.tasks import read_jsonl
from dflash2.training.recipe import held_out_prompts
from dflash2.training.trainer import held_out_acceptance, held_out_batches

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--data", required=True)
parser.add_argument("--drafter", action="append", required=True)
parser.add_argument("--answers", choices=("greedy", "sampled", "all"), default="all")
parser.add_argument("--held-out", type=int, default=64)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-length", type=int, default=768)
parser.add_argument("--out", default=None)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rows = read_jsonl(args.data)
held, _ = held_out_prompts(rows, args.held_out, args.seed)  # every answer of the held-out prompts
scored = [row for row in held if args.answers == "all" or row.get("sampled", False) == (args.answers == "sampled")]
if not scored:
    raise SystemExit(f"{args.data}: the held-out prompts have no {args.answers} answers")
target = None
for path in args.drafter:
    drafter = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32)
    if target is None:
        target, _ = load_target(drafter.config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        target.to(device).eval()
    drafter.to(device).bind_target(target)
    batches = held_out_batches(scored, args.max_length, drafter.config.pad_token_id or 0, device)
    estimate = held_out_acceptance(drafter, target, batches, drafter.config.target_layer_ids, device)
    line = json.dumps({"drafter": path, "answers": args.answers, "sequences": len(scored),
                       **{k: round(v, 4) for k, v in estimate.items() if k != "answers"}})
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
