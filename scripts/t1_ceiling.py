"""Ceiling on speculative decoding's tau (tokens per target forward) for a PERFECT drafter (the target itself) at a
sampling temperature T (default 1), on a CPU in fp32: a path of a block (16 tokens, root included) and optimal trees of
N nodes (root included, depth at most block - 1).

    PYTHONPATH=<dir holding dflash2> python scripts/t1_ceiling.py --per-category 4 --new 96 --stride 16 \\
        --nodes 16,32,64 --check --out /tmp/t1_ceiling.json          # ~14 min on one CPU core
    python scripts/t1_ceiling.py --summarize /tmp/t1_ceiling.json  # the tables again

When the target's sample after each node is drawn independently of the drafts, and a round walks into the child that
holds it, a node is accepted iff the target's sample at its parent is the node's token, so its chance of acceptance is
its path probability (the product of the target's probabilities of the tokens from the root to it) and a round's
expected tau is 1 + the sum of the drafted nodes' path probabilities. No tree of N nodes does better under that
acceptance. Speculative sampling couples the target's sample to the drafts instead (each draft accepted with
min(1, p/q), a rejection resampled from the residual), and escapes this ceiling: the sampled round's trees do that.

For each prompt (MT-Bench first turns, the first `--per-category` of each category) the target samples `--new` tokens at
T (seeded by the prompt's index); a "state" is the prefix after every `--stride` of them (0 included). At each state:
  path: the target's greedy chain of block - 1 tokens, tau = 1 + sum_k prod_{j<=k} p(g_j);
  tree N: best-first expansion (largest path probability first; the children of a node are all its tokens in
          probability order, pushed lazily one sibling at a time), which is optimal because path probabilities only
          shrink with depth; the first N - 1 nodes popped are the optimal N-node tree, so one expansion serves every N.
An end-of-sequence token ends a path (it is never expanded). Reported: the mean per-state tau by MT-Bench category and
overall, and overall the harmonic mean (a measured tau, tokens / forwards, spends 1/tau rounds per token, so it is the
harmonic mean's counterpart). TEMPERATURE (environment) or --temperature sets T; at T = 0.01 the trees of 32+ nodes
reach the block (16) and the path ~15.5 (near-ties in the target's logits). --check compares the tree-attention
distributions with plain forwards; every state asserts tree(block) >= path and that trees grow with N.
"""
import argparse
import heapq
import json
import os
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.pairs import DEFAULT_DRAFTER
from dflash2.tasks import chat_prompt_ids, task_categories, task_prompts

TOP = 64  # children kept per expanded node: a tree of at most 63 drafted nodes never needs more of one node's


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="mtbench")
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category (the first ones of each)")
    parser.add_argument("--new", type=int, default=96, help="tokens sampled per prompt")
    parser.add_argument("--stride", type=int, default=16, help="tokens between states")
    parser.add_argument("--block", type=int, default=16, help="path length and tree depth cap + 1 (root included)")
    parser.add_argument("--nodes", default="16,32,64", help="tree sizes, root included")
    parser.add_argument("--temperature", type=float, default=float(os.environ.get("TEMPERATURE", 1.0)))
    parser.add_argument("--batch", type=int, default=16, help="nodes expanded per target forward (speed only)")
    parser.add_argument("--check", action="store_true", help="check the tree attention at each prompt's second state")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--summarize", default=None, help="only print the tables of a JSON written by --out")
    return parser.parse_args()


def chosen_prompts(task, per_category):
    """(index, category, prompt) of the first `per_category` prompts of each category, in file order."""
    seen = defaultdict(int)
    chosen = []
    for index, (category, prompt) in enumerate(zip(task_categories(task), task_prompts(task))):
        if seen[category] < per_category:
            seen[category] += 1
            chosen.append((index, category, prompt))
    return chosen


def crop_to(cache, length):
    """Cut a DynamicCache back to its first `length` positions (crop takes the count to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Prefix:
    """The target's KV cache of a growing prefix; `run(tokens)` appends tokens (cropping back first to `keep`
    positions) and returns the last position's logits."""

    def __init__(self, target, ids):
        self.target = target
        self.cache = DynamicCache(config=target.config)
        self.length = 0
        self.tokens = []  # the state's tokens (the prompt and the sampled ones)
        self.logits = self.run(ids, keep=0)
        self.tokens = list(ids)

    @torch.inference_mode()
    def run(self, tokens, keep):
        crop_to(self.cache, keep)
        out = self.target(torch.tensor([tokens]), past_key_values=self.cache, use_cache=True)
        self.length = keep + len(tokens)
        return out.logits[0, -1].float()


def distribution(logits, temperature):
    """(top probabilities, their tokens) of the target's distribution at `temperature`, largest first."""
    probs = torch.softmax(logits / temperature, dim=-1)
    top = torch.topk(probs, TOP)
    return top.values.tolist(), top.indices.tolist()


class Expander:
    """The target's distribution after the state plus a path of tokens, memoised. Every expanded node's token stays in
    the cache after the state (tree attention: a 4D mask lets it see the state and its ancestors only), so expanding a
    node runs one token, and `expand_many` runs many nodes in one forward."""

    def __init__(self, prefix, temperature):
        self.prefix, self.temperature = prefix, temperature
        self.base = prefix.length
        self.memo = {(): distribution(prefix.logits, temperature)}
        self.slot = {}  # path -> its token's position in the cache, after the state
        self.forwards = 0

    def __call__(self, path):
        if path not in self.memo:
            self.expand_many([path])
        return self.memo[path]

    @torch.inference_mode()
    def expand_many(self, paths):
        """Compute the distributions after each path (each one's parent already expanded) in one forward."""
        paths = [p for p in dict.fromkeys(paths) if p not in self.memo]
        if not paths:
            return
        length = self.prefix.length
        mask = torch.zeros(1, 1, len(paths), length + len(paths), dtype=torch.bool)
        mask[..., : self.base] = True
        for row, path in enumerate(paths):
            for k in range(1, len(path)):
                mask[0, 0, row, self.slot[path[:k]]] = True
            mask[0, 0, row, length + row] = True
        tokens = torch.tensor([[p[-1] for p in paths]])
        positions = torch.tensor([[self.base + len(p) - 1 for p in paths]])
        logits = self.prefix.target(tokens, attention_mask=mask, position_ids=positions,
                                    past_key_values=self.prefix.cache, use_cache=True).logits[0].float()
        for row, path in enumerate(paths):
            self.slot[path] = length + row
            self.memo[path] = distribution(logits[row], self.temperature)
        self.prefix.length = length + len(paths)
        self.forwards += 1

    def restore(self):
        """Crop the cache back to the state."""
        crop_to(self.prefix.cache, self.base)
        self.prefix.length = self.base


def path_tau(expand, depth, eos):
    """1 + sum over k of the chance that the target's greedy chain's first k tokens are all sampled."""
    tau, chance, path = 1.0, 1.0, ()
    for _ in range(depth):
        probs, tokens = expand(path)
        chance *= probs[0]
        tau += chance
        path += (tokens[0],)
        if tokens[0] in eos:
            break
    return tau


def tree_chances(expand, depth, count, eos, width):
    """The path probabilities of the `count` nodes of the optimal tree, in the order best-first expansion pops them
    (so the first N - 1 are the optimal tree of N nodes, root included). A node that needs expanding is expanded
    along with up to `width` - 1 of the best candidates (those likely to be popped next) in one forward."""
    heap = []  # (-path probability, parent path, child rank, parent probability)

    def push_child(parent, rank, parent_chance):
        probs, _ = expand(parent)
        if rank < len(probs):
            heapq.heappush(heap, (-parent_chance * probs[rank], parent, rank, parent_chance))

    def expandable(parent, rank):
        token = expand(parent)[1][rank]
        return len(parent) + 1 < depth and token not in eos

    def prefetch(node):
        ahead = [parent + (expand(parent)[1][rank],) for _, parent, rank, _ in heapq.nsmallest(width - 1, heap)
                 if expandable(parent, rank)]
        expand.expand_many([node] + ahead)

    push_child((), 0, 1.0)
    chances = []
    while heap and len(chances) < count:
        negative, parent, rank, parent_chance = heapq.heappop(heap)
        chance = -negative
        chances.append(chance)
        node = parent + (expand(parent)[1][rank],)
        push_child(parent, rank + 1, parent_chance)  # its next sibling
        if expandable(parent, rank) and len(chances) < count:
            if node not in expand.memo:
                prefetch(node)
            push_child(node, 0, chance)  # its first child
    return chances


def check_expander(prefix, expand, paths):
    """Assert that the tree-attention distributions match a plain forward of the state plus the path."""
    state = prefix.tokens
    for path in paths:
        with torch.inference_mode():
            logits = prefix.target(torch.tensor([state + list(path)])).logits[0, -1].float()
        probs, tokens = distribution(logits, expand.temperature)
        assert tokens[:5] == expand.memo[path][1][:5] and abs(probs[0] - expand.memo[path][0][0]) < 1e-3, path
    print(f"checked {len(paths)} tree-attention nodes against plain forwards", flush=True)


def state_ceilings(prefix, args, nodes, eos, check=False):
    """{"path": tau, N: tau, ...} at the prefix's state."""
    expand = Expander(prefix, args.temperature)
    depth = args.block - 1
    chances = tree_chances(expand, depth, max(nodes) - 1, eos, args.batch)
    result = {"path": path_tau(expand, depth, eos)}  # after the tree: most of the greedy chain is expanded already
    if check:
        deepest = sorted(expand.memo, key=len)[-3:]
        check_expander(prefix, expand, deepest + [p for p in expand.memo if len(p) == 1][:2])
    for n in nodes:
        result[n] = 1.0 + sum(chances[: n - 1])
    assert result[args.block] >= result["path"] - 1e-6, result  # the path is itself a tree of `block` nodes
    assert all(result[a] <= result[b] + 1e-9 for a, b in zip(nodes, nodes[1:])), result
    result["forwards"] = expand.forwards
    expand.restore()
    return result


def prompt_states(target, ids, index, args, nodes, eos):
    """The ceilings at every `stride` tokens of a continuation the target samples at T (seeded by `index`)."""
    generator = torch.Generator().manual_seed(index)
    prefix = Prefix(target, ids)
    states, sampled = [], 0
    while sampled < args.new:
        states.append(state_ceilings(prefix, args, nodes, eos, check=args.check and len(states) == 1))
        step = []
        logits = prefix.logits
        for _ in range(min(args.stride, args.new - sampled)):
            token = int(torch.multinomial(torch.softmax(logits / args.temperature, -1), 1, generator=generator))
            step.append(token)
            if token in eos:
                break
            logits = prefix.run([token], keep=prefix.length)
            prefix.tokens.append(token)
        sampled += len(step)
        if step and step[-1] in eos:
            break
        prefix.logits = logits
    return states


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def harmonic(values):
    return len(values) / sum(1 / v for v in values) if values else float("nan")


def table(by_category, columns):
    """Markdown table and summary: per category and overall, the mean per-state tau (arithmetic) and, overall, the
    harmonic mean too: decoding's tokens / forwards weighs each state by the rounds spent there (1 / tau per token),
    so the harmonic mean over evenly spaced states is the ceiling comparable with a measured tau."""
    keys = ["path"] + [str(n) for n in columns]
    lines = ["| category | states | path | " + " | ".join(f"tree {n}" for n in columns) + " |",
             "|---|---|" + "---|" * len(keys)]
    everything = [s for states in by_category.values() for s in states]
    rows = [(name, states, mean) for name, states in by_category.items()]
    rows += [("overall (mean of states)", everything, mean), ("overall (harmonic: tokens/forwards)", everything, harmonic)]
    summary = {}
    for name, states, average in rows:
        summary[name] = {k: average([s[k] for s in states]) for k in keys} | {"states": len(states)}
        lines.append(f"| {name} | {len(states)} | " + " | ".join(f"{summary[name][k]:.2f}" for k in keys) + " |")
    return "\n".join(lines), summary


def summarize(path):
    """Print the tables of a JSON this script wrote."""
    data = json.load(open(path))
    by_category = defaultdict(list)
    for record in data["prompts"]:
        by_category[record["category"]] += record["states"]
    args = data["args"]
    print(f"T = {args['temperature']}, block {args['block']}, {len(data['prompts'])} prompts, new {args['new']}, "
          f"stride {args['stride']}, {data['wall_s']:.0f}s\n\n" + table(by_category, args["nodes"].split(","))[0])


def main():
    args = parse_args()
    if args.summarize:
        return summarize(args.summarize)
    torch.set_num_threads(1)
    nodes = sorted(int(x) for x in args.nodes.split(","))
    assert max(nodes) - 1 <= TOP and args.block in nodes
    drafter = DFlash2Drafter.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32)  # only its config names the target
    target, tok = load_target(drafter.config, dtype=torch.float32)
    target.eval()
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    start = time.time()
    by_category, records = defaultdict(list), []
    for index, category, prompt in chosen_prompts(args.task, args.per_category):
        ids = chat_prompt_ids(tok, prompt)
        states = [{str(k): v for k, v in s.items()} for s in prompt_states(target, ids, index, args, nodes, eos)]
        by_category[category] += states
        records.append({"index": index, "category": category, "states": states})
        print(f"prompt {index} ({category}): {len(states)} states, path {mean([s['path'] for s in states]):.2f}, "
              + ", ".join(f"tree {n} {mean([s[str(n)] for s in states]):.2f}" for n in nodes)
              + f" [{time.time() - start:.0f}s]", flush=True)
    text, summary = table(by_category, nodes)
    wall = time.time() - start
    print(f"\nT = {args.temperature}, block {args.block}, {len(records)} prompts, new {args.new}, stride {args.stride}, "
          f"{wall:.0f}s\n\n{text}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"args": vars(args), "wall_s": wall, "summary": summary, "prompts": records}, handle, indent=1)


if __name__ == "__main__":
    main()
