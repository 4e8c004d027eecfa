"""Tree verification (generation/tree.py, RoundCore.tree_round): the vectorised pieces against naive loops, and tree
decoding against plain greedy on hundreds of random cases (tiny targets and vocabularies, so that side branches win;
an oracle plants each row's true continuation along a random root path of the tree, so rounds accept deep paths that
are not the beam's best)."""

import random

import pytest
import torch

from dflash2.generation.round_core import RoundCore
from dflash2.generation.sampling import Sampling
from dflash2.generation.tree import DEPTH_TIE_BREAK, accept_tree, draft_tree, stable_top_k, top_k_by_rank
from dflash2.training.decoding import left_padded as left_pad
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
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, tree_nodes=5)
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


def test_node_samples_never_pick_a_token_of_zero_probability_at_the_uniforms_ends():
    """Inverse-CDF sampling per node: a uniform of 0 takes the first token of nonzero probability, one just below 1
    the last (even when rounding puts u * total at the total), never a token top-k or top-p removed."""
    target = tiny_target("llama", seed=3, vocab=12, layers=2)
    drafter = tiny_drafter(target, seed=4, block_size=4, selector_top_k=6, target_layer_ids=[0, 1]).attach(target)
    core = RoundCore(target, drafter, 2, 64, tree_nodes=5)
    core.set_sampling(Sampling(True, 1.0, 3, 1.0))  # top-k 3: nine tokens of each node get probability 0
    logits = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(0))
    allowed = logits.topk(3, dim=-1).indices
    for u in (0.0, 0.5, 1.0 - 2 ** -24, 1.0):  # 1.0 itself stands for a rounded-up u * total
        core.node_uniform.fill_(u)
        tokens = core.node_tokens(logits, sampled=True)
        assert (tokens.unsqueeze(-1) == allowed).any(-1).all(), (u, tokens, allowed)
    core.node_uniform.fill_(0.0)
    first = core.node_tokens(logits, sampled=True)
    assert torch.equal(first, allowed.min(-1).values)
