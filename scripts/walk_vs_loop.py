"""The trainer's held-out estimates on answers the target wrote, beside what the decoding loop measures on them
(session 9): the first 12 prompts of `acceptance --task prompts` (a seeded shuffle of the prompt file), the target's
fp32 greedy answers up to 128 tokens, then `held_out_acceptance`: its `greedy_walk` tau, the per-position mean, and
(tokens, forwards) per answer. Compare with `python -m dflash2.benchmarks.acceptance --task prompts --prompt-file
.carry/prompts.jsonl.gz --num-prompts 12 --max-new-tokens 128 --device cpu --drafter DRAFTER --out FILE`.

    python scripts/walk_vs_loop.py DRAFTER [PROMPT_FILE]
"""
import json
import sys

import torch

from dflash2.benchmarks.acceptance import file_prompts
from dflash2.generation import DFlash2Drafter, load_target
from dflash2.tasks import prompt_ids
from dflash2.training.trainer import collate, held_out_acceptance

torch.set_num_threads(1)
path = sys.argv[1]
prompt_file = sys.argv[2] if len(sys.argv) > 2 else ".carry/prompts.jsonl.gz"
drafter = DFlash2Drafter.from_pretrained(path, dtype=torch.float32)
target, tokenizer = load_target(drafter.config, dtype=torch.float32)
target.eval()
drafter.eval().attach(target)
eos = tokenizer.eos_token_id
rows = []
for prompt in file_prompts(prompt_file)[:12]:
    ids = torch.tensor([prompt_ids(tokenizer, prompt, 512)])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False,
                          pad_token_id=eos)
    answer = out[0, ids.shape[1]:].tolist()
    answer = answer[: answer.index(eos) + 1] if eos in answer else answer
    rows.append({"input_ids": ids[0].tolist() + answer, "prompt_length": ids.shape[1]})
batches = [collate(rows[i: i + 4], 1024, 0) for i in range(0, len(rows), 4)]
estimate = held_out_acceptance(drafter, target, batches, drafter.config.target_layer_ids, torch.device("cpu"))
print(json.dumps({"drafter": path, "walk_tau": round(estimate["tau"], 3),
                  "anchor_mean": round(estimate["anchor_mean"], 3), "answers": estimate["answers"]}))
