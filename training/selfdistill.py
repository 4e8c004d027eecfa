"""Self-distillation data: prompts answered by the target itself, through its chat template."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from generation.integration import chat_prompt_ids


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


def write_jsonl(rows, path) -> None:
    """Atomic: a temporary file in the same folder, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    os.replace(temporary, path)
