# Generated from generation/sampling.py by `python -m dflash2.generation.flat_code`; do not edit.
"""Greedy and exact speculative acceptance, target-side warping and the randomness of a round, vectorised over rows.

DFlash 2's own loops support temperature, top-k and top-p (transformers' assisted loop honours every logits processor).
In the own loop's round they are data, not code: per-row tensors (`row_warped_probabilities`, `draft_temperature`,
`first_token`), so one captured or compiled round serves every setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Target-side warping DFlash 2's own loops support (transformers' assisted loop supports every processor)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_generation_config(cls, config) -> "Sampling":
        return cls(bool(config.do_sample), config.temperature or 1.0, config.top_k or 0, config.top_p or 1.0)


# EOS ids one request of the own loop may stop at: its round holds them in a fixed buffer, padded with -1
MAX_EOS_TOKENS = 16


def eos_token_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    padded_eos_ids(ids)  # refused here, before any buffer is built for the request
    return ids


def padded_eos_ids(ids) -> list[int]:
    """The distinct EOS ids, padded with -1 to `MAX_EOS_TOKENS` (no token is -1); one clear error beyond it."""
    distinct = sorted({int(i) for i in ids})
    if len(distinct) > MAX_EOS_TOKENS:
        raise ValueError(f"eos_token_id lists {len(distinct)} distinct ids; DFlash 2's own loop stops at up to "
                         f"{MAX_EOS_TOKENS}. Pass the ids that end a turn only, or pass one prompt with "
                         "loop='transformers' for transformers' assisted loop.")
    return distinct + [-1] * (MAX_EOS_TOKENS - len(distinct))


def is_any_of(tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`torch.isin(tokens, ids)` as one broadcast comparison: isin sorts and calls `unique` (a host synchronisation,
    which breaks a CUDA graph capture) when `ids` is large against `tokens`, as the 16 EOS slots are against one
    row's block."""
    return (tokens.unsqueeze(-1) == ids).any(-1)


def warped_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax of temperature/top-k/top-p-warped logits (fp32), as transformers' warpers compute them, for one setting:
    the plain reference `row_warped_probabilities` (the rounds' per-row version) is tested against."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = cumulative_probabilities(sorted_logits)
        remove_sorted = cumulative <= 1 - sampling.top_p
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def row_warped_probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor) -> torch.Tensor:
    """softmax of `row_warped_logits`: `warped_probabilities` with each row's own setting."""
    return row_warped_logits(logits, temperature, top_k, top_p).softmax(-1)


def row_warped_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """The logits `warped_probabilities` takes the softmax of (fp32, -inf where top-k or top-p removed a token), with
    each row's own setting, read from tensors: logits [b, ..., V]; temperature [b]
    (fp32), top_k [b] (long, 0: off), top_p [b] (fp64, 1.0: off). No value is read on the host, so a captured or
    compiled round serves every setting. One ascending sort serves both cuts: the top-k cut removes a prefix of it
    (the values below the k-th largest), and top-p's cumulative is taken over what is left, as transformers applies
    top-p after top-k. top_p is fp64 so that `1 - top_p` rounds to the threshold transformers compares against."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    per_row = (batch,) + (1,) * (logits.dim() - 1)
    logits = logits.float() / temperature.view(per_row)
    sorted_logits, order = logits.sort(dim=-1)  # ascending: [b, ..., V]
    k = top_k.view(per_row)
    kth = sorted_logits.gather(-1, (vocab - k).clamp(0, vocab - 1).expand(*sorted_logits.shape[:-1], 1))
    remove_sorted = (sorted_logits < kth) & (k > 0) & (k < vocab)
    cumulative = cumulative_probabilities(sorted_logits.masked_fill(remove_sorted, float("-inf")))
    p = top_p.view(per_row)
    remove_sorted = remove_sorted | ((cumulative <= (1 - p).float()) & (p < 1))
    remove_sorted[..., -1:] = False  # keep at least one token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _cumulative_probabilities(sorted_logits: torch.Tensor) -> torch.Tensor:
    """softmax then cumsum over the vocabulary, kept out of inductor's code: inductor (torch 2.11, Triton) fails to
    generate code for a scan this long ("Error in codegen ... SplitScan"). As a custom op it runs eagerly inside a
    compiled graph: no graph break (a whole-graph compile needs none), no host synchronisation."""
    return sorted_logits.softmax(-1).cumsum(-1)


if not hasattr(torch.ops.dflash2, "cumulative_probabilities"):  # once per process (the remote-code copy reuses it)
    torch.library.custom_op("dflash2::cumulative_probabilities", mutates_args=(),
                            schema="(Tensor sorted_logits) -> Tensor")(_cumulative_probabilities).register_fake(
        lambda sorted_logits: torch.empty_like(sorted_logits))
cumulative_probabilities = torch.ops.dflash2.cumulative_probabilities


def speculative_accept(drafts, draft_probs, target_probs, uniform, gumbel):
    """Exact speculative sampling, vectorised over rows and block positions.

    drafts [b, R]; draft_probs q [b, R, V]; target_probs p [b, R+1, V]; uniform [b, R]; gumbel [b, V].
    Accept draft t while u_t * q_t(d_t) < p_t(d_t); at the first rejection sample from normalise(max(p - q, 0))
    (p itself if that is empty); after R acceptances sample the bonus from p_R. Returns (accepted count [b],
    next token [b]).
    """
    rows = drafts.shape[1]
    p_draft = target_probs[:, :rows].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accepted = (uniform * q_draft < p_draft).long().cumprod(-1).sum(-1)  # [b]
    index = accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])
    p_next = target_probs.gather(1, index).squeeze(1)
    padded_q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # no q after the last draft
    residual = (p_next - padded_q.gather(1, index).squeeze(1)).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    next_token = (residual.log() + gumbel).argmax(-1)
    return accepted, next_token


def greedy_accept(drafts, target_logits):
    """Longest prefix of drafts equal to the target's argmax, and the target's token after it."""
    target_tokens = target_logits.argmax(-1)  # [b, R+1]
    accepted = (drafts == target_tokens[:, :-1]).long().cumprod(-1).sum(-1)
    return accepted, target_tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)


def first_token(logits, do_sample: bool, temperature, top_k, top_p, generator=None):
    """The token after the prefill, per row (logits [b, V]): argmax, or a sample from the row's warped distribution
    (settings as in `row_warped_probabilities`)."""
    if not do_sample:
        return logits.argmax(-1)
    probabilities = row_warped_probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def draft_temperature(temperature: torch.Tensor):
    """Draft side: each row's temperature [b] only (q need not match p for exactness; it only sets the acceptance
    rate)."""

    def transform(t, drafted, scores, candidates=None):
        return scores / temperature.view(-1, 1)

    return transform
