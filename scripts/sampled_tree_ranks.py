"""How often a sampled tree's r-th child is the one accepted, on the CPU in fp32: the measurement behind
`generation/tree.py`'s SAMPLED_CHILD_ACCEPTANCE (the shape's growth profile).

    python scripts/sampled_tree_ranks.py TASK SKIP PROMPTS NEW_TOKENS [NODES]

Runs sampled generation (T = 1, top-p 1) with a wide sampled tree (NODES, default 64) and counts, at every node a
round's walk reached, how its children's tests came out by rank: the hazard h_r (the r-th child accepted after the
earlier ones were rejected) and a_r = h_r * prod_{i<r} (1 - h_i), the chance that the r-th child is the accepted one.

Then, by depth on the walk (every node with children that a walk reached, the context of a true sample of the
target): how often one of its children was accepted; the target's probability mass on the K candidates of the row
below it (coverage: no verification of drafts among those candidates accepts more often, since every accepted token
is one of them); the overlap sum_j min(p_j, q_j) of the target's and the drafter's proposal over them (one draft's
acceptance); and the target's largest probability there. At T = 1 these say how much of the round's loss lies in
the verification and how much in the drafter's candidates.
"""
import sys

import torch

import dflash2.generation.round_core as round_core
from dflash2.generation import DFlash2Drafter, load_target
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import chat_prompt_ids, task_prompts

torch.set_num_threads(1)
task, skip, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
nodes = int(sys.argv[5]) if len(sys.argv) > 5 else 64
tested = torch.zeros(64)
taken = torch.zeros(64)
by_depth = torch.zeros(16, 5)  # per depth: nodes reached, a child accepted, coverage, overlap, largest probability
original = round_core.speculative_accept_tree


def counting(sampled, shape, target_probs, *args):
    accepted, next_token, path = original(sampled, shape, target_probs, *args)
    children = shape.children.tolist()
    p = target_probs.gather(2, sampled.candidates[:, shape.below])  # [b, N, K]: p at the candidates below each node
    overlap = torch.minimum(p, sampled.proposal).sum(-1)  # [b, N]
    for row in range(path.shape[0]):
        nodes_on_path = path[row, : int(accepted[row]) + 1].tolist()
        for depth, node in enumerate(nodes_on_path):
            kids = [c for c in children[node] if c >= 0]
            if kids:  # a leaf of the shape has no children to accept
                by_depth[depth] += torch.tensor([1.0, float(depth < int(accepted[row])), p[row, node].sum(),
                                                 overlap[row, node], target_probs[row, node].max()])
            chosen = nodes_on_path[depth + 1] if depth + 1 < len(nodes_on_path) else None
            for rank, child in enumerate(kids):
                tested[rank] += 1
                if child == chosen:
                    taken[rank] += 1
                    break
    return accepted, next_token, path


round_core.speculative_accept_tree = counting
drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32)
target, tokenizer = load_target(drafter.config, dtype=torch.float32)
drafter.attach(target)
for index, prompt in enumerate(task_prompts(task, n, skip=skip)):
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    torch.manual_seed(index)
    target.generate(ids, assistant_model=drafter, max_new_tokens=new, cache_implementation="static",
                    tree_nodes=nodes, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
survive = 1.0
for rank in range(16):
    if tested[rank] == 0:
        break
    hazard = float(taken[rank] / tested[rank])
    print(f"rank {rank}: tested {int(tested[rank])}, hazard {hazard:.3f}, a_r {survive * hazard:.4f}")
    survive *= 1 - hazard
print("depth  nodes  child accepted  coverage  overlap  p max")
for depth in range(16):
    count, *sums = by_depth[depth].tolist()
    if count:
        print(f"{depth:5d}  {int(count):5d}  " + "  ".join(f"{x / count:.3f}" for x in sums))
