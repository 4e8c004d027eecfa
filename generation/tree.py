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

Sampling (`sample_tree`, `speculative_accept_tree`): a tree whose drafts are samples of the drafter's own proposal.
Its shape is fixed (`SampledTreeShape`: grown best-first from how often a node's first, second, ... child is the one
accepted), and each round fills it by drawing every node's children without replacement from the selector's
distribution after that node. Verification is the same one forward; acceptance is speculative sampling at every node
(recursive rejection sampling): the node's children are tested in their drawn order against the target's
distribution less what the earlier tests took, and where all fail the next token is a sample of that residual. Every
emitted token is then an exact sample of the target after what came before it, and a drafter equal to the target
would have every draft accepted. (A tree of drafts fixed before the target samples can accept a node only with the
target's probability of its token, which bounds its τ at T = 1 whatever the drafter: docs/experiments.md.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration_dflash2 import most_tree_nodes
from .sampling import cumulative_probabilities

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
    comparisons cost a CPU more than the sort)."""
    values = torch.where(values.isnan(), float("-inf"), values)
    if values.device.type == "cuda":
        return top_k_by_rank(values, k)
    top, index = values.sort(dim=-1, descending=True, stable=True)
    return top[..., :k], index[..., :k]


def top_k_by_rank(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of rows [b, M] without NaNs, best first, ties to the lower index: each entry's rank is the number of
    entries ahead of it, and slot s takes the entry of rank s. Comparisons and sums that inductor fuses; `torch.topk`
    is a library call of two kernels of its own, and the beam calls it once per draft row."""
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
    accepted, deepest, path = deepest_path(tree, follows, block_size)
    return accepted, target_tokens.gather(1, deepest.view(-1, 1)).squeeze(1), path


def deepest_path(tree: DraftTree, follows: torch.Tensor, block_size: int):
    """The deepest node whose whole root path follows (follows [b, N]: the walk goes from a node's parent into it; at
    most one child of a node does): its depth [b] (drafts accepted), the node [b] and the path [b, B] (its root path's
    node at depths 0 .. B-1; past its end, the root)."""
    follows = follows | (torch.arange(follows.shape[1], device=follows.device) == 0)  # the root always
    accepted_node = ~(tree.ancestors & ~follows.unsqueeze(1)).any(-1)  # [b, N]: the whole root path follows
    deepest = (accepted_node * (tree.depth + 1)).argmax(-1)  # [b]; unique: one child of a node follows
    accepted = tree.depth.gather(1, deepest.view(-1, 1)).squeeze(1)
    on_path = tree.ancestors.gather(1, deepest.view(-1, 1, 1).expand(-1, 1, tree.tokens.shape[1])).squeeze(1)
    at_depth = tree.depth.unsqueeze(-1) == torch.arange(block_size, device=tree.depth.device)  # [b, N, B]
    path = (on_path.unsqueeze(-1) & at_depth).long().argmax(1)  # [b, B]
    return accepted, deepest, path


# ---------------------------------------------------------------------------------------------- sampled trees
# The chance that a node's r-th sampled child (r = 0, 1, ...) is the one its rejection chain accepts, averaged over
# nodes; a sampled tree's fixed shape is grown best-first by the product of these along each root path. The rates
# measured at T = 1 (docs/experiments.md) grow the same tree of 16 nodes and a tree of 32 that differs in one node.
SAMPLED_CHILD_ACCEPTANCE = (0.45, 0.12, 0.06, 0.035, 0.02, 0.012, 0.008, 0.005)


@dataclass
class SampledTreeShape:
    """The fixed shape of a sampled tree (root first, parents before children), the same every round: node n is the
    `rank[n]`-th child of `parent[n]`, at `depth[n]`; children [N, C] lists each node's children by rank (-1: none);
    below [N] is the draft row a node's children come from (its depth; the last row for a node at the bottom, which
    has none). Only the tokens are drawn each round (`sample_tree`); a shape that depended on them would bias the
    samples."""

    parent: torch.Tensor
    rank: torch.Tensor
    depth: torch.Tensor
    children: torch.Tensor
    below: torch.Tensor
    max_depth: int  # a number on the host: a round reads it without a synchronisation

    @classmethod
    def grow(cls, nodes: int, rows: int, k: int, device=None,
             acceptance: tuple[float, ...] = SAMPLED_CHILD_ACCEPTANCE) -> "SampledTreeShape":
        """`nodes` nodes over `rows` draft rows of `k` candidates, best-first by the product of `acceptance` along
        each root path (ties to the earlier node)."""
        # past the listed ranks, each further rank half as likely (so any tree of the beam's size fits: k children)
        acceptance = list(acceptance) + [acceptance[-1] / 2 ** (r + 1) for r in range(max(0, k - len(acceptance)))]
        parent, rank, depth, value, child_count = [0], [0], [0], [1.0], [0]
        while len(parent) < nodes:
            open_nodes = [n for n in range(len(parent)) if depth[n] < rows and child_count[n] < k]
            if not open_nodes:
                raise ValueError(f"a sampled tree over {rows} rows of {k} candidates has fewer than {nodes} nodes")
            best = max(open_nodes, key=lambda n: (value[n] * acceptance[child_count[n]], -n))
            parent.append(best)
            rank.append(child_count[best])
            depth.append(depth[best] + 1)
            value.append(value[best] * acceptance[child_count[best]])
            child_count[best] += 1
            child_count.append(0)
        width = max(child_count)
        children = [[-1] * width for _ in range(nodes)]
        for n in range(1, nodes):
            children[parent[n]][rank[n]] = n
        long = dict(dtype=torch.long, device=device)
        depth_tensor = torch.tensor(depth, **long)
        return cls(torch.tensor(parent, **long), torch.tensor(rank, **long), depth_tensor,
                   torch.tensor(children, **long), depth_tensor.clamp(max=rows - 1), max(depth))


@dataclass
class SampledTree:
    """A tree whose children were sampled from the drafter's proposal: `tree` (tokens, depth, parent, ancestors);
    candidates [b, R, K] (every draft row's); index [b, N] (each node's candidate in its row; the root 0); proposal
    [b, N, K] (q after each node, over the candidates of the row below it)."""

    tree: DraftTree
    candidates: torch.Tensor
    index: torch.Tensor
    proposal: torch.Tensor


def sample_tree(anchor: torch.Tensor, candidates: torch.Tensor, pairs: torch.Tensor, shape: SampledTreeShape,
                temperature: torch.Tensor, gumbel: torch.Tensor) -> SampledTree:
    """Fill `shape` with sampled drafts. Each node's children are a sample without replacement from the selector's
    proposal after it, q = softmax(pairs / T) over the next row's candidates: the first `C` of the node's Gumbel-
    perturbed log q (gumbel [b, N, K], the node's own noise), in that order, so its r-th child is a sample of q with
    the earlier children removed. candidates [b, R, K]; pairs [b, R, K, K]; temperature [b]; anchor [b]."""
    batch, rows, k = candidates.shape
    log_q = (pairs.float() / temperature.view(-1, 1, 1, 1)).log_softmax(-1)  # [b, R, K, K]
    log_q_below = log_q[:, shape.below]  # [b, N, K, K]: the row below each node, after each candidate of its row
    most_children = shape.children.shape[1]
    index = torch.zeros(batch, shape.parent.shape[0], dtype=torch.long, device=candidates.device)
    for _ in range(shape.max_depth):  # depth d's indices are final after d passes
        after = log_q_below.gather(2, index.view(batch, -1, 1, 1).expand(-1, -1, 1, k)).squeeze(2)  # [b, N, K]
        order = stable_top_k(after + gumbel, most_children)[1]  # [b, N, C]
        chosen = order[:, shape.parent].gather(2, shape.rank.view(1, -1, 1).expand(batch, -1, 1)).squeeze(2)
        index = torch.where(shape.depth > 0, chosen, torch.zeros_like(chosen))
    after = log_q_below.gather(2, index.view(batch, -1, 1, 1).expand(-1, -1, 1, k)).squeeze(2)
    row_of_node = (shape.depth - 1).clamp(min=0)  # [N]
    tokens = candidates[:, row_of_node].gather(2, index.unsqueeze(-1)).squeeze(-1)  # [b, N]
    tokens = torch.where(shape.depth > 0, tokens, anchor.view(-1, 1).to(tokens))
    depth, parent = shape.depth.expand(batch, -1), shape.parent.expand(batch, -1)
    return SampledTree(DraftTree(tokens, depth, parent, ancestor_matrix(parent, rows)), candidates, index, after.exp())


def speculative_accept_tree(sampled: SampledTree, shape: SampledTreeShape, target_probs: torch.Tensor,
                            uniform: torch.Tensor, final_uniform: torch.Tensor, block_size: int):
    """Exact speculative sampling over a sampled tree (recursive rejection sampling without replacement).

    At every node, its children are tested in their sampled order: child c (candidate j) is accepted when
    u_c * q(j) < r(j), r the target's distribution after the node (target_probs [b, N, V], warped) less what the
    earlier children's tests took; on a rejection r <- max(r - q, 0) and q <- q without j, renormalised. The walk
    goes from the root into each node's accepted child; where none is, the next token is a sample of that node's
    residual r (by inverse CDF with final_uniform [b]). Each node's chain uses only its own children's uniforms
    (uniform [b, N]), so all chains run at once, the walk afterwards. Returns accepted [b], next_token [b], path
    [b, B] as `accept_tree` does."""
    tree, candidates = sampled.tree, sampled.candidates
    batch = candidates.shape[0]
    next_candidates = candidates[:, shape.below]  # [b, N, K]
    residual = target_probs.gather(2, next_candidates)  # [b, N, K]: r at each node's child candidates (unnormalised)
    total = torch.ones(batch, residual.shape[1], device=residual.device)  # [b, N]: r's total mass
    q = sampled.proposal
    accepted_child = torch.full_like(sampled.index, -1)  # [b, N]
    for r in range(shape.children.shape[1]):
        child = shape.children[:, r]  # [N]
        j = sampled.index[:, child.clamp(min=0)].unsqueeze(-1)  # [b, N, 1]: the child's candidate
        q_j, r_j = q.gather(2, j).squeeze(-1), residual.gather(2, j).squeeze(-1)
        test = (child >= 0) & (accepted_child < 0)
        accept = test & (uniform[:, child.clamp(min=0)] * q_j * total < r_j)
        reject = test & ~accept
        shrunk = (residual - total.unsqueeze(-1) * q).clamp(min=0)
        total = torch.where(reject, (total - (residual - shrunk).sum(-1)).clamp(min=0), total)
        residual = torch.where(reject.unsqueeze(-1), shrunk, residual)
        rest = q.scatter(2, j, 0.0)
        q = torch.where(reject.unsqueeze(-1), rest / rest.sum(-1, keepdim=True).clamp(min=1e-30), q)
        accepted_child = torch.where(accept, child, accepted_child)
    follows = accepted_child.gather(1, tree.parent) == torch.arange(tree.tokens.shape[1], device=q.device)
    accepted, deepest, path = deepest_path(tree, follows, block_size)
    # the deepest node's residual over the whole vocabulary: its target distribution, less what its children took
    final = target_probs.gather(1, deepest.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    pick = deepest.view(-1, 1, 1).expand(-1, 1, residual.shape[-1])
    taken = final.scatter(1, next_candidates.gather(1, pick).squeeze(1), residual.gather(1, pick).squeeze(1))
    final = torch.where(taken.sum(-1, keepdim=True) > 0, taken, final)  # an empty residual: probability 0
    return accepted, sample_by_inverse_cdf(final.log(), final_uniform), path


def sample_by_inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [..., V] (-inf: never drawn): the first whose cumulative probability passes
    uniform [...] times the total; should rounding put that at the total, the last token with a finite logit."""
    cumulative = cumulative_probabilities(logits)
    drawn = (cumulative <= uniform.unsqueeze(-1) * cumulative[..., -1:]).sum(-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    return torch.minimum(drawn, (logits.isfinite() * vocab).amax(-1))
