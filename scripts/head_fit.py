"""Fit a correction of the drafter's final rows before the target's (tied, frozen) LM head on the CPU (fp32), the
drafter itself frozen, against the target's own distributions at T = 1; report the candidates' coverage and one
draft's acceptance on held-out answers before and after.

    PYTHONPATH=<dir holding dflash2> python scripts/selector_fit.py --data answers.jsonl --stride 2 --candidates 256 \\
        --steps 0 --out /tmp/selector-fit                                   # collects rows.pt (the drafter's rows)
    PYTHONPATH=<dir holding dflash2> python scripts/head_fit.py --rows /tmp/selector-fit/rows.pt \\
        --data answers.jsonl --kind linear --rank 64 --out /tmp/head-fit

Why: at T = 1 the drafter's 64 candidates hold 0.69 of the target's probability on the rows a round can reach, where
the target's own top 64 tokens hold 0.91 (`selector_fit.py`). If the drafter's final rows h already carry what the
target will say and only the read-out is off (a head trained mostly on hard labels), a correction h' = h + f(h) fitted
to the target's T = 1 distribution lifts the coverage without touching the layers; if it does not, the rows themselves
(the layers, so training the drafter) are what hold T = 1 back. f is low-rank linear, (h A) B, or a small MLP,
W2 silu(W1 h), its output layer starting at zero so the fit starts from the shipped drafter.

The label of a row is the target's distribution (T = 1) at the token the row predicts, kept as its top `--target-top`
tokens (computed once per answer position and cached in --out); the loss is the cross-entropy of the full-vocabulary
softmax of head(h') against those, weighted by the trainer's position weights. Fitted and reported on the rows a round
can reach (every earlier row's token among its rows' candidates); held out: the last `--held-out` share of prompts, as
in `selector_fit.py`. Reported on the held-out rows and as many training rows, by depth band: the target's mass on
the drafter's top 64 and 256 tokens (within the target's top `--target-top`), the share of rows whose top token is the
target's, one sampled draft's acceptance sum_j min(p_j, q_j) with the shipped selector over the top 64, and the
cross-entropy.
"""
import argparse
import json
import os
import time

import torch

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.modeling_dflash2 import bilinear_scores
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import read_jsonl
from dflash2.training.trainer import position_weights
from selector_fit import row_layout, set_learning_rate, split_by_prompt  # scripts/ is on the path

BANDS = {"all": (1, 10 ** 6), "row 1": (1, 1), "rows 2-4": (2, 4), "rows 5-8": (5, 8), "rows 9-15": (9, 10 ** 6)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--rows", required=True, help="rows.pt written by selector_fit.py for this drafter and data")
    parser.add_argument("--data", required=True, help="the self-distilled answers the rows were collected from")
    parser.add_argument("--stride", type=int, default=None, help="the rows' anchor stride (default: what rows.pt says)")
    parser.add_argument("--target-top", type=int, default=512, help="target tokens kept per position as the label")
    parser.add_argument("--kind", choices=("linear", "mlp"), default="linear")
    parser.add_argument("--rank", type=int, default=64, help="rank of the linear map, or the MLP's width")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-rows", type=int, default=512)
    parser.add_argument("--train-rows", type=int, default=200_000, help="rows sampled once from the training share")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gamma", type=float, default=7.0, help="position weights, as the trainer's --gamma")
    parser.add_argument("--held-out", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="folder: target_top.pt (the labels), report.json")
    return parser.parse_args()


@torch.no_grad()
def target_table(drafter, sequences, top: int, path: str):
    """The target's T = 1 top `top` tokens and probabilities after every position of every sequence, flattened, with
    each sequence's offset; and the LM head's weight [V, H]. Cached at `path`."""
    if os.path.exists(path):
        return torch.load(path)
    target, _ = load_target(drafter.config, dtype=torch.float32)
    target.eval()
    ids, probs, offsets, offset = [], [], [], 0
    for number, row in enumerate(sequences):
        p, i = target(torch.tensor([row["input_ids"]])).logits[0].float().softmax(-1).topk(top, dim=-1)
        ids.append(i.int())
        probs.append(p.half())
        offsets.append(offset)
        offset += len(row["input_ids"])
        if number % 100 == 0:
            print(f"target: {number + 1}/{len(sequences)} sequences", flush=True)
    table = (torch.cat(ids), torch.cat(probs), torch.tensor(offsets),
             target.get_output_embeddings().weight.detach().float().clone())
    torch.save(table, path + ".tmp")
    os.replace(path + ".tmp", path)
    return table


class Correction(torch.nn.Module):
    """h' = h + f(h): f = (h A) B or W2 silu(W1 h); the last factor starts at zero (f = 0, the shipped drafter)."""

    def __init__(self, hidden: int, rank: int, kind: str, generator):
        super().__init__()
        self.kind = kind
        self.first = torch.nn.Parameter(torch.randn(hidden, rank, generator=generator) / hidden ** 0.5)
        self.second = torch.nn.Parameter(torch.zeros(rank, hidden))

    def forward(self, h):
        inner = h @ self.first
        return h + (torch.nn.functional.silu(inner) if self.kind == "mlp" else inner) @ self.second


@torch.no_grad()
def evaluate(rows, index, labels, head, selector, correction=None) -> dict:
    """Coverage of the top 64 / 256, top-1 agreement, one-draft acceptance (shipped selector over the top 64) and
    cross-entropy, by depth band, over rows `index`."""
    label_ids, label_probs, where = labels
    values = {name: [] for name in ("coverage, 64", "coverage, 256", "top-1 agreement", "one-draft acceptance, 64",
                                    "cross-entropy")}
    depths = []
    for first in range(0, len(index), 4096):
        part = index[first:first + 4096]
        h = rows["hidden"][part].float()
        logits = (h if correction is None else correction(h)) @ head.t()  # [n, V]
        ids, probs = label_ids[where[part]].long(), label_probs[where[part]].float()  # [n, top]
        values["cross-entropy"].append(-(probs * logits.log_softmax(-1).gather(1, ids)).sum(-1))
        unary, candidates = logits.topk(256, dim=-1)
        on_candidates = ((candidates.unsqueeze(-1) == ids.unsqueeze(1)) * probs.unsqueeze(1)).sum(-1)  # [n, 256]
        values["coverage, 64"].append(on_candidates[:, :64].sum(-1))
        values["coverage, 256"].append(on_candidates.sum(-1))
        values["top-1 agreement"].append((candidates[:, 0] == ids[:, 0]).float())
        gate = h @ selector.hidden_projection.weight.float().t()
        scores = bilinear_scores(unary[:, :64], candidates[:, :64], rows["predecessor"][part].long().unsqueeze(-1),
                                 gate, selector.predecessor_codebook.float(),
                                 selector.successor_codebook.float()).squeeze(-2)
        values["one-draft acceptance, 64"].append(torch.minimum(on_candidates[:, :64], scores.softmax(-1)).sum(-1))
        depths.append(rows["depth"][part].long())
    depth = torch.cat(depths)
    out = {}
    for name, parts in values.items():
        value = torch.cat(parts)
        out[name] = {band: round(float(value[(depth >= low) & (depth <= high)].mean()), 4)
                     for band, (low, high) in BANDS.items()}
    return out


def fit(rows, train, labels, head, args, generator) -> Correction:
    label_ids, label_probs, where = labels
    correction = Correction(rows["hidden"].shape[1], args.rank, args.kind, generator)
    optimizer = torch.optim.Adam(correction.parameters(), lr=args.lr)
    position = position_weights(int(rows["depth"].max()) + 1, args.gamma, "cpu")
    started = time.time()
    for step in range(args.steps):
        lr = set_learning_rate(optimizer, args.lr, step, args.steps, warmup=50)
        part = train[torch.randint(len(train), (args.batch_rows,), generator=generator)]
        log_q = (correction(rows["hidden"][part].float()) @ head.t()).log_softmax(-1)
        ids, probs = label_ids[where[part]].long(), label_probs[where[part]].float()
        weight = position[rows["depth"][part].long()]
        loss = (-(probs * log_q.gather(1, ids)).sum(-1) * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} ({time.time() - started:.0f} s)", flush=True)
    return correction.eval()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    drafter = DFlash2Drafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    sequences = read_jsonl(args.data)
    label_ids, label_probs, offsets, head = target_table(
        drafter, sequences, args.target_top, os.path.join(args.out, f"target_top{args.target_top}.pt"))
    loaded = torch.load(args.rows)
    rows, prompt_of_row = loaded[0], loaded[1]
    collected_from = loaded[2] if len(loaded) > 2 else {}
    stride = args.stride or int(collected_from.get("stride", 0))
    if not stride:
        raise SystemExit(f"{args.rows} does not say its anchor stride: pass --stride (selector_fit's --stride).")
    sequence_of_row, position = row_layout(sequences, drafter.config.block_size, stride)
    where = offsets[sequence_of_row] + position - 1  # the target's distribution that predicts each row's token
    if where.shape[0] != rows["depth"].shape[0]:
        raise SystemExit(f"{args.rows} holds {rows['depth'].shape[0]} rows, but {args.data} with stride {stride} "
                         f"gives {where.shape[0]}: the rows were collected from other answers or another stride.")
    labels = (label_ids, label_probs, where)
    train, held_out = split_by_prompt(prompt_of_row, args.held_out)
    held_out = held_out[rows["reachable"][held_out]]
    generator = torch.Generator().manual_seed(0)
    train = train[rows["reachable"][train]]  # the rows the report measures: the fit sees no other kind
    train = train[torch.randperm(len(train), generator=generator)[:args.train_rows]]
    print(f"{len(train)} training rows, {len(held_out)} held-out rows (rows a round can reach)", flush=True)
    selector = drafter.candidate_selector
    seen = train[:len(held_out)]  # as many training rows as held-out ones: is the fit learning at all?
    before = {"held out": evaluate(rows, held_out, labels, head, selector),
              "training rows": evaluate(rows, seen, labels, head, selector)}
    print("shipped:", json.dumps(before), flush=True)
    correction = fit(rows, train, labels, head, args, generator)
    after = {"held out": evaluate(rows, held_out, labels, head, selector, correction),
             "training rows": evaluate(rows, seen, labels, head, selector, correction)}
    print("corrected:", json.dumps(after), flush=True)
    report = {"args": vars(args), "training_rows": len(train), "held_out_rows": len(held_out), "shipped": before,
              "corrected": after}
    with open(os.path.join(args.out, "report.json.tmp"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(os.path.join(args.out, "report.json.tmp"), os.path.join(args.out, "report.json"))


if __name__ == "__main__":
    main()
