"""Issue #13's throughputs on a GPU without the real target: a random-weight model of SmolLM2-135M's shape (llama, 30
layers, hidden 576, 9/3 heads, vocab 49152). Fits a staging call (no GGUF needed).

1. Self-distillation: one batch of random prompts answered by `training.decoding.answer_batch` (greedy, bf16), and a
   short `generate` run of the same prompts for comparison (tokens/s each).
2. Training: `training.trainer.train` on random sequences for a few seconds at the given recipe (block size,
   anchors, batch, max length): the memory probe's peak and steps/s.

    python scripts/gpu_probe_train.py [--rows 2048] [--new 512] [--block 16] [--anchors 128] [--batch 32] \
        [--max-length 768] [--train-s 40]
"""
import argparse
import json
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash2.configuration_dflash2 import DFlash2Config, default_target_layer_ids
from dflash2.modeling_dflash2 import DFlash2DraftModel
from dflash2.training import decoding
from dflash2.training.trainer import TrainConfig, train

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=2048)
parser.add_argument("--new", type=int, default=512)
parser.add_argument("--prompt", type=int, default=200, help="longest prompt; lengths spread over [prompt/4, prompt]")
parser.add_argument("--block", type=int, default=16)
parser.add_argument("--anchors", type=int, default=128)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--max-length", type=int, default=768)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--train-s", type=float, default=40)
parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
args = parser.parse_args()
device = torch.device(args.device)
sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
torch.manual_seed(0)
target = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}

generator = torch.Generator().manual_seed(0)
lengths = torch.randint(args.prompt // 4, args.prompt + 1, (args.rows,), generator=generator).sort().values
prompts = [torch.randint(10, 49000, (int(n),), generator=generator).tolist() for n in lengths]
no_eos = [49151]  # random weights: run every row to the limit (the worst case)
graphed = decoding.answer_batch(target, prompts[:64], 32, 2, no_eos)  # also the warm-up
eager = decoding.answer_batch(target, prompts[:64], 32, 2, no_eos, graphs=False)
report["graph_equals_eager_rows"] = sum(a == b for a, b in zip(graphed, eager))
# rows that end at different steps (tokens the answers reach at steps 2..29 taken as EOS): the batch shrinks by
# halvings, each a new graph; the answers up to each row's end must still equal the eager loop's
ends = sorted({answer[step] for answer, step in zip(graphed, range(2, 30))})
cut = lambda answer: answer[: next((i + 1 for i, t in enumerate(answer) if t in ends), len(answer))]  # noqa: E731
graphed = decoding.answer_batch(target, prompts[:64], 32, 2, ends, check_every=2)
eager = decoding.answer_batch(target, prompts[:64], 32, 2, ends, check_every=2, graphs=False)
report["graph_equals_eager_rows_that_end"] = sum(cut(a) == cut(b) for a, b in zip(graphed, eager))
report["answer_lengths_that_end"] = sorted({len(cut(a)) for a in graphed})
for rows in (args.rows // 2, args.rows):
    sync()
    started = time.perf_counter()
    decoding.answer_batch(target, prompts[:rows], args.new, 2, no_eos)
    sync()
    seconds = time.perf_counter() - started
    report[f"inplace_rows{rows}"] = {"seconds": round(seconds, 2), "tokens_per_s": round(rows * args.new / seconds)}
    print(json.dumps(report), flush=True)
short = 64
few = min(256, args.rows)
ids = torch.full((few, int(lengths[few - 1])), 2, dtype=torch.long)
mask = torch.zeros_like(ids)
for i, p in enumerate(prompts[:few]):
    ids[i, -len(p):], mask[i, -len(p):] = torch.tensor(p), 1
sync()
started = time.perf_counter()
target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=short, do_sample=False,
                pad_token_id=2, eos_token_id=49151)
sync()
report[f"generate_rows{few}"] = {"new": short, "tokens_per_s": round(few * short / (time.perf_counter() - started))}
print(json.dumps(report), flush=True)
torch.cuda.empty_cache() if device.type == "cuda" else None
if args.train_s <= 0:
    raise SystemExit(0)

drafter_config = DFlash2Config.for_target(config, num_hidden_layers=args.layers, intermediate_size=1280,
                                          block_size=args.block, selector_rank=16, selector_top_k=16,
                                          target_layer_ids=default_target_layer_ids(30, 5), mask_token_id=49151)
drafter = DFlash2DraftModel(drafter_config).bind_target(target)
sequences = []
for i in range(512):
    n = int(torch.randint(args.max_length // 3, args.max_length + 1, (1,), generator=generator))
    sequences.append({"input_ids": torch.randint(10, 49000, (n,), generator=generator).tolist(),
                      "prompt_length": n // 4})
records = []
train_config = TrainConfig(anchors_per_sequence=args.anchors, unique_anchors=True, batch_size=args.batch,
                           max_length=args.max_length, max_steps=10 ** 6, time_budget_s=args.train_s,
                           eval_every=10 ** 6, checkpoint_every=10 ** 6, log_every=10 ** 6)
with tempfile.TemporaryDirectory() as out:
    started = time.perf_counter()
    train(drafter, target, sequences, train_config, out, progress=False,
                    log=lambda line: records.append(line) or print(line, flush=True))
    seconds = time.perf_counter() - started
steps = next((json.loads(r)["step"] for r in records if '"stopped"' in r), 0)
probe = next((json.loads(r) for r in records if "memory_probe" in r), {})
report["train"] = {"block": args.block, "anchors": args.anchors, "batch": args.batch, "max_length": args.max_length,
                   "layers": args.layers, "steps": steps, "seconds": round(seconds, 1),
                   "steps_per_s": round(steps / args.train_s, 2), "peak_gib": probe.get("peak_gib"),
                   "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if device.type == "cuda"
                   else None}
print(json.dumps(report), flush=True)
