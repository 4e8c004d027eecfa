"""Train a DFlash 2 (or DFlash 1) drafter for any HF causal LM target.

Each training sequence is a prompt answered by the target itself (self-distillation). Per step: the frozen target
computes the hidden states of the tapped layers, many random anchors are drawn among the response tokens, and all
their blocks `[anchor, MASK x (B-1)]` are denoised in one drafter forward under a block attention mask (a block sees
the context before its anchor and itself, never another block). Loss: position-weighted cross-entropy of the draft
rows plus the selector's K-way cross-entropy given the true predecessor. The target's embeddings and head stay frozen.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash2.generation.export import atomic_folder
from dflash2.modeling_dflash2 import DFlash2DraftModel, bilinear_scores, tap_target_features


@dataclass
class TrainConfig:
    anchors_per_sequence: int = 64
    batch_size: int = 8
    max_length: int = 512
    learning_rate: float = 6e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04
    max_steps: int = 1000
    time_budget_s: float | None = None  # stop (and anneal the schedule) by wall time instead of steps
    grad_clip: float = 1.0
    gamma: float | None = None  # position decay; None: 4 for B=8, 5 for B=10, 7 for B=16 (interpolated)
    selector_weight: float = 0.5
    selector_ramp_fraction: float = 0.2
    eval_every: int = 200
    checkpoint_every: int = 500
    seed: int = 0
    bf16: bool = True
    log_every: int = 25
    extra: dict = field(default_factory=dict)


def default_gamma(block_size: int) -> float:
    return 4.0 + (block_size - 8) * 3.0 / 8.0 if block_size >= 8 else 4.0


# ------------------------------------------------------------------------------------------------ the pieces
def sample_anchors(response_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Anchor positions per sequence: positions p >= 1 whose next token is a response token.

    response_mask: [b, L] bool (True on tokens the target wrote). Returns [b, N] (drawn with replacement when a
    sequence has fewer valid positions; -1 where a sequence has none).
    """
    valid = torch.zeros_like(response_mask)
    valid[:, 1:-1] = response_mask[:, 2:]
    anchors = torch.full((response_mask.shape[0], num_anchors), -1, dtype=torch.long)
    for row in range(response_mask.shape[0]):
        positions = valid[row].nonzero().flatten().cpu()
        if len(positions) == 0:
            continue
        if len(positions) >= num_anchors:
            chosen = positions[torch.randperm(len(positions), generator=generator)[:num_anchors]]
        else:
            chosen = positions[torch.randint(len(positions), (num_anchors,), generator=generator)]
        anchors[row] = chosen.sort().values
    return anchors


def block_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """[b, 1, N*B, L + N*B] bool: block n sees context positions < anchor_n and its own B rows only."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    rows = num_blocks * block_size
    block_of_row = torch.arange(rows, device=device) // block_size
    sees_context = torch.arange(context_length, device=device)[None, None, :] < anchors[:, block_of_row, None]
    sees_block = block_of_row[:, None] == block_of_row[None, :]
    mask = torch.cat([sees_context, sees_block[None].expand(batch, rows, rows)], dim=-1)
    return mask[:, None]


def block_inputs(token_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block ids [b, N*B], absolute positions [b, L + N*B], targets [b, N, B] (-100 where nothing to predict)."""
    batch, length = token_ids.shape
    offsets = torch.arange(block_size, device=token_ids.device)
    positions = anchors.clamp(min=0)[:, :, None] + offsets  # [b, N, B]
    in_range = (positions < length) & (anchors[:, :, None] >= 0)
    targets = torch.where(in_range, token_ids.gather(1, positions.clamp(max=length - 1).flatten(1)).view_as(positions),
                          torch.full_like(positions, -100))
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = token_ids.gather(1, anchors.clamp(min=0))
    context_positions = torch.arange(length, device=token_ids.device).expand(batch, length)
    return block_ids.flatten(1), torch.cat([context_positions, positions.flatten(1)], dim=1), targets


def position_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for draft rows k = 1..B-1 (row 0, the anchor, weighs 0)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def denoise_blocks(drafter: DFlash2DraftModel, features, token_ids, anchors):
    """All blocks of a batch in one drafter forward. Returns hidden [b, N, B, H] and block ids [b, N*B]."""
    config = drafter.config
    block_ids, positions, _ = block_inputs(token_ids, anchors, config.block_size, config.mask_token_id)
    mask = block_attention_mask(anchors.to(token_ids.device), token_ids.shape[1], config.block_size)
    hidden = drafter(noise_embeds=drafter.embed_block(block_ids), context_hidden_states=features,
                     position_ids=positions, attention_mask=mask).last_hidden_state
    return hidden.unflatten(1, (-1, config.block_size)), block_ids


def drafter_losses(drafter: DFlash2DraftModel, features, token_ids, response_mask, anchors, gamma: float):
    """Cross-entropy of the draft rows and the selector loss, plus accuracy statistics (detached tensors: reading
    them synchronises with the device, so the training loop reads them only when it logs)."""
    config = drafter.config
    block_size = config.block_size
    response_targets = torch.where(response_mask, token_ids, torch.full_like(token_ids, -100))
    _, _, targets = block_inputs(response_targets, anchors, block_size, config.mask_token_id)
    targets[:, :, 0] = -100
    hidden, block_ids = denoise_blocks(drafter, features, token_ids, anchors)  # [b, N, B, H]
    draft_hidden = hidden[:, :, 1:]
    draft_targets = targets[:, :, 1:]
    valid = draft_targets >= 0
    weights = position_weights(block_size, gamma, hidden.device)[1:].expand_as(draft_targets) * valid
    unary = drafter.unary_logits(draft_hidden).float()  # [b, N, B-1, V]
    token_loss = F.cross_entropy(unary.flatten(0, 2), draft_targets.flatten().clamp(min=0), reduction="none")
    loss = (token_loss * weights.flatten()).sum() / weights.sum().clamp(min=1e-6)
    stats = {"token_loss": loss.detach()}
    top1 = (unary.argmax(-1) == draft_targets) & valid
    stats["top1_by_position"] = top1.sum((0, 1)).float() / valid.sum((0, 1)).clamp(min=1)

    selector = drafter.candidate_selector
    if selector is not None:
        top_scores, candidates = unary.topk(selector.top_k, dim=-1)
        predecessors = block_ids.view_as(targets)[:, :, :1]  # the anchor, then the true previous tokens
        predecessors = torch.cat([predecessors, draft_targets[:, :, :-1].clamp(min=0)], dim=2)
        scores = bilinear_scores(top_scores, candidates, predecessors.unsqueeze(-1), selector.hidden_projection(
            draft_hidden), selector.predecessor_codebook, selector.successor_codebook).squeeze(-2)  # [b, N, B-1, K]
        hit = candidates == draft_targets.unsqueeze(-1)
        in_top_k = hit.any(-1) & valid
        selector_loss = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none")
        selector_weights = weights * in_top_k
        selector_loss = (selector_loss * selector_weights.flatten()).sum() / selector_weights.sum().clamp(min=1e-6)
        stats["selector_loss"] = selector_loss.detach()
        stats["top_k_recall"] = in_top_k.sum() / valid.sum().clamp(min=1)
    else:
        selector_loss = loss.new_zeros(())
    return loss, selector_loss, stats


def estimate_acceptance_length(top1_by_position_correct: torch.Tensor) -> float:
    """tau of greedy drafting from per-anchor correctness [n, B-1]: 1 + number of leading correct drafts."""
    leading = torch.cumprod(top1_by_position_correct.long(), dim=-1).sum(-1)
    return float(1.0 + leading.float().mean())


@torch.no_grad()
def held_out_tau(drafter, target, batches, layer_ids, device) -> float:
    """tau estimate on held-out sequences: the selector's greedy walk at random anchors vs the target's tokens."""
    drafter.eval()
    correct_rows = []
    for token_ids, response_mask in batches:
        anchors = sample_anchors(response_mask, 16, torch.Generator().manual_seed(1234)).to(device)
        token_ids, response_mask = token_ids.to(device), response_mask.to(device)
        features = target_hidden_features(target, token_ids, layer_ids)
        _, _, targets = block_inputs(token_ids, anchors, drafter.config.block_size, drafter.config.mask_token_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden, block_ids = denoise_blocks(drafter, features, token_ids, anchors)
        hidden = hidden.float().flatten(0, 1)  # [b*N, B, H]
        anchor_ids = block_ids.view(-1, drafter.config.block_size)[:, 0]
        drafts = drafter.propose(anchor_ids, hidden.to(drafter.dtype)).tokens
        truth = targets.flatten(0, 1)[:, 1:]
        keep = (anchors.flatten() >= 0) & (truth >= 0).all(-1)
        correct_rows.append((drafts == truth)[keep].cpu())
    drafter.train()
    return estimate_acceptance_length(torch.cat(correct_rows)) if correct_rows else float("nan")


def target_hidden_features(target, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden_states = target(input_ids=token_ids, output_hidden_states=True).hidden_states
    return tap_target_features(hidden_states, layer_ids)


# ------------------------------------------------------------------------------------------------ data
def load_sequences(path) -> list[dict]:
    """JSONL rows {"input_ids": [...], "prompt_length": int} written by `training.selfdistill`."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def collate(rows: list[dict], max_length: int, pad_id: int):
    length = min(max_length, max(len(r["input_ids"]) for r in rows))
    token_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = row["input_ids"][:length]
        token_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, row["prompt_length"]: len(ids)] = True
    return token_ids, response_mask


# ------------------------------------------------------------------------------------------------ the loop
def learning_rate_factor(progress: float, warmup_fraction: float) -> float:
    """Linear warm-up, then cosine decay to 10%; progress in [0, 1] of steps or of the time budget."""
    if progress < warmup_fraction:
        return max(progress / max(warmup_fraction, 1e-8), 0.01)
    tail = (progress - warmup_fraction) / max(1 - warmup_fraction, 1e-8)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(tail, 1.0)))


def save_checkpoint(drafter, optimizer, step: int, directory: Path, train_config: TrainConfig) -> None:
    """Atomic: the whole checkpoint folder appears at once or not at all."""
    with atomic_folder(directory) as staging:
        drafter.save_pretrained(staging / "drafter")
        torch.save({"optimizer": optimizer.state_dict(), "step": step, "train_config": asdict(train_config),
                    "rng": torch.get_rng_state()}, staging / "trainer_state.pt")


def train(drafter, target, sequences, train_config: TrainConfig, output_dir, held_out=None, resume: bool = True,
          progress: bool = True, log=print):
    """Train `drafter` (already bound to `target`) on self-distilled `sequences`. Returns the history of logs."""
    device = next(target.parameters()).device
    drafter.to(device).train()
    output_dir = Path(output_dir)
    checkpoint_dir = output_dir / "checkpoint"
    parameters = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=train_config.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=train_config.weight_decay)
    start_step = 0
    if resume and (checkpoint_dir / "trainer_state.pt").exists():
        state = torch.load(checkpoint_dir / "trainer_state.pt", weights_only=False)
        drafter.load_state_dict(type(drafter).from_pretrained(checkpoint_dir / "drafter").state_dict())
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        log(f"resumed from step {start_step}")
    gamma = train_config.gamma or default_gamma(drafter.config.block_size)
    layer_ids = list(drafter.config.target_layer_ids)
    pad_id = drafter.config.pad_token_id if drafter.config.pad_token_id is not None else 0
    rng = random.Random(train_config.seed + start_step)
    generator = torch.Generator().manual_seed(train_config.seed + start_step)
    held_out_batches = [collate(held_out[i: i + 8], train_config.max_length, pad_id)
                        for i in range(0, len(held_out or []), 8)]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["input_ids"]))
    buckets = [order[i: i + train_config.batch_size] for i in range(0, len(order), train_config.batch_size)]
    history = []
    started = time.time()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train_config.max_steps, initial=start_step, desc="train", mininterval=5)
    step = start_step
    while step < train_config.max_steps:
        elapsed = time.time() - started
        if train_config.time_budget_s is not None and elapsed > train_config.time_budget_s:
            break
        fraction = step / train_config.max_steps
        if train_config.time_budget_s is not None:
            fraction = max(fraction, elapsed / train_config.time_budget_s)
        for group in optimizer.param_groups:
            group["lr"] = train_config.learning_rate * learning_rate_factor(fraction, train_config.warmup_fraction)
        selector_weight = train_config.selector_weight * min(1.0, fraction / max(train_config.selector_ramp_fraction,
                                                                                    1e-8))
        token_ids, response_mask = collate([sequences[i] for i in rng.choice(buckets)], train_config.max_length,
                                           pad_id)
        # anchors are drawn on the host copy: no device synchronisation per row
        anchors = sample_anchors(response_mask, train_config.anchors_per_sequence, generator).to(device)
        token_ids, response_mask = token_ids.to(device), response_mask.to(device)
        features = target_hidden_features(target, token_ids, layer_ids)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train_config.bf16 and device.type == "cuda"):
            token_loss, selector_loss, stats = drafter_losses(drafter, features, token_ids, response_mask, anchors,
                                                              gamma)
            loss = token_loss + selector_weight * selector_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, train_config.grad_clip)
        optimizer.step()
        step += 1
        if bar is not None:
            bar.update(1)
        if step % train_config.log_every == 0 or step == 1:
            record = {"step": step, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                      "lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(time.time() - started, 1),
                      **{name: value.tolist() for name, value in stats.items()}}
            history.append(record)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                            if k != "top1_by_position"}))
        if held_out_batches and step % train_config.eval_every == 0:
            tau = held_out_tau(drafter, target, held_out_batches, layer_ids, device)
            history.append({"step": step, "held_out_tau": tau})
            log(json.dumps({"step": step, "held_out_tau": round(tau, 3)}))
        if step % train_config.checkpoint_every == 0:
            save_checkpoint(drafter, optimizer, step, checkpoint_dir, train_config)
    if bar is not None:
        bar.close()
    if held_out_batches:
        tau = held_out_tau(drafter, target, held_out_batches, layer_ids, device)
        history.append({"step": step, "held_out_tau": tau, "final": True})
        log(json.dumps({"step": step, "held_out_tau": round(tau, 3), "final": True}))
    save_checkpoint(drafter, optimizer, step, checkpoint_dir, train_config)
    return history
