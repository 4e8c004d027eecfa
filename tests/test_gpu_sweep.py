"""Exactness at scale: hundreds of random cases through DFlash 2's captured rounds, each row equal to plain greedy.

    DFLASH2_SWEEP_OUT=runs/gpu-sweep.json python -m pytest -q -m gpu tests/test_gpu_sweep.py -s     # one GPU

Tiny random Llama and Qwen3 targets of three shapes and vocabularies, one drafter each at block 4, 8 and 16; batches
of 1 to 8 left-padded rows of random lengths; greedy, fp32 (TF32 off); the EOS token is one the target emits often, so
many rows end inside a block. A random drafter's drafts are rarely accepted, so an oracle inside the round overwrites
a prefix of each row's drafts (0 to B-1 tokens, varying by row and round) with that row's true continuation, read
from a device buffer filled before each call: device operations only, so the captured and the fused round hold it,
and rounds accept anywhere from 0 to B-1 drafts, EOS among them. Every case runs through the graph round
(`compile=False`: the eager round captured as a CUDA graph) and, for batches 1 and 3-4, the fused round
(`compile=True`: inductor, then captured); each row must equal plain greedy `generate` of that row alone. Plain greedy
runs once per row of a pool (its continuation with EOS is the one without, cut at the first EOS; a shorter
max_new_tokens is a prefix), and the cases draw their rows from the pool, so the sweep is bound by DFlash 2's calls.
DFLASH2_SWEEP_CASES sets the number of cases (GPU default 520); the counts go to DFLASH2_SWEEP_OUT as JSON when set.
The fused cases cost one inductor build of both rounds per (pair, batch bucket, tree or path), minutes in all;
DFLASH2_SWEEP_FUSED=0 runs every case through the graph round instead (a quick check of the captured rounds), and
DFLASH2_SWEEP_FUSED=only every case through the fused round. DFLASH2_SWEEP_PAIRS (e.g. "0" or "1,2") keeps only those
pairs, so the fused cases can be split over several runs, each under a time limit (their counts add up).
On a CPU the same sweep runs 6 cases through the eager round (the code path, not the captured rounds).
"""

import json
import os
import random
from pathlib import Path

import pytest
import torch

from dflash2.generation.round_core import RoundCore
from helpers import tiny_drafter, tiny_target

MAX_NEW = 40
POOL = 40  # rows per target (GPU)
PAIRS = (  # arch, vocabulary, hidden size, layers, block size
    ("llama", 24, 64, 4, 4),
    ("qwen3", 40, 64, 4, 8),
    ("llama", 64, 96, 3, 16),
)


ORACLE = {}  # (vocabulary, batch bucket) -> [bucket, MAX_NEW + 1] true continuations, -1 past each row's end


@pytest.fixture
def oracle(monkeypatch):
    """RoundCore.propose with a prefix of the drafts replaced by the true continuation (`ORACLE`), on the device."""
    original = RoundCore.propose

    def propose(self, hidden, sampled=False):
        proposal = original(self, hidden, sampled)
        reference = ORACLE.get((self.drafter.config.vocab_size, self.batch))  # plain ints: nothing for dynamo
        if reference is None or sampled:  # the sampled round (captured beside the greedy one) keeps its own drafts
            return proposal
        drafts = proposal.tokens
        steps = torch.arange(drafts.shape[1], device=drafts.device)
        truth = reference.gather(1, (self.output_length.view(-1, 1) + steps).clamp(max=reference.shape[1] - 1))
        rows = torch.arange(self.batch, device=drafts.device)
        usable = (self.output_length * 5 + self.rounds * 3 + rows) % (drafts.shape[1] + 1)  # 0 .. B-1 drafts
        proposal.tokens = torch.where((steps < usable.view(-1, 1)) & (truth >= 0), truth, drafts)
        return proposal

    original_tree = RoundCore.draft_tree

    def draft_tree(self, hidden):
        """The truth planted along the root path of a node chosen per row and round, for 0 .. B-1 depths: the
        accepted path is often a side branch."""
        tree = original_tree(self, hidden)
        reference = ORACLE.get((self.drafter.config.vocab_size, self.batch))
        if reference is None:
            return tree
        nodes = tree.tokens.shape[1]
        rows = torch.arange(self.batch, device=tree.tokens.device)
        chosen = (self.output_length * 7 + self.rounds * 5 + rows) % nodes
        usable = (self.output_length * 5 + self.rounds * 3 + rows) % self.block_size
        on_path = tree.ancestors.gather(1, chosen.view(-1, 1, 1).expand(-1, 1, nodes)).squeeze(1)  # [b, N]
        steps = (self.output_length.view(-1, 1) + tree.depth - 1).clamp(0, reference.shape[1] - 1)
        truth = reference.gather(1, steps)  # [b, N]: the true token at each node's depth
        plant = on_path & (tree.depth >= 1) & (tree.depth <= usable.view(-1, 1)) & (truth >= 0)
        tree.tokens = torch.where(plant, truth, tree.tokens)
        return tree

    monkeypatch.setattr(RoundCore, "propose", propose)
    monkeypatch.setattr(RoundCore, "draft_tree", draft_tree)
    yield
    ORACLE.clear()


def build_pair(index: int, device):
    arch, vocab, hidden, layers, block = PAIRS[index]
    target = tiny_target(arch, seed=10 + index, vocab=vocab, layers=layers, hidden=hidden).to(device)
    drafter = tiny_drafter(target, seed=20 + index, block_size=block, selector_top_k=min(16, vocab // 2),
                           mask_token_id=vocab - 1, target_layer_ids=list(range(min(3, layers))))
    return target, drafter.to(device).attach(target)


def plain_pool(target, rng, device, pool: int):
    """Random prompts and plain greedy's MAX_NEW tokens after each (no EOS), one row at a time."""
    vocab = target.config.vocab_size
    prompts = [[rng.randrange(4, vocab - 1) for _ in range(rng.randint(1, 24))] for _ in range(pool)]
    free = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        free.append(out[0, len(prompt):].tolist())
    return prompts, free


def common_token(free) -> int:
    """The token greedy emits most often in the middle of the continuations: the EOS of the sweep."""
    counts = {}
    for tokens in free:
        for token in tokens[2: MAX_NEW // 2]:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.get)


def expected(free_row, eos: int, max_new: int):
    row = free_row[:max_new]
    return row[: row.index(eos) + 1] if eos in row else row


def run_case(target, drafter, prompts, free, eos, rows, max_new, compile, device, tree_nodes=0):
    """One generate call over the rows (left-padded); returns (rows equal to plain greedy, rows ending at EOS early,
    drafts accepted)."""
    width = max(len(prompts[r]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(prompts[r]):] = torch.tensor(prompts[r])
        mask[i, width - len(prompts[r]):] = 1
    bucket = 1 << (len(rows) - 1).bit_length()  # the round core's batch (rows beyond the batch are empty)
    key = (drafter.config.vocab_size, bucket)  # each pair has its own vocabulary
    reference = ORACLE.setdefault(key, torch.full((bucket, MAX_NEW + 1), -1, device=device))
    reference.fill_(-1)
    for i, r in enumerate(rows):
        want = expected(free[r], eos, max_new)
        reference[i, : len(want)] = torch.tensor(want, device=device)
    static = {"cache_implementation": "static"} if len(rows) == 1 else {}
    out = target.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0, assistant_model=drafter, compile=compile,
                          tree_nodes=tree_nodes, **static)
    equal = early = 0
    for i, r in enumerate(rows):
        want = expected(free[r], eos, max_new)
        got = out[i, width: width + len(want)].tolist()
        equal += got == want
        early += len(want) < max_new
    return equal, early, sum(drafter.last_stats.accepted_per_position)


def sweep(device, cases: int, modes, pool: int = POOL, pair_indices=None) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = random.Random(0)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "cases": 0,
              "rows": 0, "rows_equal": 0, "rows_ending_at_eos": 0, "drafts_accepted": 0, "failures": [],
              "per_mode": {}}
    pair_indices = list(range(len(PAIRS))) if pair_indices is None else list(pair_indices)
    report["pairs"] = [list(PAIRS[i]) for i in pair_indices]
    pairs = []
    for index in pair_indices:
        target, drafter = build_pair(index, device)
        prompts, free = plain_pool(target, rng, device, pool)
        pairs.append((target, drafter, prompts, free, common_token(free)))
    for case in range(cases):
        target, drafter, prompts, free, eos = pairs[case % len(pairs)]
        index = pair_indices[case % len(pairs)]
        compile = modes[case // len(pairs) % len(modes)]
        batch = rng.randint(1, min(8, pool)) if compile is False else rng.choice([1, 3, 4])  # fused: buckets 1, 4
        rows = rng.sample(range(pool), batch)
        max_new = rng.randint(2, MAX_NEW)
        # every other case verifies a tree of 2 x block nodes (fused: batch 1 only, one compile per pair)
        tree_nodes = 2 * drafter.config.block_size if case % 2 and (compile is False or batch == 1) else 0
        equal, early, accepted = run_case(target, drafter, prompts, free, eos, rows, max_new, compile, device,
                                          tree_nodes)
        name = ("fused" if compile is True else "graph" if device.type == "cuda" else "eager") + (
            " tree" if tree_nodes else "")
        mode = report["per_mode"].setdefault(name, {"cases": 0, "rows": 0, "rows_equal": 0})
        for counts in (report, mode):
            counts["cases"] += 1
            counts["rows"] += batch
            counts["rows_equal"] += equal
        report["rows_ending_at_eos"] += early
        report["drafts_accepted"] += accepted
        if equal < batch:
            report["failures"].append({"case": case, "pair": index, "compile": compile, "tree_nodes": tree_nodes, "rows": rows,
                                       "max_new_tokens": max_new, "equal": equal})
    return report


def check(report: dict, cases: int) -> None:
    out = os.environ.get("DFLASH2_SWEEP_OUT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n[sweep] {json.dumps({k: v for k, v in report.items() if k != 'failures'})}")
    assert report["cases"] == cases and not report["failures"], report["failures"][:5]
    assert report["rows_equal"] == report["rows"]
    assert report["drafts_accepted"] >= report["rows"], "few drafts accepted: the sweep would not test acceptance"
    assert report["rows_ending_at_eos"] > 0, "no row ended at EOS: the sweep would not test EOS inside blocks"


@pytest.mark.gpu
def test_captured_rounds_equal_plain_greedy_on_hundreds_of_random_cases(monkeypatch, oracle):
    # one inductor compile per (pair, batch bucket): more than dynamo's default recompile limit for RoundCore.round
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            monkeypatch.setattr(torch._dynamo.config, name, 64)
    cases = int(os.environ.get("DFLASH2_SWEEP_CASES", 520))
    fused = os.environ.get("DFLASH2_SWEEP_FUSED", "1")
    modes = {"0": (False,), "only": (True,)}.get(fused, (False, True))
    pairs = os.environ.get("DFLASH2_SWEEP_PAIRS")
    pair_indices = [int(i) for i in pairs.split(",")] if pairs else None
    check(sweep(torch.device("cuda"), cases, modes=modes, pair_indices=pair_indices), cases)


def test_sweep_runs_the_eager_round_on_the_cpu(oracle):
    cases = 6
    check(sweep(torch.device("cpu"), cases, modes=(False,), pool=6), cases)


def test_sweep_keeps_only_the_pairs_asked_for(oracle):
    report = sweep(torch.device("cpu"), 2, modes=(False,), pool=4, pair_indices=[2])
    assert report["pairs"] == [list(PAIRS[2])] and report["cases"] == 2
    assert report["rows_equal"] == report["rows"]
