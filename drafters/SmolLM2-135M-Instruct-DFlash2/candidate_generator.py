# Generated from generation/candidate_generator.py by `python -m dflash2.generation.flat_code`; do not edit.
"""DFlash 2 drafting inside transformers' assisted-generation loop (`target.generate(assistant_model=drafter)`).

Each round: take the target's hidden states of the newly verified positions from the last verification forward,
append them to the drafter's context cache, denoise one block `[anchor, MASK x (B-1)]`, and let the selector walk a
path through the top-k candidates. The loop then verifies the block with one target forward.

The drafter's side runs on the fixed buffers of a `DraftCore` (the own loop's drafter side): every round has the same
shapes, so on a GPU its step is a CUDA graph replayed each round (`DraftStep`), and nothing is read back from the
device (but on transformers 5.17, whose loop does not end accepted tokens at a drafted EOS: `cut_after_eos`).

A later turn of a conversation passes the target cache of the earlier turn back (`past_key_values=out.past_key_values`).
The drafter's context travels with that cache (`DraftContext`, an attribute of the cache object, so a `copy.deepcopy` of
the cache copies it too): the turn crops the target cache back to the verified positions the drafter holds (a block and
a token short of the cache at most), and the loop encodes only what follows
(`transformers_patches.encode_only_uncached`). A cache the drafter did not fill (plain `generate`, another drafter,
other tokens) is emptied: the turn encodes the whole conversation. A cache whose sliding-window layers dropped keys
cannot be cropped: the drafter's context then starts after the positions it lacks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .modeling_dflash2 import CACHE_NAME, draft_gumbel, tap_target_features
from .graphs import CapturedGraph
from .round_core import ColumnCache, DraftCore
from .stats import DFlash2Stats
from .transformers_patches import assisted_loop_cuts_at_eos, target_cache_of


class DFlash2CandidateGenerator(CandidateGenerator):
    """Drafts one block per round with a DFlash 2 (or DFlash 1) drafter; greedy walk or exact sampling."""

    requires_model_outputs = True

    def __init__(self, drafter, generation_config, logits_processor=None, input_ids=None, model_kwargs=None):
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        eos = generation_config._eos_token_tensor if hasattr(generation_config, "_eos_token_tensor") else None
        # the EOS ids the drafts are cut at: none where the loop ends accepted tokens at an EOS itself (no host read)
        self.eos_token_ids = eos.flatten().tolist() if eos is not None and not assisted_loop_cuts_at_eos() else []
        self.model_kwargs_overrides = {"output_hidden_states": True}
        self.context = continued_context(drafter, target_cache_of(model_kwargs), input_ids,
                                         mask_length(model_kwargs, generation_config))
        self.core = self.core_of(input_ids.shape[1] + 256 + self.block_size)  # 256 new tokens, then it grows
        self.step = None  # the drafting step (`DraftStep`), built in the first round, which follows the prefill
        self.prompt_length = input_ids.shape[1]
        self.stats = DFlash2Stats(self.block_size)
        drafter.last_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per round (transformers >= 5.25 asks, to size what a recurrent cache keeps for its rollback)."""
        return self.block_size - 1

    # ------------------------------------------------------------------------------------------ one round
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if model_outputs is None:  # the loop's first forward is the target's prefill
            return input_ids, None
        room = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        if room <= 0:
            return input_ids, None

        # rows of the last target forward that are now verified: what the prefill encoded, else anchor + accepted
        self.context.tokens = input_ids
        num_new = input_ids.shape[1] - 1 - self.context.length if self.step is None else int(n_last_matches) + 1
        features = tap_target_features(model_outputs.hidden_states, self.drafter.config.target_layer_ids,
                                       slice(0, num_new))
        block_hidden = self.draft_block(input_ids[:, -1], features)
        drafts, candidate_logits = self.step.tokens, None
        if drafts is None:  # sampling, or the target's logits processors: the walk runs eagerly
            transform = self._processor_transform(input_ids) if self.logits_processor is not None else None
            gumbel = draft_gumbel(self.drafter, 1) if self.do_sample else None
            proposal = self.drafter.propose(input_ids[:, -1], block_hidden, gumbel=gumbel, transform=transform)
            drafts, candidate_logits = proposal.tokens, proposal.proposal_logits if self.do_sample else None
        drafts = cut_after_eos(drafts[:, :room], self.eos_token_ids)
        candidate_logits = candidate_logits[:, : drafts.shape[1]] if candidate_logits is not None else None
        return torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1), candidate_logits

    @torch.no_grad()
    def draft_block(self, anchor_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Append `features` [1, n, taps*H] to the draft context and denoise [anchor, MASK ...] after it: the block's
        hidden states [1, B, H]. The core's state is written in place (no host read), then the step runs."""
        length, needed = self.context.length, self.context.length + features.shape[1] + self.block_size
        if needed > self.core.capacity:  # the buffers double (a new step is captured over them)
            self.core = self.core_of(2 * needed)
        core, earlier = self.core, features.shape[1] - self.block_size
        if earlier > 0:  # a prefill's positions before its last block: stored once, eagerly
            core.store_context(features[:, :earlier], core.columns[length: length + earlier].view(1, -1))
            length, features = length + earlier, features[:, earlier:]
        core.features[:, : features.shape[1]].copy_(features)  # later rows: stale, at columns no mask shows
        core.context_columns.copy_(core.offsets + length)
        core.start.fill_(length + features.shape[1])
        core.anchor.copy_(anchor_ids)
        self.context.length = length + features.shape[1]
        if self.step is None or self.step.core is not core:
            self.step = DraftStep(core, greedy=not self.do_sample and self.logits_processor is None)
            self.stats.draft_step = "graph" if self.step.graph is not None else "eager"
        return self.step()

    def core_of(self, columns: int) -> DraftCore:
        """The drafter's fixed buffers over the context's cache, grown to `columns` (at most the call's max length and a
        block): a step attends over all of them, so they grow as the context does."""
        self.context.cache.grow(min(columns, self.max_length + self.block_size))
        core = DraftCore(self.drafter, 1, self.context.cache.capacity, self.context.cache)
        core.first_column.fill_(self.context.first)
        return core

    def _processor_transform(self, input_ids):
        """Apply the target's logits processors (temperature, top-k/p, penalties...) to each draft row's scores."""
        processors, vocab = self.logits_processor, self.drafter.config.vocab_size

        def transform(t, drafted, scores, candidates=None):
            prefix = torch.cat([input_ids, drafted.to(input_ids.device)], dim=-1)
            if candidates is None:
                return processors(prefix, scores.to(input_ids.device)).to(scores.device)
            full = scores.new_full((scores.shape[0], vocab), float("-inf")).scatter(-1, candidates, scores)
            full = processors(prefix, full.to(input_ids.device)).to(scores.device)
            return full.gather(-1, candidates)

        return transform

    # ------------------------------------------------------------------------------------------ bookkeeping
    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.stats.record_round(int(num_matches))
        self.stats.completion_tokens = input_ids.shape[1] - self.prompt_length
        self.context.tokens = input_ids


class DraftStep:
    """The drafter's step of a round on a `DraftCore`: `draft_block`, then (`greedy`) the selector's argmax walk. Its
    outputs `hidden` [1, B, H] and `tokens` [1, B-1] (None unless greedy) are fixed tensors, rewritten by each call.
    Replayed from a CUDA graph where `drafts_capturable`, else run eagerly."""

    def __init__(self, core: DraftCore, greedy: bool):
        self.core, self.greedy = core, greedy
        self.graph = CapturedGraph(self.run) if drafts_capturable(core.drafter) else None

    def run(self) -> None:
        self.hidden = self.core.draft_block()
        self.tokens = self.core.drafter.propose(self.core.anchor, self.hidden).tokens if self.greedy else None

    def __call__(self) -> torch.Tensor:
        self.run() if self.graph is None else self.graph()
        return self.hidden


def drafts_capturable(drafter) -> bool:
    """Whether the drafting step can be a CUDA graph: the drafter and the target parts it borrows (embeddings, LM
    head) compute on one CUDA device (weights offloaded by accelerate sit on "meta": no)."""
    parts = (drafter._target_part("embed"), drafter._target_part("head"))
    return drafter.device.type == "cuda" and all(part.weight.device == drafter.device for part in parts)


# ------------------------------------------------------------------------------------------------ multi-turn
@dataclass
class DraftContext:
    """The drafter's context cache beside a target cache: `length` verified positions, of the tokens
    `tokens[:, :length]` ([1, >= length]), drafted by the drafter `drafter()`; columns before `first` hide from it."""

    drafter: weakref.ref
    cache: ColumnCache
    length: int = 0
    tokens: torch.Tensor | None = None
    first: int = 0


def mask_length(model_kwargs, generation_config) -> int | None:
    """Columns of the call's attention mask (transformers 5.23+ drops an all-ones mask and keeps its length aside)."""
    mask = (model_kwargs or {}).get("attention_mask")
    return mask.shape[-1] if mask is not None else getattr(generation_config, "_mask_length", None)


def continued_context(drafter, target_cache, input_ids, mask_columns: int | None = None) -> DraftContext:
    """The drafter's context for a call whose target cache is `target_cache` (a new one, or one an earlier turn filled).

    An earlier turn's context continues when it was drafted by this drafter over the same leading tokens; the target
    cache is then cropped back to the positions that context holds, so the prefill encodes their hidden states anew.
    Any other non-empty cache is emptied (the whole conversation is encoded once more). The context is stored on the
    target cache, where the next turn finds it.
    """
    context = DraftContext(weakref.ref(drafter), ColumnCache(drafter.config.num_hidden_layers, 0, True))
    if target_cache is None:
        return context
    cached = target_cache.get_seq_length()
    if cached > 0 and input_ids is not None:
        if mask_columns is not None and mask_columns > input_ids.shape[1]:
            raise ValueError(
                f"DFlash 2 got a cache of {cached} tokens with only {input_ids.shape[1]} new input ids (an attention "
                f"mask of {mask_columns}). Pass the whole conversation's ids with the cache of the earlier turn, as "
                "`tokenizer.apply_chat_template(messages, ...)` returns them: the cached part is not encoded again.")
        earlier = getattr(target_cache, "dflash2_context", None)
        keep = reusable_length(earlier, drafter, input_ids, cached)
        if keep > 0:
            context = earlier
            context.length = keep
        if keep == 0:
            check_layer_count(target_cache, drafter.config.num_target_layers)
            target_cache.reset()  # the whole conversation again (also a cache of another model's shapes)
        elif holds_every_position(target_cache):
            if keep < cached:  # `crop` takes how many to remove (transformers 5.18 on)
                target_cache.crop(keep - cached)
        else:  # no going back: the drafter's context starts after the positions it lacks (same tokens)
            context.length = context.first = cached
    target_cache.dflash2_context = context
    return context


def check_layer_count(cache, num_layers: int | None) -> None:
    """A cache of fixed layers (transformers builds one per layer of the model that filled it) must have the target's
    (`num_layers`; None: unknown, not checked)."""
    layers = getattr(cache, "layers", None)
    if num_layers and layers and getattr(cache, "layer_class_to_replicate", None) is None and len(layers) != num_layers:
        raise ValueError(
            f"The cache passed as {CACHE_NAME} has {len(layers)} layers and the target {num_layers}: another model "
            f"filled it. Pass the cache this target's generate returned (out.{CACHE_NAME}), or none.")


def holds_every_position(cache) -> bool:
    """False when a sliding-window layer of `cache` has passed its window: it dropped the oldest keys, so it cannot be
    cropped back (transformers would keep a shorter window)."""
    length = cache.get_seq_length()
    return not any(getattr(layer, "is_sliding", False) and length >= layer.sliding_window
                   for layer in getattr(cache, "layers", ()))


def reusable_length(context: DraftContext | None, drafter, input_ids, cached: int) -> int:
    """Leading positions of `input_ids` whose context `context` holds for `drafter` and the target cache holds too."""
    if context is None or context.drafter() is not drafter or context.tokens is None:
        return 0
    length = min(context.length, cached, input_ids.shape[1] - 1)  # the newest token is always encoded
    earlier = context.tokens[0, :length].to(input_ids.device)
    same = (earlier == input_ids[0, :length]).long().cumprod(0)
    return int(same.sum())


def cut_after_eos(drafts: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """Drop drafts after the first EOS (batch 1): nothing after an end of sequence can be accepted."""
    if not eos_token_ids or drafts.shape[1] == 0:
        return drafts
    is_eos = torch.isin(drafts[0], torch.tensor(eos_token_ids, device=drafts.device))
    if not bool(is_eos.any()):
        return drafts
    return drafts[:, : int(is_eos.nonzero()[0]) + 1]
