"""Tree verification: draft a small tree from the drafter's candidates, verify every node in one target forward, keep
the longest root path the target's own greedy tokens follow.

Each round the drafter holds the top K candidates of every block row and the selector's pair scores between the
candidates of neighbouring rows (`DFlash2DraftModel.candidate_scores`). The path round keeps one walk through them;
when the target disagrees at row t, the rest of the block is lost although its token was often another candidate
there. A tree keeps several: `draft_tree` runs a beam of `width` partial paths down the rows (each step extends every
beam path by every candidate and keeps the `width` best by the sum of their log-probabilities under the selector's
softmax), then keeps the `nodes - 1` best of all the beam's nodes by that sum, plus the root (the anchor). A node's
sum never exceeds its parent's, and a tie is broken towards the shallower node, so the kept nodes form a tree: every
node's parent is kept, and comes before it in node order.

Every shape is fixed by (batch, block, K, width, nodes), so a round with a tree is captured and fused like the path
round. Greedy acceptance (`accept_tree`): a node is accepted when every node on its root path is the target's argmax
after its parent; the deepest accepted node ends the accepted path, and the target's token after it is the bonus
token. The accepted path, in depth order, takes the place of the path round's block: its tokens are emitted and its
keys and tapped features are moved to the columns of depths 0 .. B-1 (`RoundCore.tree_round`).

Sampling (`RoundCore.node_tokens`): the target's token after each node is a sample of its warped distribution instead
of its argmax, drawn with noise of the node's own, and acceptance is the same walk. A token emitted is then always a
sample of the target after what was emitted before it, so the output follows the target's distribution exactly; the
tree only decides how many samples a round keeps (a child is walked into when it holds its parent's sample, which
happens with the target's probability of that child's token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configuration_dflash2 import most_tree_nodes

# Breaks ties of the log-probability sums towards the shallower node, so that a child never outranks its parent.
# Sums lie within a few hundred of zero, where fp32 resolves ~1e-5: the step is far above that and far below any real
# difference between two candidates' scores that matters.
DEPTH_TIE_BREAK = 1e-3


@dataclass
class DraftTree:
    """A drafted tree of `nodes` nodes per row, node 0 the root (the anchor), parents before children.

    tokens [b, N]; depth [b, N] (root 0); parent [b, N] (node index; the root its own parent);
    ancestors [b, N, N] bool: ancestors[r, n, m] when node m lies on node n's root path (n itself included).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestors: torch.Tensor


def draft_tree(anchor: torch.Tensor, candidates: torch.Tensor, pairs: torch.Tensor, nodes: int,
               width: int) -> DraftTree:
    """The tree of `nodes` nodes (root included) from candidates [b, R, K] and pair scores [b, R, K, K] (see
    `DFlash2DraftModel.candidate_scores`), anchor [b]."""
    batch, rows, k = candidates.shape
    width = min(width, k)
    if not 1 < nodes <= most_tree_nodes(rows + 1, width, k):
        raise ValueError(f"tree_nodes={nodes}: a tree of width {width} over {rows} draft rows has 2 .. "
                         f"{most_tree_nodes(rows + 1, width, k)} nodes.")
    log_q = pairs.float().log_softmax(-1)  # [b, R, K, K]: the selector's proposal of row t after each predecessor
    # ---- the beam: per depth t+1, `width` (candidate, parent beam slot, sum of log-probabilities)
    sums, choice = stable_top_k(log_q[:, 0, 0], width)  # [b, W]: row 0 follows the anchor
    beam_choice, beam_parent, beam_sum = [choice], [torch.zeros_like(choice)], [sums]
    for t in range(1, rows):
        step = log_q[:, t].gather(1, choice.unsqueeze(-1).expand(-1, -1, k))  # [b, W, K]: after each beam path
        sums, flat = stable_top_k((sums.unsqueeze(-1) + step).flatten(1), width)  # [b, W]
        parent_slot, choice = flat // k, flat % k
        beam_choice.append(choice)
        beam_parent.append(parent_slot)
        beam_sum.append(sums)
    pool_choice = torch.stack(beam_choice, 1)  # [b, R, W]
    pool_parent = torch.stack(beam_parent, 1)  # [b, R, W]: slot at the depth above
    pool_sum = torch.stack(beam_sum, 1)  # [b, R, W]
    depth_of_row = torch.arange(1, rows + 1, device=candidates.device).view(1, -1, 1)
    # ---- the best nodes - 1 of the pool, parents first (a child's key is strictly below its parent's)
    key = (pool_sum - DEPTH_TIE_BREAK * depth_of_row).flatten(1)  # [b, R*W]
    kept = stable_top_k(key, nodes - 1)[1]  # [b, N-1] pool index t * W + w, in decreasing key
    depth = kept // width + 1
    tokens = candidates.flatten(1).gather(1, (depth - 1) * k + pool_choice.flatten(1).gather(1, kept))
    parent_pool = (depth - 2) * width + pool_parent.flatten(1).gather(1, kept)  # depth 1: the root (-1 + ... < 0)
    node_of_pool = torch.zeros(batch, rows * width, dtype=torch.long, device=candidates.device)
    node_of_pool.scatter_(1, kept, torch.arange(1, nodes, device=candidates.device).expand(batch, -1))
    parent = torch.where(depth > 1, node_of_pool.gather(1, parent_pool.clamp(min=0)), torch.zeros_like(depth))
    zero = torch.zeros(batch, 1, dtype=torch.long, device=candidates.device)
    tokens = torch.cat([anchor.view(-1, 1).to(tokens), tokens], dim=1)
    depth, parent = torch.cat([zero, depth], dim=1), torch.cat([zero, parent], dim=1)
    return DraftTree(tokens, depth, parent, ancestor_matrix(parent, rows))


def stable_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.topk(k, dim=-1)` over short rows [b, M] in a stable sort's order: best first, ties to the lower index,
    a NaN counted as -inf. On CUDA by rank (`top_k_by_rank`); elsewhere by a stable sort (the rank's M x M
    comparisons cost a CPU more than the sort: 0.85 against 0.33 ms for a fused 16-node tree)."""
    values = torch.where(values.isnan(), float("-inf"), values)
    if values.device.type == "cuda":
        return top_k_by_rank(values, k)
    top, index = values.sort(dim=-1, descending=True, stable=True)
    return top[..., :k], index[..., :k]


def top_k_by_rank(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of rows [b, M] without NaNs, best first, ties to the lower index: each entry's rank is the number of
    entries ahead of it, and slot s takes the entry of rank s. Comparisons and sums that inductor fuses; `torch.topk`
    is a library call of two kernels of its own, and the beam calls it once per draft row (on an H200 they took
    0.23 ms of a 2.3 ms round with a tree of 16 nodes)."""
    position = torch.arange(values.shape[-1], device=values.device)
    other, this = values.unsqueeze(-2), values.unsqueeze(-1)  # [b, 1, M], [b, M, 1]
    ahead = (other > this) | ((other == this) & (position < position.unsqueeze(-1)))  # [b, M, M]: j ahead of i
    rank = ahead.sum(-1)  # [b, M], a permutation of 0 .. M-1
    slot = torch.arange(k, device=values.device).unsqueeze(-1)  # [k, 1]
    index = ((rank.unsqueeze(-2) == slot) * position).sum(-1)  # [b, k]
    return values.gather(-1, index), index


def ancestor_matrix(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """ancestors [b, N, N] from parent [b, N] (root its own parent): the reflexive-transitive closure of the parent
    relation, by repeated squaring (paths of up to `max_depth` steps)."""
    nodes = parent.shape[1]
    eye = torch.eye(nodes, device=parent.device)
    # self or parent (a comparison, not one_hot: one_hot reads the indices' range on the host, breaking a capture)
    reach = eye + (parent.unsqueeze(-1) == torch.arange(nodes, device=parent.device)).float()
    covered = 1
    while covered < max_depth:
        reach = (reach @ reach).clamp(max=1.0)
        covered *= 2
    return reach > 0


def accept_tree(tree: DraftTree, target_tokens: torch.Tensor, block_size: int):
    """Greedy acceptance over a tree. target_tokens [b, N]: the target's argmax after each node.

    Returns accepted [b] (drafts accepted, the depth of the deepest accepted node), next_token [b] (the target's
    token after it) and path [b, B] (the accepted path's node at depths 0 .. B-1; past its end, the root)."""
    follows = tree.tokens == target_tokens.gather(1, tree.parent)  # [b, N]: the target's choice after the parent
    follows[:, 0] = True
    accepted_node = ~(tree.ancestors & ~follows.unsqueeze(1)).any(-1)  # [b, N]: the whole root path follows
    deepest = (accepted_node * (tree.depth + 1)).argmax(-1)  # [b]; unique: siblings hold distinct tokens
    accepted = tree.depth.gather(1, deepest.view(-1, 1)).squeeze(1)
    next_token = target_tokens.gather(1, deepest.view(-1, 1)).squeeze(1)
    on_path = tree.ancestors.gather(1, deepest.view(-1, 1, 1).expand(-1, 1, tree.tokens.shape[1])).squeeze(1)
    at_depth = tree.depth.unsqueeze(-1) == torch.arange(block_size, device=tree.depth.device)  # [b, N, B]
    path = (on_path.unsqueeze(-1) & at_depth).long().argmax(1)  # [b, B]
    return accepted, next_token, path
