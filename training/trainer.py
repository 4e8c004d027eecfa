"""Train a DFlash 2 (or DFlash 1) drafter for any HF causal LM target.

Each training sequence is a prompt answered by the target itself (self-distillation). Per step: the frozen target
computes the hidden states of the tapped layers, many random anchors are drawn among the response tokens, and all
their blocks `[anchor, MASK x (B-1)]` are denoised in one drafter forward under a block attention mask (a block sees
the context before its anchor and itself, never another block). Loss: position-weighted cross-entropy of the draft
rows plus the selector's K-way cross-entropy given the true predecessor; with `soft_label_weight` the labels mix in
the target's own next-token distribution (its top-k, from the same target forward). The target's embeddings and head
stay frozen.

Several processes (`torchrun --nproc_per_node N`, one per GPU; see `training/distributed.py`): every process holds the
frozen target and the same drafter; the drafter's loss module is wrapped in DistributedDataParallel, so gradients are
averaged across processes. A step's global batch is `batch_size x N` sequences (one length bucket); process r takes
rows [r * batch_size, (r + 1) * batch_size) of it. The loss is normalised by the weights of the whole global batch, so
one step of N processes computes the same gradient as one process holding the whole global batch (up to the order of
floating-point sums). Process 0 logs, estimates the held-out tau and writes checkpoints.

Everything a step draws is a function of (seed, step): the data order (length buckets in a per-epoch permutation) and
the anchors. A checkpoint holds the drafter, the optimizer, the step, the training time consumed and the RNG states,
so a run cut into several jobs (`job_time_limit_s` / `job_max_steps`, then resume) follows the same schedule and, in
fp32 on the CPU, reaches bit-identical weights to one uninterrupted job.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dflash2.generation.export import atomic_folder
from dflash2.modeling_dflash2 import DFlash2DraftModel, bilinear_scores, tap_target_features, walk_path
from dflash2.training.distributed import broadcast_from_main, host_group, rank_and_world


@dataclass
class TrainConfig:
    anchors_per_sequence: int = 64
    unique_anchors: bool = False  # True: never two blocks at one position (fewer blocks on short sequences)
    batch_size: int = 8  # sequences per process and step; the global batch is batch_size x number of processes
    max_length: int = 512
    learning_rate: float = 6e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04
    max_steps: int = 1000
    epochs: float | None = None  # passes over the data: the schedule ends at min(max_steps, epochs x steps per epoch)
    time_budget_s: float | None = None  # training seconds over all jobs of the run: anneal (and stop) by time
    job_time_limit_s: float | None = None  # this job stops after so many seconds (checkpoint written; resume goes on)
    job_max_steps: int | None = None  # this job stops after so many steps
    grad_clip: float = 1.0
    gamma: float | None = None  # position decay; None: 4 for B=8, 5 for B=10, 7 for B=16 (interpolated)
    selector_weight: float = 0.5
    selector_ramp_fraction: float = 0.2
    soft_label_weight: float = 0.0  # share of the target's own distribution in the labels (0: the answer's tokens)
    soft_label_top_k: int = 32  # the target's distribution kept as its top-k tokens, renormalised
    eval_every: int = 200
    memory_probe: bool | None = None  # one forward/backward on the longest batch first (None: on CUDA only)
    checkpoint_every: int = 500
    seed: int = 0
    bf16: bool = True
    log_every: int = 25
    extra: dict = field(default_factory=dict)


def default_gamma(block_size: int) -> float:
    return 4.0 + (block_size - 8) * 3.0 / 8.0 if block_size >= 8 else 4.0


# ------------------------------------------------------------------------------------------------ the pieces
def sample_anchors(response_mask: torch.Tensor, num_anchors: int, generator: torch.Generator,
                   unique: bool = False) -> torch.Tensor:
    """Anchor positions per sequence: positions p >= 1 whose next token is a response token.

    response_mask: [b, L] bool (True on tokens the target wrote). Returns [b, N], each row sorted. A sequence with
    fewer valid positions than `num_anchors` gets them drawn with replacement, or with `unique` each valid position
    once, the rest of its row -1 (and N shrinks to the most valid positions any row has). -1 where a sequence has none.
    """
    valid = torch.zeros_like(response_mask)
    valid[:, 1:-1] = response_mask[:, 2:]
    if unique:
        num_anchors = max(1, min(num_anchors, int(valid.sum(1).max())))
    anchors = torch.full((response_mask.shape[0], num_anchors), -1, dtype=torch.long)
    for row in range(response_mask.shape[0]):
        positions = valid[row].nonzero().flatten().cpu()
        if len(positions) == 0:
            continue
        if len(positions) >= num_anchors:
            chosen = positions[torch.randperm(len(positions), generator=generator)[:num_anchors]]
        elif unique:
            chosen = positions
        else:
            chosen = positions[torch.randint(len(positions), (num_anchors,), generator=generator)]
        anchors[row, : len(chosen)] = chosen.sort().values
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


def drafter_loss_terms(drafter: DFlash2DraftModel, features, token_ids, response_mask, anchors, gamma: float,
                       soft_labels: SoftLabels | None = None, soft_weight: float = 0.0) -> dict:
    """The unnormalised pieces of the loss: weighted sums and their weights (token and selector), and counts for the
    statistics (detached). Sums, not means, so that several processes can normalise by the whole global batch.

    `soft_labels` (the target's top-k distribution at every position, from `target_features_and_labels`) with
    `soft_weight` w: each draft row's label is (1 - w) x the answer's token + w x the target's distribution after the
    true prefix, for the draft rows and for the selector (over its K candidates, the target's probabilities of
    those candidates)."""
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
    soft = None if soft_labels is None or soft_weight == 0 else soft_labels.for_blocks(anchors, block_size)
    if soft is None:
        token_loss = F.cross_entropy(unary.flatten(0, 2), draft_targets.flatten().clamp(min=0), reduction="none")
    else:  # cross-entropy against the mixed label: logsumexp(z) - (1 - w) z[token] - w sum_i p_i z[id_i]
        hard_logit = unary.gather(-1, draft_targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        soft_logit = (soft.probs * unary.gather(-1, soft.ids)).sum(-1)
        token_loss = (unary.logsumexp(-1) - (1 - soft_weight) * hard_logit - soft_weight * soft_logit).flatten()
    top1 = (unary.argmax(-1) == draft_targets) & valid
    terms = {"token_sum": (token_loss * weights.flatten()).sum(), "token_weight": weights.sum(),
             "top1_correct": top1.sum((0, 1)).float(), "top1_valid": valid.sum((0, 1)).float(),
             "valid": valid.sum().float()}
    selector = drafter.candidate_selector
    if selector is not None:
        top_scores, candidates = unary.topk(selector.top_k, dim=-1)
        predecessors = block_ids.view_as(targets)[:, :, :1]  # the anchor, then the true previous tokens
        predecessors = torch.cat([predecessors, draft_targets[:, :, :-1].clamp(min=0)], dim=2)
        scores = bilinear_scores(top_scores, candidates, predecessors.unsqueeze(-1), selector.hidden_projection(
            draft_hidden), selector.predecessor_codebook, selector.successor_codebook).squeeze(-2)  # [b, N, B-1, K]
        hit = candidates == draft_targets.unsqueeze(-1)
        in_top_k = hit.any(-1) & valid
        selector_loss = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(),
                                        reduction="none").view_as(in_top_k) * in_top_k  # [b, N, B-1]
        selector_share = in_top_k.float()  # which rows the selector's loss covers, and how much
        if soft is not None:  # the target's probabilities of the K candidates, renormalised over them
            mass = ((candidates.unsqueeze(-1) == soft.ids.unsqueeze(-2)) * soft.probs.unsqueeze(-2)).sum(-1)
            has_mass = (mass.sum(-1) > 0) & valid
            candidate_probs = mass / mass.sum(-1, keepdim=True).clamp(min=1e-12)
            soft_selector = -(candidate_probs * scores.float().log_softmax(-1)).sum(-1) * has_mass
            selector_loss = (1 - soft_weight) * selector_loss + soft_weight * soft_selector
            selector_share = (1 - soft_weight) * selector_share + soft_weight * has_mass
        terms["selector_sum"] = (selector_loss * weights).sum()
        terms["selector_weight"] = (selector_share * weights).sum()
        terms["in_top_k"] = in_top_k.sum().float()
    return terms


def drafter_losses(drafter: DFlash2DraftModel, features, token_ids, response_mask, anchors, gamma: float):
    """Cross-entropy of the draft rows and the selector loss (this batch's weighted means), plus accuracy statistics
    (detached tensors: reading them synchronises with the device, so the training loop reads them only when it
    logs)."""
    terms = drafter_loss_terms(drafter, features, token_ids, response_mask, anchors, gamma)
    loss = terms["token_sum"] / terms["token_weight"].clamp(min=1e-6)
    stats = {"token_loss": loss.detach(), "top1_by_position": terms["top1_correct"] / terms["top1_valid"].clamp(min=1)}
    if "selector_sum" in terms:
        selector_loss = terms["selector_sum"] / terms["selector_weight"].clamp(min=1e-6)
        stats["selector_loss"] = selector_loss.detach()
        stats["top_k_recall"] = terms["in_top_k"] / terms["valid"].clamp(min=1)
    else:
        selector_loss = loss.new_zeros(())
    return loss, selector_loss, stats


class DrafterObjective(nn.Module):
    """The training loss as a module around the drafter, so DistributedDataParallel can wrap it: the drafter's
    parameters are its only parameters (the target's embeddings and head are borrowed, not registered).

    The weighted sums are divided by their weights summed over all `world_size` processes (one all-reduce of two
    numbers) and multiplied by `world_size`, which DDP's gradient averaging divides back out: the gradient is the
    one of the whole global batch's loss. With one process this is `drafter_losses` exactly.
    """

    def __init__(self, drafter: DFlash2DraftModel, world_size: int = 1):
        super().__init__()
        self.drafter = drafter
        self.world_size = world_size

    def forward(self, features, token_ids, response_mask, anchors, gamma: float, selector_weight: float,
                soft_labels: SoftLabels | None = None, soft_weight: float = 0.0):
        terms = drafter_loss_terms(self.drafter, features, token_ids, response_mask, anchors, gamma, soft_labels,
                                   soft_weight)
        has_selector = "selector_sum" in terms
        normalisers = torch.stack([terms["token_weight"], terms["selector_weight"] if has_selector else
                                   terms["token_weight"]]).detach().float()
        if self.world_size > 1:
            dist.all_reduce(normalisers)
        token_loss = terms["token_sum"] / normalisers[0].clamp(min=1e-6)
        loss = token_loss
        terms["token_loss"] = token_loss.detach()  # this process's share: the shares add up to the global loss
        if has_selector:
            selector_loss = terms["selector_sum"] / normalisers[1].clamp(min=1e-6)
            loss = loss + selector_weight * selector_loss
            terms["selector_loss"] = selector_loss.detach()
        terms["loss"] = loss.detach()
        return loss * self.world_size, terms


def estimate_acceptance_length(top1_by_position_correct: torch.Tensor) -> float:
    """tau of greedy drafting from per-anchor correctness [n, B-1]: 1 + number of leading correct drafts, averaged
    over anchors (each position weighs alike, so easy stretches such as a repeated line count as much as hard ones:
    an upper bound on what decoding measures; `greedy_walk` is the estimate that matches it)."""
    leading = torch.cumprod(top1_by_position_correct.long(), dim=-1).sum(-1)
    return float(1.0 + leading.float().mean())


def greedy_walk(accepted: dict[int, int], first: int, end: int) -> tuple[int, int]:
    """(tokens, target forwards) of greedy speculative decoding along one known answer: the prefill forward writes the
    token at `first` (the answer's first position); a round at anchor p adds accepted[p] + 1 tokens (its accepted
    drafts and the target's own next token), never past `end`, and the next round's anchor is the last of them.
    This is how DFlash's loop walks a sequence, so tokens / forwards is the tau it measures on that answer."""
    anchor, forwards = first, 1
    while anchor < end - 1:
        anchor += min(accepted.get(anchor, 0) + 1, end - 1 - anchor)
        forwards += 1
    return end - first, forwards


def held_out_chunks(device: torch.device) -> tuple[int, int]:
    """(sequences per drafter forward, blocks per chunk of vocabulary-wide logits) for the held-out estimate, which
    drafts at every response position at once: a 768-token answer is 768 blocks, whose drafter forward and logits
    (15 x 49,152 per block for the default target) are large. Off CUDA one sequence and 256 blocks at a time keep it
    within a few GiB."""
    return (8, 4096) if device.type == "cuda" else (1, 256)


def held_out_batches(rows: list[dict], max_length: int, pad_id: int, device: torch.device) -> list:
    """`rows` collated into the batches `held_out_acceptance` takes on `device` (`held_out_chunks`)."""
    per_batch = held_out_chunks(device)[0]
    return [collate(rows[i: i + per_batch], max_length, pad_id) for i in range(0, len(rows), per_batch)]


def t1_candidate_agreement(candidates, pairs, target_log_probs, truth):
    """What a sampled round can take at temperature 1, row by row, along a known answer.

    candidates [n, R, K] and pairs [n, R, K, K] as `DFlash2DraftModel.candidate_scores` returns them;
    target_log_probs [n, R, K]: the target's log-probabilities (T = 1) of each row's candidates after the answer's
    prefix; truth [n, R]: the answer's tokens (negative: past its end). Returns, each [n, R]:
    coverage (the target's mass on the row's candidates: no verification accepts more at that row), acceptance
    (one draft sampled from the proposal after the answer's previous token is accepted with probability
    sum_j min(p_j, q_j)) and reachable (the row is in the answer and every earlier row's answer token is among its
    candidates, so a round can get there; row 0 always can).
    """
    p = target_log_probs.float().exp()
    previous_hit = candidates[:, :-1] == truth[:, :-1].unsqueeze(-1)  # [n, R-1, K]
    index = F.pad(previous_hit.long().argmax(-1), (1, 0))  # [n, R]: the previous token's candidate (row 0: any)
    hit_so_far = F.pad(previous_hit.any(-1), (1, 0), value=True).long().cumprod(1).bool()
    reachable = hit_so_far & (truth >= 0)
    k = candidates.shape[-1]
    scores = pairs.float().gather(2, index[:, :, None, None].expand(-1, -1, 1, k)).squeeze(2)  # [n, R, K]
    acceptance = torch.minimum(p, scores.softmax(-1)).sum(-1)
    return p.sum(-1), acceptance, reachable


@torch.no_grad()
def held_out_acceptance(drafter, target, batches, layer_ids, device) -> dict:
    """The drafter's greedy acceptance on held-out answers, drafted at every response position in one teacher-forced
    pass (the context of the round at anchor p is the target's hidden states of positions < p, as in decoding), and
    its agreement with the target sampling at T = 1 (`t1_candidate_agreement`) at the same rows.

    Returns {"tau": tokens / forwards of `greedy_walk` over all answers (what decoding these answers measures, prefill
    included), "anchor_mean": the per-position mean of `estimate_acceptance_length`, "answers": [(tokens, forwards)],
    "t1_coverage" / "t1_coverage_row1": the target's T = 1 mass on the candidates, over all rows in the answers /
    the first draft row, "t1_accept" / "t1_accept_row1": one sampled draft's chance of acceptance, over the rows a
    round can reach / the first row}.
    """
    was_training = drafter.training
    drafter.eval()
    block = drafter.config.block_size
    correct_rows, walks = [], []
    sums = torch.zeros(5, dtype=torch.float64)  # coverage, rows; row 1's coverage, acceptance, rows
    reach_sums = torch.zeros(2, dtype=torch.float64)  # acceptance over reachable rows, reachable rows
    for token_ids, response_mask in batches:
        anchors = sample_anchors(response_mask, token_ids.shape[1], torch.Generator(), unique=True).to(device)
        token_ids, response_mask = token_ids.to(device), response_mask.to(device)
        features, logits = target_features_and_logits(target, token_ids, layer_ids)
        log_normaliser = torch.stack([row.float().logsumexp(-1) for row in logits])  # [b, T]
        truth_ids = torch.where(response_mask, token_ids, torch.full_like(token_ids, -100))
        _, _, targets = block_inputs(truth_ids, anchors, block, drafter.config.mask_token_id)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden, block_ids = denoise_blocks(drafter, features, token_ids, anchors)
        hidden = hidden.float().flatten(0, 1)  # [b*N, B, H]
        anchor_ids = block_ids.view(-1, block)[:, 0]
        truth = targets.flatten(0, 1)[:, 1:]
        truth = torch.where(anchors.flatten().unsqueeze(-1) >= 0, truth, torch.full_like(truth, -100))
        # block i is sequence i // N's block at anchors.flatten()[i]; its draft row t reads the target after a + t
        sequence = torch.arange(anchors.numel(), device=device) // anchors.shape[1]
        row_position = (anchors.flatten().unsqueeze(-1) + torch.arange(block - 1, device=device)).clamp(
            0, token_ids.shape[1] - 1)  # [b*N, B-1]
        chunk = held_out_chunks(device)[1]
        drafts = []
        for i in range(0, len(anchor_ids), chunk):
            part = slice(i, i + chunk)
            # one LM-head pass gives both: the greedy drafts are the walk through these candidates (as `propose`)
            candidates, pairs = drafter.candidate_scores(anchor_ids[part], hidden[part].to(drafter.dtype))
            drafts.append(walk_path(pairs, candidates)[0])
            seq, pos = sequence[part].view(-1, 1, 1), row_position[part].unsqueeze(-1)
            log_probs = logits[seq, pos, candidates].float() - log_normaliser[seq, pos]
            coverage, acceptance, reachable = t1_candidate_agreement(candidates, pairs, log_probs, truth[part])
            valid = truth[part] >= 0
            sums += torch.stack([coverage[valid].sum(), valid.sum(), coverage[:, 0][valid[:, 0]].sum(),
                                 acceptance[:, 0][valid[:, 0]].sum(), valid[:, 0].sum()]).double().cpu()
            reach_sums += torch.stack([acceptance[reachable].sum(), reachable.sum()]).double().cpu()
        drafts = torch.cat(drafts)
        correct = (drafts == truth) & (truth >= 0)  # past the answer's end nothing is accepted
        accepted = torch.cumprod(correct.long(), dim=-1).sum(-1).view(anchors.shape).cpu()
        anchors, response_mask = anchors.cpu(), response_mask.cpu()
        whole = (truth >= 0).all(-1).cpu() & (anchors.flatten() >= 0)
        correct_rows.append(correct.cpu()[whole])
        for row in range(anchors.shape[0]):
            positions = response_mask[row].nonzero().flatten()
            if len(positions) == 0:
                continue
            valid = anchors[row] >= 0
            walks.append(greedy_walk(dict(zip(anchors[row][valid].tolist(), accepted[row][valid].tolist())),
                                     int(positions[0]), int(positions[-1]) + 1))
    drafter.train(was_training)
    rows = torch.cat(correct_rows) if correct_rows else torch.zeros(0, 1, dtype=torch.bool)
    tokens, forwards = sum(t for t, _ in walks), sum(f for _, f in walks)

    def ratio(total, count):
        return float(total / count) if count else float("nan")

    return {"tau": tokens / forwards if forwards else float("nan"),
            "anchor_mean": estimate_acceptance_length(rows) if len(rows) else float("nan"), "answers": walks,
            "t1_coverage": ratio(sums[0], sums[1]), "t1_coverage_row1": ratio(sums[2], sums[4]),
            "t1_accept": ratio(*reach_sums), "t1_accept_row1": ratio(sums[3], sums[4])}


def target_features_and_logits(target, token_ids: torch.Tensor, layer_ids: list[int]):
    """One target forward: the tapped features [b, T, taps*H] and the next-token logits [b, T, V]."""
    with torch.no_grad():
        out = target(input_ids=token_ids, output_hidden_states=True)
    return tap_target_features(out.hidden_states, layer_ids), out.logits


@dataclass
class SoftLabels:
    """The target's distribution of the next token after every position, kept as its top-k: probs [b, T, k]
    (renormalised to sum to one) and token ids [b, T, k]. Row t is the distribution of token t + 1."""
    probs: torch.Tensor
    ids: torch.Tensor

    def for_blocks(self, anchors: torch.Tensor, block_size: int) -> "SoftLabels":
        """The labels of every draft row of the blocks at `anchors` [b, N]: draft row j (1 .. B-1) of a block predicts
        the token at anchor + j, so it takes row anchor + j - 1. Returns [b, N, B-1, k] each (rows past the end repeat
        the last one; the loss gives them no weight)."""
        rows = anchors.unsqueeze(-1) + torch.arange(block_size - 1, device=anchors.device)  # [b, N, B-1]
        rows = rows.clamp(0, self.probs.shape[1] - 1).flatten(1).unsqueeze(-1)  # [b, N*(B-1), 1]

        def pick(x):  # [b, T, k] -> [b, N, B-1, k]
            return x.gather(1, rows.expand(-1, -1, x.shape[-1])).view(*anchors.shape, block_size - 1, x.shape[-1])

        return SoftLabels(pick(self.probs), pick(self.ids))


def target_features_and_labels(target, token_ids: torch.Tensor, layer_ids: list[int], top_k: int = 0):
    """One target forward: the tapped features and, with `top_k`, the soft labels (`SoftLabels`) of the target's top-k
    next-token distribution at temperature 1 (None without)."""
    features, logits = target_features_and_logits(target, token_ids, layer_ids)
    labels = None
    if top_k:  # a sequence at a time: a whole batch's fp32 logits and their softmax are 4.8 GB each at batch 32
        # and 768 tokens (a run with soft labels ran out of GPU memory beside one without, holding 70 GB to its 65)
        tops = [row.float().softmax(-1).topk(top_k, dim=-1) for row in logits]
        probs, ids = torch.stack([top.values for top in tops]), torch.stack([top.indices for top in tops])
        labels = SoftLabels(probs / probs.sum(-1, keepdim=True), ids)
    return features, labels


# ------------------------------------------------------------------------------------------------ data
def training_window(total: int, prompt_length: int, max_length: int) -> int:
    """Where a row longer than `max_length` starts: the whole response and the prompt's last tokens when the response
    leaves at least a quarter of the window to the prompt, else the last quarter-window of the prompt and the
    response's beginning. Rows that fit start at 0."""
    if total <= max_length:
        return 0
    context = max_length // 4
    if total - prompt_length <= max_length - context:
        return total - max_length
    return max(0, prompt_length - context)


def collate(rows: list[dict], max_length: int, pad_id: int):
    """Right-padded token ids [b, L] and the mask of response tokens [b, L], L <= max_length; a longer row keeps the
    window `training_window` picks (so a long prompt never pushes its response out)."""
    length = min(max_length, max(len(r["input_ids"]) for r in rows))
    token_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for i, row in enumerate(rows):
        start = training_window(len(row["input_ids"]), row["prompt_length"], max_length)
        ids = row["input_ids"][start: start + length]
        token_ids[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, max(0, row["prompt_length"] - start): len(ids)] = True
    return token_ids, response_mask


def length_buckets(sequences: list[dict], global_batch: int) -> list[list[int]]:
    """Sequence indices in buckets of `global_batch` similar lengths (little padding), covering every sequence once;
    the last bucket is filled up with its shorter neighbours so every bucket is whole (a few sequences then appear
    twice per epoch). Fewer sequences than one global batch: they repeat to fill it."""
    if not sequences:
        raise ValueError("no training sequences")
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]["input_ids"]), i))
    if len(order) < global_batch:
        order = sorted((order * math.ceil(global_batch / len(order)))[:global_batch],
                       key=lambda i: (len(sequences[i]["input_ids"]), i))
    buckets = [order[i: i + global_batch] for i in range(0, len(order) - global_batch + 1, global_batch)]
    if len(order) % global_batch:
        buckets.append(order[-global_batch:])
    return buckets


def epoch_order(num_buckets: int, seed: int, epoch: int) -> list[int]:
    """The order the buckets are visited in during `epoch`: a permutation fixed by (seed, epoch)."""
    order = list(range(num_buckets))
    random.Random(f"dflash2-train:{seed}:epoch:{epoch}").shuffle(order)
    return order


def step_generator(seed: int, step: int) -> torch.Generator:
    """The anchors of global step `step` are drawn from this generator (the same on every process)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2 ** 63))  # step -1: the memory probe


def planned_steps(train_config: TrainConfig, steps_per_epoch: int) -> int:
    """The length of the schedule in steps: max_steps, or fewer when `epochs` passes over the data end sooner."""
    if train_config.epochs is None:
        return train_config.max_steps
    return max(1, min(train_config.max_steps, math.ceil(train_config.epochs * steps_per_epoch)))


# ------------------------------------------------------------------------------------------------ checkpoints
def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states) -> None:
    if isinstance(states, torch.Tensor):  # checkpoints written before the dict
        torch.set_rng_state(states)
        return
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def save_checkpoint(drafter, optimizer, step: int, directory: Path, train_config: TrainConfig,
                    state: dict | None = None) -> None:
    """Atomic: the whole checkpoint folder appears at once or not at all. `drafter/` is a loadable drafter folder
    (fp32 training weights); `trainer_state.pt` holds the optimizer, the step, the config, the RNG states and `state`
    (the schedule and data-order position)."""
    with atomic_folder(directory) as staging:
        drafter.save_pretrained(staging / "drafter")
        torch.save({"optimizer": optimizer.state_dict(), "step": step, "train_config": asdict(train_config),
                    "rng": rng_states(), **(state or {})}, staging / "trainer_state.pt")


def load_checkpoint(drafter, optimizer, directory: Path) -> dict:
    """Load the drafter weights and optimizer state of a checkpoint in place; return its trainer state."""
    directory = Path(directory)
    state = torch.load(directory / "trainer_state.pt", weights_only=False, map_location="cpu")
    dtype = next(drafter.parameters()).dtype
    drafter.load_state_dict(type(drafter).from_pretrained(directory / "drafter", dtype=dtype).state_dict())
    optimizer.load_state_dict(state["optimizer"])
    return state


# ------------------------------------------------------------------------------------------------ the loop
def learning_rate_factor(progress: float, warmup_fraction: float) -> float:
    """Linear warm-up, then cosine decay to 10%; progress in [0, 1] of steps or of the time budget."""
    if progress < warmup_fraction:
        return max(progress / max(warmup_fraction, 1e-8), 0.01)
    tail = (progress - warmup_fraction) / max(1 - warmup_fraction, 1e-8)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(tail, 1.0)))


def schedule_progress(step: int, total_steps: int, time_consumed_s: float, train_config: TrainConfig) -> float:
    """Where the run stands in [0, 1]: of its steps, or of its time budget when that is further along."""
    fraction, budget = step / total_steps, train_config.time_budget_s
    return fraction if budget is None else max(fraction, time_consumed_s / budget)


def stop_reason(step: int, job_steps: int, total_steps: int, time_consumed_s: float, job_seconds: float,
                train_config: TrainConfig) -> str | None:
    if step >= total_steps:
        return "schedule done (steps)"
    if train_config.time_budget_s is not None and time_consumed_s >= train_config.time_budget_s:
        return "schedule done (time budget)"
    if train_config.job_time_limit_s is not None and job_seconds >= train_config.job_time_limit_s:
        return "job time limit"
    if train_config.job_max_steps is not None and job_steps >= train_config.job_max_steps:
        return "job step limit"
    return None


def _reduced_record(terms: dict, loss_share: torch.Tensor, world: int) -> dict:
    """The logged statistics of the global batch: each process's shares and counts, summed over processes."""
    keys = [k for k in ("token_loss", "selector_loss", "in_top_k", "valid") if k in terms]
    packed = torch.cat([loss_share.float().reshape(1)] + [terms[k].float().reshape(1) for k in keys]
                       + [terms["top1_correct"].float(), terms["top1_valid"].float()])
    if world > 1:
        dist.all_reduce(packed)
    values = dict(zip(["loss"] + keys, packed[: 1 + len(keys)].tolist()))
    correct, counted = packed[1 + len(keys):].chunk(2)
    record = {"loss": values["loss"], "token_loss": values["token_loss"]}
    if "selector_loss" in values:
        record["selector_loss"] = values["selector_loss"]
        record["top_k_recall"] = values["in_top_k"] / max(values["valid"], 1.0)
    record["top1_by_position"] = (correct / counted.clamp(min=1)).tolist()
    return record


def train(drafter, target, sequences, train_config: TrainConfig, output_dir, held_out=None, resume: bool = True,
          progress: bool = True, log=print, held_out_sampled=None):
    """Train `drafter` (already bound to `target`) on self-distilled `sequences`. Returns the history of logs.

    `held_out`: answers scored every `eval_every` steps (`held_out_acceptance`: the greedy walk's tau and the T = 1
    measures); `held_out_sampled`: sampled answers of held-out prompts, which then give the T = 1 measures instead
    (the contexts sampled decoding meets; the record's `held_out_t1_on` says which answers gave them).

    In a process group (torchrun; `training.distributed.init_distributed`) every process calls this with the same
    sequences and a drafter of the same initialisation; process 0 logs, evaluates and writes checkpoints. With
    `resume`, a checkpoint in `<output_dir>/checkpoint` is continued: same weights, optimizer state, step, time
    consumed and data order. The job stops at the end of the schedule (steps, epochs or time budget) or at its own
    limit (`job_time_limit_s`, `job_max_steps`), and always leaves a checkpoint.
    """
    rank, world = rank_and_world()
    main = rank == 0
    if not main:
        log = lambda line: None  # noqa: E731
    device = next(target.parameters()).device
    drafter.to(device).train()
    output_dir = Path(output_dir)
    checkpoint_dir = output_dir / "checkpoint"
    parameters = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=train_config.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=train_config.weight_decay)
    global_batch = train_config.batch_size * world
    buckets = length_buckets(sequences, global_batch)
    total_steps = planned_steps(train_config, len(buckets))
    start_step, time_before = 0, 0.0
    if resume and (checkpoint_dir / "trainer_state.pt").exists():
        state = load_checkpoint(drafter, optimizer, checkpoint_dir)
        start_step = state["step"]
        time_before = float(state.get("time_consumed_s", 0.0))
        saved_batch = state.get("global_batch", global_batch)
        if saved_batch != global_batch or state.get("num_sequences", len(sequences)) != len(sequences):
            raise ValueError(
                f"{checkpoint_dir}: written by a run of {state.get('num_sequences')} sequences in global batches of "
                f"{saved_batch}; this one has {len(sequences)} in batches of {global_batch} (batch size x processes). "
                "Resume with the same data, batch size and number of processes, or start over (--no-resume).")
        if "rng" in state:
            restore_rng_states(state["rng"])
        log(json.dumps({"resumed": start_step, "time_consumed_s": round(time_before, 1),
                        "planned_steps": total_steps, "epoch": start_step / len(buckets)}))
    objective = DrafterObjective(drafter, world)
    model = objective
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    timing_group = host_group()
    gamma = train_config.gamma or default_gamma(drafter.config.block_size)
    layer_ids = list(drafter.config.target_layer_ids)
    pad_id = drafter.config.pad_token_id if drafter.config.pad_token_id is not None else 0

    def batches_of(rows):  # process 0 evaluates
        return held_out_batches(rows if main and rows else [], train_config.max_length, pad_id, device)

    greedy_batches, sampled_batches = batches_of(held_out), batches_of(held_out_sampled)
    local_rows = slice(rank * train_config.batch_size, (rank + 1) * train_config.batch_size)
    history = []
    bar = None
    if progress and main:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc="train", mininterval=5)

    def checkpoint_state(at_step: int, consumed: float) -> dict:
        return {"time_consumed_s": consumed, "planned_steps": total_steps, "global_batch": global_batch,
                "world_size": world, "num_sequences": len(sequences),
                "epoch": at_step // len(buckets), "batch_in_epoch": at_step % len(buckets)}

    def evaluate(at_step: int, **extra) -> None:
        estimate = held_out_acceptance(drafter, target, greedy_batches, layer_ids, device)
        t1 = held_out_acceptance(drafter, target, sampled_batches, layer_ids, device) if sampled_batches else estimate
        record = {"step": at_step, "held_out_tau": estimate["tau"], "held_out_anchor_mean": estimate["anchor_mean"],
                  **{f"held_out_{key}": t1[key] for key in ("t1_coverage", "t1_coverage_row1", "t1_accept",
                                                            "t1_accept_row1")},
                  "held_out_t1_on": "sampled" if sampled_batches else "greedy", **extra}
        history.append(record)
        log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}))

    def forward_backward(bucket: list[int], generator: torch.Generator, selector_weight: float):
        # the whole global batch is collated and its anchors drawn on every process (same padding, same anchors as
        # one process holding it all); each process keeps its rows. Anchors are drawn on the host copy: no device
        # synchronisation per row.
        token_ids, response_mask = collate([sequences[i] for i in bucket], train_config.max_length, pad_id)
        anchors = sample_anchors(response_mask, train_config.anchors_per_sequence, generator,
                                 unique=train_config.unique_anchors)
        token_ids, response_mask = token_ids[local_rows].to(device), response_mask[local_rows].to(device)
        anchors = anchors[local_rows].to(device)
        features, soft_labels = target_features_and_labels(
            target, token_ids, layer_ids, train_config.soft_label_top_k if train_config.soft_label_weight > 0 else 0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train_config.bf16 and device.type == "cuda"):
            loss, terms = model(features, token_ids, response_mask, anchors, gamma, selector_weight, soft_labels,
                                train_config.soft_label_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return terms

    probe = train_config.memory_probe if train_config.memory_probe is not None else device.type == "cuda"
    if probe and start_step < total_steps:
        # the longest global batch first, forward and backward, no update: an out-of-memory error comes now, not
        # minutes into the job when that batch's turn comes; the peak memory is logged for sizing the batch
        longest = max(buckets, key=lambda bucket: max(len(sequences[i]["input_ids"]) for i in bucket))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        forward_backward(longest, step_generator(train_config.seed, -1), train_config.selector_weight)
        optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        log(json.dumps({"memory_probe": "longest batch", "tokens_per_sequence": min(
            train_config.max_length, max(len(sequences[i]["input_ids"]) for i in longest)),
            "peak_gib": None if peak is None else round(peak, 2)}))

    step = start_step
    if greedy_batches and step == 0 and total_steps > 0:
        evaluate(0)  # where the run starts from (the --init-from drafter, or the initialisation)
    job_started = time.time()
    order_epoch, order = -1, []
    while True:
        # wall-clock decisions are process 0's, so that every process stops at the same step with the same schedule
        job_seconds = broadcast_from_main([time.time() - job_started], timing_group)[0]
        consumed = time_before + job_seconds
        reason = stop_reason(step, step - start_step, total_steps, consumed, job_seconds, train_config)
        if reason is not None:
            break
        fraction = schedule_progress(step, total_steps, consumed, train_config)
        for group in optimizer.param_groups:
            group["lr"] = train_config.learning_rate * learning_rate_factor(fraction, train_config.warmup_fraction)
        selector_weight = train_config.selector_weight * min(1.0, fraction / max(train_config.selector_ramp_fraction,
                                                                                    1e-8))
        epoch, index = divmod(step, len(buckets))
        if epoch != order_epoch:
            order_epoch, order = epoch, epoch_order(len(buckets), train_config.seed, epoch)
        terms = forward_backward(buckets[order[index]], step_generator(train_config.seed, step), selector_weight)
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, train_config.grad_clip)
        optimizer.step()
        step += 1
        if bar is not None:
            bar.update(1)
        if step % train_config.log_every == 0 or step == start_step + 1:
            record = {"step": step, **_reduced_record(terms, terms["loss"], world), "grad_norm": float(grad_norm),
                      "lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(consumed, 1)}
            history.append(record)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                            if k != "top1_by_position"}))
        if greedy_batches and step % train_config.eval_every == 0:
            evaluate(step)
        if main and step % train_config.checkpoint_every == 0:
            save_checkpoint(drafter, optimizer, step, checkpoint_dir, train_config,
                            checkpoint_state(step, time_before + time.time() - job_started))
    if bar is not None:
        bar.close()
    log(json.dumps({"stopped": reason, "step": step, "planned_steps": total_steps,
                    "time_consumed_s": round(consumed, 1), "epochs": round(step / len(buckets), 3)}))
    if greedy_batches:
        evaluate(step, final=True)
    if main:
        save_checkpoint(drafter, optimizer, step, checkpoint_dir, train_config, checkpoint_state(step, consumed))
    if world > 1:
        dist.barrier(group=timing_group)  # every process returns once the checkpoint is complete
    return history
