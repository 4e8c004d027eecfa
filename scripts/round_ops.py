"""Ops one round dispatches, per part, path against tree (CPU, random weights).

    python scripts/round_ops.py [tree_nodes ...]        # default: 0 (path) and 32

A round captured from eager kernels replays one launch per op, so at the default target's size (30 layers, a small
hidden size) the op count tracks its cost on a GPU. The target is a random Llama with SmolLM2-135M's 30 layers but a
tiny width; the drafter has the shipped drafter's 5 layers, block 16 and taps. View-like ops (views, slices,
transposes) launch nothing and are not counted.
"""

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from dflash2.configuration_dflash2 import DFlash2Config
from dflash2.generation import DFlash2Drafter
from dflash2.generation.round_core import RoundCore
from dflash2.generation.tree import accept_tree

VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "permute",
         "alias", "detach", "as_strided", "split", "unbind", "reshape"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def ops(fn):
    with torch.no_grad(), Ops() as counter:
        out = fn()
    return sum(counter.count.values()), out


def main(sizes):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    target = LlamaForCausalLM(config).eval()
    drafter_config = DFlash2Config.for_target(config, num_hidden_layers=5, block_size=16, selector_top_k=8,
                                              selector_rank=8, target_layer_ids=[1, 8, 15, 22, 29], tree_width=4)
    drafter = DFlash2Drafter(drafter_config).eval().attach(target)
    for nodes in sizes:
        core = RoundCore(target, drafter, 1, 512, tree_nodes=nodes)
        ids = torch.randint(4, 500, (1, 40))
        core.prefill(ids, torch.ones_like(ids), 200)
        core.round()
        total, _ = ops(core.round)
        parts = {}
        parts["draft_block"], hidden = ops(core.draft_block)
        if nodes:
            parts["draft_tree"], tree = ops(lambda: core.draft_tree(hidden))
            parts["verify_tree"], (logits, _) = ops(lambda: core.verify_tree(tree))
            target_tokens = logits.argmax(-1)
            parts["accept_tree"], (_, _, path) = ops(lambda: accept_tree(tree, target_tokens, core.block_size))
            parts["keep_path"], _ = ops(lambda: core.keep_path(path))
        else:
            parts["propose"], proposal = ops(lambda: core.propose(hidden))
            block = torch.cat([core.anchor.view(-1, 1), proposal.tokens], dim=1)
            parts["verify"], _ = ops(lambda: core.verify(block))
        shown = ", ".join(f"{name} {count}" for name, count in parts.items())
        print(f"tree_nodes={nodes}: round {total} ops ({shown})")


if __name__ == "__main__":
    main([int(n) for n in sys.argv[1:]] or [0, 32])
