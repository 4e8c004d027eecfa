"""Ceiling on τ at a sampling temperature T (default 1) for ANY verification over the drafter's current candidate rows,
on the CPU in fp32: how far better proposals, trees or selectors could take the shipped drafter without better
candidates.

    PYTHONPATH=<dir holding dflash2> python scripts/t1_candidate_ceiling.py --task mtbench --num-prompts 80 \\
        --new 128 --out /tmp/t1_candidate_ceiling.json        # ~10 min on one CPU core

Every token a round accepts is one of the K candidates of its draft row (the drafter's top K unary tokens of that
row, fixed before the target verifies), and lossless sampling emits the target's own samples. So a round that starts
at anchor position i accepts at most the length of the run of the target's next tokens x_{i+1}, x_{i+2}, ... that lie
in the candidates of rows 1, 2, ... (at most block - 1), whatever its proposal, tree shape or width; it then emits one
more token. For each prompt the target samples `--new` tokens at T (seeded by the prompt's index); rounds are walked
along that sample, each starting where the last one's run ended (as the best possible acceptance would), with the
drafter's candidates computed from the target's features of every position before the anchor (the loop's context).
Reported per category: this ceiling (emitted tokens over rounds) and the mean coverage of the first row (the target's
probability mass on its candidates at the anchor's next position, the chance the first draft can be accepted at all).
The ceiling does not bound a drafter with other candidates (more of them, or another drafter).
"""
import argparse
import json
import os
import time
from collections import defaultdict

import torch

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.modeling_dflash2 import tap_target_features
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import chat_prompt_ids, task_categories, task_prompts


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--candidates", type=int, default=None, help="candidates per row (default: the config's)")
    parser.add_argument("--task", default="mtbench")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--new", type=int, default=128, help="tokens the target samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


@torch.no_grad()
def candidate_rows(drafter, features, sequence, anchor: int) -> torch.Tensor:
    """The drafter's candidates [B-1, K] for the block after position `anchor` of `sequence` [1, L], read from the
    target's features [1, L, taps * H] of every position before it."""
    block = drafter.config.block_size
    ids = torch.full((1, block), drafter.config.mask_token_id, dtype=torch.long)
    ids[0, 0] = sequence[0, anchor]
    hidden = drafter(input_ids=ids, context_hidden_states=features[:, :anchor],
                     position_ids=torch.arange(anchor + block).view(1, -1)).last_hidden_state
    candidates, _ = drafter.candidate_scores(ids[:, 0], hidden)
    return candidates[0]


@torch.no_grad()
def walk(drafter, target, prompt_ids, new: int, temperature: float, seed: int):
    """Rounds along the target's own sample: (emitted tokens, rounds, first-row coverages)."""
    torch.manual_seed(seed)
    sequence = target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                               temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new)
    out = target(sequence, output_hidden_states=True)
    features = tap_target_features(out.hidden_states, drafter.config.target_layer_ids)
    probs = (out.logits[0].float() / temperature).softmax(-1)  # [L, V]: the target's distribution after each position
    length, block = sequence.shape[1], drafter.config.block_size
    anchor, emitted, rounds, coverage = prompt_ids.shape[1], 0, 0, []
    while anchor < length - 1:
        candidates = candidate_rows(drafter, features, sequence, anchor)
        run = 0
        while run < block - 1 and anchor + run + 1 < length and \
                bool((candidates[run] == sequence[0, anchor + run + 1]).any()):
            run += 1
        coverage.append(float(probs[anchor, candidates[0]].sum()))
        emitted += min(run + 1, length - anchor)
        rounds += 1
        anchor += run + 1
    return emitted, rounds, coverage


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    overrides = {"selector_top_k": args.candidates} if args.candidates else {}
    drafter = DFlash2Drafter.from_pretrained(args.drafter, dtype=torch.float32, **overrides).eval()
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    target.eval()
    drafter.attach(target)
    prompts = task_prompts(args.task, args.num_prompts, skip=args.skip)
    categories = task_categories(args.task, args.num_prompts, skip=args.skip)
    per_category = defaultdict(lambda: [0, 0, []])
    rows, started = [], time.perf_counter()
    for index, (prompt, category) in enumerate(zip(prompts, categories)):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        emitted, rounds, coverage = walk(drafter, target, ids, args.new, args.temperature, args.skip + index)
        rows.append({"prompt": args.skip + index, "category": category, "emitted": emitted, "rounds": rounds,
                     "first_row_coverage": round(sum(coverage) / len(coverage), 4)})
        entry = per_category[category]
        entry[0], entry[1] = entry[0] + emitted, entry[1] + rounds
        entry[2] += coverage
        print(f"{args.skip + index} {category}: ceiling {emitted / rounds:.2f} ({time.perf_counter() - started:.0f} s)",
              flush=True)
    table = {c: {"ceiling": round(e / r, 3), "first_row_coverage": round(sum(cov) / len(cov), 3)}
             for c, (e, r, cov) in per_category.items()}
    total_e, total_r = sum(r["emitted"] for r in rows), sum(r["rounds"] for r in rows)
    all_coverage = [c for e in per_category.values() for c in e[2]]
    table["all"] = {"ceiling": round(total_e / total_r, 3),
                    "first_row_coverage": round(sum(all_coverage) / len(all_coverage), 3)}
    print("| category | τ ceiling over these candidates | first row's coverage |")
    print("| --- | --- | --- |")
    for category, entry in table.items():
        print(f"| {category} | {entry['ceiling']:.2f} | {entry['first_row_coverage']:.3f} |")
    if args.out:
        report = {"args": vars(args), "candidates": drafter.config.selector_top_k, "table": table, "prompts": rows}
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
