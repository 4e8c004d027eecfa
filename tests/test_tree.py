"""Tree verification (generation/tree.py, RoundCore.tree_round): the vectorised pieces against naive loops, and tree
decoding against plain greedy on hundreds of random cases (tiny targets and vocabularies, so that side branches win;
an oracle plants each row's true continuation along a random root path of the tree, so rounds accept deep paths that
are not the beam's best)."""

import random

import pytest
import torch

from dflash2.generation.round_core import RoundCore
from dflash2.generation.sampling import Sampling
from dflash2.generation.tree import (DEPTH_TIE_BREAK, SAMPLED_CHILD_ACCEPTANCE, SampledTreeShape, accept_tree,
                                     draft_tree, sample_by_inverse_cdf, sample_tree, speculative_accept_tree,
                                     stable_top_k, top_k_by_rank)
from dflash2.tasks import left_padded as left_pad
from helpers import EOS, assert_follows, check_sampling_is_exact, sampling_case, sliding_qwen3, tiny_drafter, tiny_target


# ---------------------------------------------------------------------------------------------- naive references
def naive_tree_paths(candidates, pairs, nodes, width):
    """The kept nodes of one row as root paths of token ids, by a plain beam search over Python lists."""
    rows, k = candidates.shape
    log_q = pairs.float().log_softmax(-1)
    beam = [(0.0, ())]  # (sum of log-probabilities, candidate indices along the path)
    pool = []
    for t in range(rows):
        grown = []
        for total, path in beam:
            before = path[-1] if path else 0
            grown += [(total + float(log_q[t, before, j]), path + (j,)) for j in range(k)]
        beam = sorted(grown, key=lambda item: -item[0])[: min(width, k)]
        pool += beam
    pool.sort(key=lambda item: -(item[0] - DEPTH_TIE_BREAK * len(item[1])))
    return {tuple(int(candidates[t, j]) for t, j in enumerate(path)) for _, path in pool[: nodes - 1]}


def tree_paths(tree, row):
    """The root paths (token ids after the root) of one row's nodes."""
    parent, tokens = tree.parent[row].tolist(), tree.tokens[row].tolist()
    paths = set()
    for node in range(1, len(tokens)):
        path = []
        while node != 0:
            path.append(tokens[node])
            node = parent[node]
        paths.add(tuple(reversed(path)))
    return paths


def naive_accept(tree, target_tokens, row):
    """Walk down from the root: follow the child holding the target's token after the current node."""
    parent, tokens, targets = tree.parent[row].tolist(), tree.tokens[row].tolist(), target_tokens[row].tolist()
    node, path = 0, [0]
    while True:
        children = [n for n in range(1, len(tokens)) if parent[n] == node and tokens[n] == targets[node]]
        if not children:
            return len(path) - 1, targets[node], path
        node = children[0]
        path.append(node)


def random_scores(batch, rows, k, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.stack([torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(rows)])
                              for _ in range(batch)])
    pairs = torch.randn(batch, rows, k, k, generator=generator) * 2
    pairs[:, 0] = pairs[:, 0, :1]  # row 0 follows the anchor: the same scores after every "predecessor"
    return candidates, pairs


def test_both_top_ks_equal_a_naive_stable_sort_with_ties_infinities_and_nans():
    """`stable_top_k` (the beam's: a sort on a CPU) and `top_k_by_rank` (its CUDA path) against Python's sorted."""
    generator = torch.Generator().manual_seed(0)
    for case in range(60):
        length = int(torch.randint(1, 260, (1,), generator=generator))
        k = int(torch.randint(1, length + 1, (1,), generator=generator))
        values = torch.randn(3, length, generator=generator)
        if case % 2:  # many ties
            values = torch.randint(-3, 3, (3, length), generator=generator).float()
        if case % 3 == 0:
            values[:, ::4] = float("-inf")
        if case % 5 == 0:
            values[:, 1::7] = float("nan")
        cleaned = torch.where(values.isnan(), float("-inf"), values)
        for top, index in (stable_top_k(values, k), top_k_by_rank(cleaned, k)):
            for row in range(3):
                keyed = cleaned[row].tolist()
                expected = sorted(range(length), key=lambda i: (-keyed[i], i))[:k]  # best first, lower index first
                assert index[row].tolist() == expected
                assert top[row].tolist() == [keyed[i] for i in expected]


@pytest.mark.parametrize("batch,rows,k,width,nodes", [(1, 3, 4, 2, 5), (3, 7, 8, 4, 29), (2, 15, 16, 4, 32),
                                                      (2, 15, 16, 8, 64), (4, 5, 6, 1, 6), (2, 7, 5, 3, 9)])
def test_draft_tree_keeps_the_naive_beams_best_nodes(batch, rows, k, width, nodes):
    for seed in range(4):
        candidates, pairs = random_scores(batch, rows, k, 50, seed)
        anchor = torch.arange(batch)
        tree = draft_tree(anchor, candidates, pairs, nodes, width)
        assert tree.tokens.shape == (batch, nodes) and torch.equal(tree.tokens[:, 0], anchor)
        for row in range(batch):
            assert tree_paths(tree, row) == naive_tree_paths(candidates[row], pairs[row], nodes, width)
            parent = tree.parent[row].tolist()
            assert all(parent[n] < n for n in range(1, nodes)), "parents come before children"
            assert all(tree.depth[row, n] == tree.depth[row, parent[n]] + 1 for n in range(1, nodes))
            for n in range(nodes):  # ancestors: exactly the nodes on n's root path
                on_path, node = {n}, n
                while node != 0:
                    node = parent[node]
                    on_path.add(node)
                assert set(torch.nonzero(tree.ancestors[row, n]).flatten().tolist()) == on_path


def test_the_beam_by_rank_drafts_the_same_trees_as_by_sort(monkeypatch):
    """On CUDA the beam ranks instead of sorting: the same trees, ties included (run here on the CPU)."""
    from dflash2.generation import tree as tree_module

    for seed, (rows, k, width, nodes) in enumerate([(15, 16, 16, 16), (7, 5, 3, 9), (15, 16, 4, 32)] * 3):
        candidates, pairs = random_scores(2, rows, k, 50, seed)
        if seed % 3 == 2:
            pairs = pairs.round()  # ties among sums
        anchor = torch.tensor([1, 2])
        by_sort = draft_tree(anchor, candidates, pairs, nodes, width)
        with monkeypatch.context() as patch:
            patch.setattr(tree_module, "stable_top_k", top_k_by_rank)
            by_rank = draft_tree(anchor, candidates, pairs, nodes, width)
        for field in ("tokens", "depth", "parent", "ancestors"):
            assert torch.equal(getattr(by_sort, field), getattr(by_rank, field)), (seed, field)


def test_ties_never_orphan_a_node():
    """Certain candidates (log-probability 0 in fp32) tie a child with its parent: the parent still comes first."""
    candidates, pairs = random_scores(2, 7, 4, 20, 0)
    pairs[:, :, :, 0] = 1e4  # candidate 0 certain after everything
    tree = draft_tree(torch.zeros(2, dtype=torch.long), candidates, pairs, 12, 3)
    parent = tree.parent.tolist()
    assert all(parent[r][n] < n for r in range(2) for n in range(1, 12))
    assert tree.depth[:, 1:8].tolist() == [list(range(1, 8))] * 2  # the certain chain, shallowest first


@pytest.mark.parametrize("width,nodes", [(2, 9), (4, 29), (1, 8)])
def test_accept_tree_equals_the_naive_walk(width, nodes):
    rng = random.Random(width)
    for seed in range(30):
        candidates, pairs = random_scores(3, 7, 5, 6, seed)  # 6 tokens: targets often match some node
        tree = draft_tree(torch.tensor([1, 2, 3]), candidates, pairs, nodes, width)
        targets = torch.randint(0, 6, tree.tokens.shape, generator=torch.Generator().manual_seed(seed))
        for row in range(3):  # plant a followed root path of random depth
            node = rng.randrange(nodes)
            while node != 0:
                parent = int(tree.parent[row, node])
                targets[row, parent] = tree.tokens[row, node]
                node = parent
        accepted, next_token, path = accept_tree(tree, targets, 8)
        for row in range(3):
            want_accepted, want_next, want_path = naive_accept(tree, targets, row)
            assert (int(accepted[row]), int(next_token[row])) == (want_accepted, want_next)
            got = tree.tokens[row, path[row, : want_accepted + 1]].tolist()
            assert got == tree.tokens[row, want_path].tolist()


# ---------------------------------------------------------------------------------------------- decoding
@pytest.fixture
def planted(monkeypatch):
    """RoundCore.draft_tree with each row's true continuation (state["references"], new tokens) written along the
    root path of a random node, for a random number of depths: the accepted path is often a side branch."""
    state = {"references": None, "rng": random.Random(0), "side_wins": 0}
    original = RoundCore.draft_tree

    def draft(self, hidden):
        tree = original(self, hidden)
        if state["references"] is None:
            return tree
        rng = state["rng"]
        for row, emitted in enumerate(self.output_length.tolist()[: len(state["references"])]):
            if rng.random() < 0.25:
                continue  # the tree as drafted
            truth = state["references"][row][emitted:]
            node = rng.randrange(1, tree.tokens.shape[1])
            usable = rng.randint(0, len(truth))
            while node != 0:
                depth = int(tree.depth[row, node])
                if depth <= usable:
                    tree.tokens[row, node] = truth[depth - 1]
                node = int(tree.parent[row, node])
        return tree

    def accept(tree, target_tokens, block_size):
        accepted, next_token, path = accept_tree(tree, target_tokens, block_size)
        best_first = tree.depth[:, 1:].eq(1).long().argmax(-1) + 1  # the beam's best depth-1 node
        state["side_wins"] += int(((accepted > 0) & (path[:, 1] != best_first)).sum())
        return accepted, next_token, path

    monkeypatch.setattr(RoundCore, "draft_tree", draft)
    monkeypatch.setattr("dflash2.generation.round_core.accept_tree", accept)
    return state


def plain_alone(target, prompt, max_new, eos):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def run_random_cases(cases, planted, seed=0):
    """Random (target, drafter, tree, batch, prompts, max_new, eos) cases; each row against plain greedy alone."""
    rng = random.Random(seed)
    pairs = {}
    equal = total = 0
    for case in range(cases):
        arch, vocab, block = rng.choice([("llama", 8, 4), ("llama", 12, 8), ("qwen3", 16, 4), ("sliding", 10, 8),
                                         ("qwen3", 24, 8), ("llama", 10, 16)])
        if (arch, vocab, block) not in pairs:
            target = sliding_qwen3(vocab, 3, layers=4, window=6) if arch == "sliding" else tiny_target(arch, seed=vocab, vocab=vocab,
                                                                                     layers=3)
            drafter = tiny_drafter(target, seed=block, block_size=block, selector_top_k=min(6, vocab),
                                   tree_width=rng.choice([2, 3, 4]), target_layer_ids=[0, 2]).attach(target)
            pairs[arch, vocab, block] = target, drafter
        target, drafter = pairs[arch, vocab, block]
        most = 1 + (block - 1) * min(drafter.config.tree_width, drafter.config.selector_top_k)
        nodes = rng.choice([2, 3, block, rng.randint(2, most), most])
        batch = rng.choice([1, 1, 2, 3, 4])
        max_new = rng.randint(1, 30)
        eos = rng.choice([None, EOS % vocab, rng.randrange(2, vocab)])
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))] for _ in range(batch)]
        references = [plain_alone(target, p, max_new, eos) for p in prompts]
        planted["references"] = [r + [0] * block for r in references]
        ids, mask = left_pad(prompts, 0)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                              max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0,
                              cache_implementation="static", tree_nodes=nodes)
        planted["references"] = None
        for row, reference in enumerate(references):
            got = out[row, ids.shape[1]: ids.shape[1] + len(reference)].tolist()
            equal += got == reference
            total += 1
    return equal, total


def test_tree_decoding_equals_plain_greedy_on_hundreds_of_random_cases(planted):
    equal, total = run_random_cases(220, planted, seed=1)
    print(f"\n[tree, fp32] 220 cases, {total} rows equal to plain greedy: {equal}; side branches won "
          f"{planted['side_wins']} rounds")
    assert equal == total, f"{total - equal} of {total} rows differ from plain greedy"
    assert planted["side_wins"] > 100, planted["side_wins"]


def test_a_tree_drafts_more_per_round_than_the_path_on_a_tiny_vocabulary():
    """Without any oracle: over a tiny vocabulary the target's token is often another candidate, so a tree of the
    beam's best nodes accepts more per verification than the walk's one path."""
    target = tiny_target("llama", seed=5, vocab=8, layers=3)
    drafter = tiny_drafter(target, seed=6, block_size=8, selector_top_k=8, tree_width=4, target_layer_ids=[0, 2]).attach(target)
    taus = {}
    for nodes in (0, 29):
        tokens = forwards = 0
        for seed in range(6):
            ids = torch.randint(2, 8, (1, 5), generator=torch.Generator().manual_seed(seed))
            reference = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)
            out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, eos_token_id=None,
                                  cache_implementation="static", tree_nodes=nodes)
            assert torch.equal(out, reference)
            tokens += drafter.last_stats.completion_tokens
            forwards += drafter.last_stats.target_forwards
        taus[nodes] = tokens / forwards
    assert taus[29] > 1.2 * taus[0], taus


@pytest.mark.parametrize("settings", [dict(temperature=1.0),
                                      pytest.param(dict(temperature=0.7, top_p=0.85), marks=pytest.mark.slow)])
def test_sampling_over_a_tree_reproduces_the_target_distribution(settings):
    """Sampled tree rounds (the target's sample after every node, the same walk): the 2nd and 3rd new tokens follow
    the target's own processed distribution (chi-square, `check_sampling_is_exact`), drafts accepted along the way."""
    check_sampling_is_exact(settings, draws=1200, cache_implementation="static", tree_nodes=8)


def test_sampled_tree_rounds_keep_the_joint_distribution_of_a_block():
    """The first three new tokens together (not only each alone) follow the target: a walk that reused one node's
    sample for another, or drew a child's sample before its parent's, would bias the joint law."""
    target, drafter = sampling_case(vocab=6)
    ids = torch.tensor([[2, 3, 4]])
    generation = dict(do_sample=True, top_k=0, temperature=1.0, max_new_tokens=3, eos_token_id=None)
    processors = target._get_logits_processor(target.generation_config.__class__(**generation), 3)
    expected = {(): 1.0}
    for _ in range(3):
        grown = {}
        for sequence, weight in expected.items():
            prefix = torch.tensor([ids[0].tolist() + list(sequence)])
            with torch.no_grad():
                probs = processors(prefix, target(prefix).logits[:, -1].float()).softmax(-1)[0]
            for token, p in enumerate(probs.tolist()):
                grown[sequence + (token,)] = weight * p
        expected = grown
    draws, counts, accepted = 3000, {}, 0
    torch.manual_seed(1)
    for _ in range(draws):
        out = target.generate(ids, assistant_model=drafter, cache_implementation="static", tree_nodes=8, **generation)
        key = tuple(out[0, 3:6].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += drafter.last_stats.accepted_per_position[0]
    assert accepted > draws * 0.1, "few drafts accepted: the test would not test the walk"
    keys = sorted(expected)
    assert_follows(torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64),
                   torch.tensor([expected[k] * draws for k in keys], dtype=torch.float64))


def test_tree_nodes_from_the_config_and_bad_values():
    target = tiny_target("llama", seed=9, vocab=12, layers=2)
    drafter = tiny_drafter(target, seed=1, block_size=4, selector_top_k=6, tree_width=2, tree_nodes=7,
                           target_layer_ids=[0, 1]).attach(target)
    ids = torch.randint(2, 12, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12, eos_token_id=None,
                          cache_implementation="static")
    assert torch.equal(out, reference)
    assert [runner.core.tree_nodes for runner in drafter.round_runners()] == [7]
    with pytest.raises(ValueError, match=r"tree_nodes=8; use 0 .* or 2 \.\. 7"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, cache_implementation="static", tree_nodes=8)
    with pytest.raises(ValueError, match="tree verification runs in DFlash 2's own loop"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, tree_nodes=5, loop="transformers")
    with pytest.raises(ValueError, match="needs a DFlash 2 drafter"):
        target.generate(ids, max_new_tokens=4, tree_nodes=5)
    with pytest.raises(ValueError, match="tree_nodes=1"):
        tiny_drafter(target, block_size=4, tree_nodes=1, target_layer_ids=[0, 1])
    with pytest.raises(ValueError, match="tree_width=0"):
        tiny_drafter(target, block_size=4, tree_width=0, target_layer_ids=[0, 1])


def test_keeping_the_path_moves_it_in_every_layer_with_one_gather_and_one_index_put_each():
    """The accepted path's keys/values move to the path columns in every layer (checked against a naive copy), and the
    move launches one gather and one `index_put_` per buffer (its indices are shared by buffers of one shape): in a
    round captured from eager kernels each op is a launch, and recomputing the indices per layer once made the tree
    round's bookkeeping as long as its verify forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    target = tiny_target("llama", seed=4, layers=6)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=6, tree_width=2).attach(target)
    core = RoundCore(target, drafter, 2, 64, tree_nodes=7)
    ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    core.prefill(ids, torch.ones_like(ids), 20)
    core.round()
    buffers = core.target_cache.keys + core.target_cache.values
    before = [buffer.clone() for buffer in buffers]
    path = torch.tensor([[0, 2, 5, 6], [0, 1, 3, 4]])
    with Ops() as ops:
        core.keep_path(path)
    start = core.start.tolist()
    for old, new in zip(before, buffers):
        expected = old.clone()
        for row in range(2):
            expected[row, :, start[row]: start[row] + 4] = old[row, :, [start[row] + n for n in path[row].tolist()]]
        assert torch.equal(new, expected)
    assert ops.names.count("index") == ops.names.count("index_put_") == len(buffers) == 12
    assert len([name for name in ops.names if name not in ("view", "expand", "unsqueeze", "slice")]) <= 2 * 12 + 16


def test_the_last_sample_never_picks_a_token_of_zero_probability_at_the_uniforms_ends():
    """Inverse-CDF sampling (the token that ends a sampled tree round): a uniform of 0 takes the first token of nonzero
    probability, one just below 1 the last (even when rounding puts u * total at the total), never a token that
    top-k or top-p removed (-inf)."""
    logits = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(0))
    allowed = logits.topk(3, dim=-1).indices
    warped = torch.full_like(logits, float("-inf")).scatter(-1, allowed, logits.gather(-1, allowed))
    for u in (0.0, 0.5, 1.0 - 2 ** -24, 1.0):  # 1.0 itself stands for a rounded-up u * total
        tokens = sample_by_inverse_cdf(warped, torch.full((2, 5), u))
        assert (tokens.unsqueeze(-1) == allowed).any(-1).all(), (u, tokens, allowed)
    assert torch.equal(sample_by_inverse_cdf(warped, torch.zeros(2, 5)), allowed.min(-1).values)
    assert torch.equal(sample_by_inverse_cdf(warped, torch.ones(2, 5)), allowed.max(-1).values)


# ---------------------------------------------------------------------------------------------- sampled trees
@pytest.mark.parametrize("nodes, rows, k", [(2, 1, 3), (8, 3, 6), (32, 15, 16), (64, 15, 16), (13, 2, 3), (17, 1, 16)])
def test_a_sampled_tree_shape_is_grown_best_first_parents_first(nodes, rows, k):
    shape = SampledTreeShape.grow(nodes, rows, k)
    parent, rank, depth = shape.parent.tolist(), shape.rank.tolist(), shape.depth.tolist()
    listed = SAMPLED_CHILD_ACCEPTANCE
    acceptance = list(listed) + [listed[-1] / 2 ** (r + 1) for r in range(max(0, k - len(listed)))]
    assert len(parent) == nodes and parent[0] == 0 and depth[0] == 0
    value = [1.0]
    for n in range(1, nodes):
        assert parent[n] < n and depth[n] == depth[parent[n]] + 1 <= rows
        siblings = [m for m in range(1, n) if parent[m] == parent[n]]
        assert rank[n] == len(siblings) < k  # ranks 0, 1, 2 ... in node order
        value.append(value[parent[n]] * acceptance[rank[n]])
        assert shape.children[parent[n], rank[n]] == n
    assert (shape.children >= 0).sum() == nodes - 1
    # best-first: no node left out would have been worth more than the least one kept
    least = min(value)
    for n in range(nodes):
        count = sum(1 for m in range(1, nodes) if parent[m] == n)
        if depth[n] < rows and count < k:
            assert value[n] * acceptance[count] <= least + 1e-12
    with pytest.raises(ValueError, match="fewer than"):
        SampledTreeShape.grow(5, 2, 1)  # one candidate per row: a chain of 3 nodes at most


def naive_sampled_children(log_q, gumbel, depth, parent, rows):
    """The candidate index of each node of one row's sampled tree, drawn node by node: a node's children are the first
    of its Gumbel-perturbed log q, in order."""
    nodes = len(parent)
    index = [0] * nodes
    children = {n: [m for m in range(1, nodes) if parent[m] == n] for n in range(nodes)}
    for n in range(nodes):  # parents come first
        if not children[n]:
            continue
        after = log_q[min(depth[n], rows - 1), index[n]] + gumbel[n]
        order = sorted(range(len(after)), key=lambda j: (-float(after[j]), j))
        for r, child in enumerate(children[n]):
            index[child] = order[r]
    return index


def naive_speculative_walk(sampled, row, target_probs, uniform, final_uniform):
    """Recursive rejection sampling down one row's sampled tree, node by node in float64: the accepted count, the next
    token and the node path."""
    tree, candidates = sampled.tree, sampled.candidates[row].tolist()
    tokens, parent, depth = tree.tokens[row].tolist(), tree.parent[row].tolist(), tree.depth[row].tolist()
    node, path = 0, [0]
    while True:
        r = target_probs[row, node].double().clone()  # the residual, unnormalised
        below = candidates[min(depth[node], len(candidates) - 1)]
        q = torch.zeros_like(r)
        q[below] = sampled.proposal[row, node].double()
        moved = False
        for child in [m for m in range(1, len(tokens)) if parent[m] == node]:  # in rank order
            x = tokens[child]
            if float(uniform[row, child]) * float(q[x]) * float(r.sum()) < float(r[x]):
                node, moved = child, True
                path.append(child)
                break
            r = (r - r.sum() * q).clamp(min=0)
            q[x] = 0
            q = q / q.sum() if q.sum() > 0 else q
        if not moved:
            break
    if r.sum() <= 0:
        r = target_probs[row, node].double()
    cumulative = (r / r.sum()).cumsum(0)
    token = int((cumulative <= float(final_uniform[row])).sum())
    return len(path) - 1, min(token, int(r.nonzero().max())), path


def random_sampled_case(batch, rows, k, vocab, nodes, seed, temperature=1.0):
    generator = torch.Generator().manual_seed(seed)
    candidates, pairs = random_scores(batch, rows, k, vocab, seed)
    shape = SampledTreeShape.grow(nodes, rows, k)
    anchor = torch.randint(0, vocab, (batch,), generator=generator)
    gumbel = -torch.empty(batch, nodes, k).exponential_(generator=generator).log()
    sampled = sample_tree(anchor, candidates, pairs, shape, torch.full((batch,), temperature), gumbel)
    return shape, sampled, candidates, pairs, gumbel, generator


@pytest.mark.parametrize("rows, k, vocab, nodes", [(3, 4, 9, 8), (7, 6, 30, 24), (15, 16, 64, 32)])
def test_sample_tree_and_its_acceptance_equal_naive_loops(rows, k, vocab, nodes):
    batch = 64
    shape, sampled, candidates, pairs, gumbel, generator = random_sampled_case(batch, rows, k, vocab, nodes, seed=rows)
    log_q = pairs.float().log_softmax(-1)
    tree = sampled.tree
    for row in range(batch):
        index = naive_sampled_children(log_q[row], gumbel[row], shape.depth.tolist(), shape.parent.tolist(), rows)
        assert sampled.index[row].tolist() == index
        depth = shape.depth.tolist()
        want = [int(candidates[row, depth[n] - 1, index[n]]) if n else int(tree.tokens[row, 0]) for n in range(nodes)]
        assert tree.tokens[row].tolist() == want
        for n in range(nodes):
            q = log_q[row, min(depth[n], rows - 1), index[n]].softmax(-1)
            assert torch.allclose(sampled.proposal[row, n], q, atol=1e-6)
    # targets that often agree with the drafter (so walks go deep and past rank 0) and sometimes not
    logits = torch.randn(batch, nodes, vocab, generator=generator)
    below = candidates[:, shape.below]  # [b, N, K]
    near_q = sampled.proposal.log() + 4 + 0.7 * torch.randn(batch, nodes, k, generator=generator)
    logits.scatter_(2, below, near_q)
    target_probs = logits.softmax(-1)
    uniform, final_uniform = torch.rand(batch, nodes, generator=generator), torch.rand(batch, generator=generator)
    accepted, next_token, path = speculative_accept_tree(sampled, shape, target_probs, uniform, final_uniform, rows + 1)
    depths, later_ranks = [], 0
    for row in range(batch):
        count, token, nodes_on_path = naive_speculative_walk(sampled, row, target_probs, uniform, final_uniform)
        assert (int(accepted[row]), int(next_token[row])) == (count, token), row
        assert path[row, : count + 1].tolist() == nodes_on_path and (path[row, count + 1:] == 0).all()
        depths.append(count)
        later_ranks += sum(int(shape.rank[n]) > 0 for n in nodes_on_path)
    assert max(depths) >= min(rows, 3) and later_ranks > 0, (depths, later_ranks)  # the walks tested something


def virtual_target(vocab, seed):
    """A target's next-token distribution after any token path, fixed by the path (cached)."""
    cache = {}

    def probs(path):
        if path not in cache:
            generator = torch.Generator().manual_seed(hash((seed,) + path) % 2 ** 31)
            cache[path] = (1.5 * torch.randn(vocab, generator=generator)).softmax(-1)
        return cache[path]
    return probs


def test_a_sampled_tree_round_emits_exact_samples_of_the_target():
    """Many rounds at once (one per batch row, noise of their own) over one drafted block: the first three tokens a
    round emits, each completed by a direct sample of the target where the round ended earlier, follow the target's
    joint law (chi-square over all 125 triples). The drafter's proposal differs from the target's, so rejections,
    later ranks and residual samples all take part."""
    vocab, rows, k, nodes, draws = 5, 3, 4, 10, 30000
    p = virtual_target(vocab, seed=3)
    shape, sampled, candidates, pairs, gumbel, generator = random_sampled_case(1, rows, k, vocab, nodes, seed=11)
    candidates, pairs = candidates.expand(draws, -1, -1), pairs.expand(draws, -1, -1, -1)
    anchor = sampled.tree.tokens[:1, 0].expand(draws)
    gumbel = -torch.empty(draws, nodes, k).exponential_(generator=generator).log()
    sampled = sample_tree(anchor, candidates, pairs, shape, torch.ones(draws), gumbel)
    paths = {}
    tokens, parent = sampled.tree.tokens.tolist(), shape.parent.tolist()
    target_probs = torch.empty(draws, nodes, vocab)
    for row in range(draws):
        for n in range(nodes):
            path = () if n == 0 else paths[(row, parent[n])] + (tokens[row][n],)
            paths[(row, n)] = path
            target_probs[row, n] = p(path)
    uniform, final_uniform = torch.rand(draws, nodes, generator=generator), torch.rand(draws, generator=generator)
    accepted, next_token, path = speculative_accept_tree(sampled, shape, target_probs, uniform, final_uniform, rows + 1)
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for row in range(draws):
        emitted = [tokens[row][n] for n in path[row, 1: int(accepted[row]) + 1].tolist()] + [int(next_token[row])]
        while len(emitted) < 3:
            emitted.append(int(torch.multinomial(p(tuple(emitted)), 1, generator=generator)))
        counts[tuple(emitted[:3])] += 1
    expected = torch.zeros_like(counts)
    for a in range(vocab):
        for b in range(vocab):
            for c in range(vocab):
                expected[a, b, c] = p(())[a] * p((a,))[b] * p((a, b))[c] * draws
    assert_follows(counts.flatten(), expected.flatten())
    assert (accepted >= 2).sum() > draws * 0.05 and (accepted == 0).sum() > draws * 0.05, accepted.bincount()
