"""tau of the shipped drafter verifying a path (0) or trees of the given node counts, on a CPU in fp32.

    python scripts/tree_tau.py TASK SKIP PROMPTS NEW_TOKENS NODES[,NODES...] [WIDTH[,WIDTH...]]

TEMPERATURE=1.0 (environment) samples at that temperature instead of greedy (each call seeded by its prompt's index),
with no top-k cut; TOP_K=50 samples within the 50 most likely tokens (transformers' default when none is given).
DRAFTER=<folder> measures that drafter instead of the shipped one (e.g. one written by scripts/selector_fit.py).
CANDIDATES=K loads the drafter with selector_top_k=K (the candidates kept per block position; its config's otherwise).
PROPOSAL_SCALE=C draws a sampled tree's children from softmax(pairs / (T * C)) instead of softmax(pairs / T) (C < 1
sharper, C > 1 flatter; the acceptance uses the same proposal, so the output stays exact).
PAIRS=unary drops the selector's pair term: every row's scores are its candidates' unary logits whatever the previous
draft (the proposal q = softmax(unary / T) over the candidates; the output stays exact).
"""
import os
import sys
import time

import torch

from dflash2.generation import DFlash2Drafter, load_target
from dflash2.pairs import DEFAULT_DRAFTER, sampling_kwargs
from dflash2.tasks import chat_prompt_ids, task_prompts

torch.set_num_threads(1)
if os.environ.get("PROPOSAL_SCALE"):
    import dflash2.generation.round_core as round_core

    scale, unscaled = float(os.environ["PROPOSAL_SCALE"]), round_core.sample_tree
    round_core.sample_tree = lambda anchor, candidates, pairs, shape, temperature, gumbel: unscaled(
        anchor, candidates, pairs, shape, temperature * scale, gumbel)
if os.environ.get("PAIRS") == "unary":
    import dflash2.modeling_dflash2 as modeling

    modeling.bilinear_scores = lambda unary, candidates, predecessors, *codebooks: unary.float().unsqueeze(-2).expand(
        *predecessors.shape, unary.shape[-1])
candidates = {"selector_top_k": int(os.environ["CANDIDATES"])} if os.environ.get("CANDIDATES") else {}
drafter_folder = os.environ.get("DRAFTER", DEFAULT_DRAFTER)
drafter = DFlash2Drafter.from_pretrained(drafter_folder, dtype=torch.float32, **candidates)
print("drafter", drafter_folder, "selector_top_k", drafter.config.selector_top_k, "tree_width",
      drafter.config.tree_width, "proposal_scale", os.environ.get("PROPOSAL_SCALE", 1), "pairs",
      os.environ.get("PAIRS", "selector"), flush=True)
target, tok = load_target(drafter.config, dtype=torch.float32)
drafter.attach(target)
task, skip, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configs = [int(x) for x in sys.argv[5].split(",")]
temperature = float(os.environ.get("TEMPERATURE", 0))
sampling = sampling_kwargs(temperature)
if temperature and os.environ.get("TOP_K"):
    sampling["top_k"] = int(os.environ["TOP_K"])
for w in ([int(x) for x in sys.argv[6].split(",")] if len(sys.argv) > 6 else [drafter.config.tree_width]):
    drafter.config.tree_width = w
    drafter.release()  # runners are built with the width they found: build them again with this one
    for nodes in configs:
        tokens = forwards = 0
        t0 = time.time()
        for index, p in enumerate(task_prompts(task, n, skip=skip)):
            ids = torch.tensor([chat_prompt_ids(tok, p)])
            torch.manual_seed(index)
            target.generate(ids, assistant_model=drafter, max_new_tokens=new, cache_implementation="static",
                            tree_nodes=nodes, **sampling)
            tokens += drafter.last_stats.completion_tokens
            forwards += drafter.last_stats.target_forwards
        print(f"{task} T {temperature} top-k {sampling.get('top_k')} width {w} nodes {nodes}: "
              f"tau {tokens / forwards:.3f} ({time.time() - t0:.0f}s)", flush=True)
