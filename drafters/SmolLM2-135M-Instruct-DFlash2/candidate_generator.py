# Generated from generation/candidate_generator.py by `python -m dflash2.generation.flat_code`; do not edit.
"""DFlash 2 drafting inside transformers' assisted-generation loop (`target.generate(assistant_model=drafter)`).

Each round: take the target's hidden states of the newly verified positions from the last verification forward,
append them to the drafter's context cache, denoise one block `[anchor, MASK x (B-1)]`, and let the selector walk a
path through the top-k candidates. The loop then verifies the block with one target forward.

A later turn of a conversation passes the target cache of the earlier turn back (`past_key_values=out.past_key_values`).
The drafter's context travels with that cache (`DraftContext`, an attribute of the cache object, so a `copy.deepcopy` of
the cache copies it too): the turn crops the target cache back to the verified positions the drafter holds (a block and
a token short of the cache at most), and the loop encodes only what follows
(`transformers_patches.encode_only_uncached`). A cache the drafter did not fill (plain `generate`, another drafter,
other tokens) is emptied: the turn encodes the whole conversation. A cache whose sliding-window layers dropped keys
cannot be cropped: the drafter then skips what it lacks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .modeling_dflash2 import CACHE_NAME, draft_gumbel, new_draft_cache, tap_target_features
from .stats import DFlash2Stats


class DFlash2CandidateGenerator(CandidateGenerator):
    """Drafts one block per round with a DFlash 2 (or DFlash 1) drafter; greedy walk or exact sampling."""

    requires_model_outputs = True

    def __init__(self, drafter, generation_config, logits_processor=None, input_ids=None, model_kwargs=None):
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.mask_token_id = drafter.config.mask_token_id
        self.vocab_size = drafter.config.vocab_size
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        eos = generation_config._eos_token_tensor if hasattr(generation_config, "_eos_token_tensor") else None
        self.eos_token_ids = eos.flatten().tolist() if eos is not None else []
        self.model_kwargs_overrides = {"output_hidden_states": True}
        self.context = continued_context(drafter, target_cache_of(model_kwargs), input_ids,
                                         mask_length(model_kwargs, generation_config))
        self.cache = self.context.cache
        self.first_round = True  # the first drafting round of this call follows its prefill
        self.prompt_length = input_ids.shape[1] if input_ids is not None else None
        self.stats = DFlash2Stats(self.block_size)
        drafter.last_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts per round (transformers >= 5.25 asks, to size what a recurrent cache keeps for its rollback)."""
        return self.block_size - 1

    # ------------------------------------------------------------------------------------------ one round
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        if model_outputs is None:  # the loop's first forward is the target's prefill
            return input_ids, None
        room = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        if room <= 0:
            return input_ids, None

        # rows of the last target forward that are now verified: what the prefill encoded, else anchor + accepted
        self.context.tokens = input_ids
        num_new = input_ids.shape[1] - 1 - self.context_length if self.first_round else int(n_last_matches) + 1
        self.first_round = False
        features = tap_target_features(model_outputs.hidden_states, self.layer_ids, slice(0, num_new))
        block_hidden = self.draft_block(input_ids[:, -1], features)
        proposal = self.drafter.propose(
            input_ids[:, -1],
            block_hidden,
            gumbel=draft_gumbel(self.drafter, block_hidden.shape[0]) if self.do_sample else None,
            transform=self._processor_transform(input_ids) if self.logits_processor is not None else None,
        )
        drafts = cut_after_eos(proposal.tokens[:, :room], self.eos_token_ids)
        candidate_logits = proposal.proposal_logits[:, : drafts.shape[1]] if self.do_sample else None
        return torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1), candidate_logits

    def draft_block(self, anchor_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Append `features` to the draft context, denoise [anchor, MASK...], keep only the context in the cache."""
        drafter = self.drafter
        num_new = features.shape[1]
        block_ids = torch.full((anchor_ids.shape[0], self.block_size), self.mask_token_id, dtype=torch.long,
                               device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        positions = torch.arange(self.context_length, self.context_length + num_new + self.block_size,
                                 device=drafter.device).unsqueeze(0)
        with torch.no_grad():
            hidden = drafter(
                noise_embeds=drafter.embed_block(block_ids),
                context_hidden_states=features,
                position_ids=positions,
                cache=self.cache,
            ).last_hidden_state
        self.context.length += num_new
        self.cache.crop(-self.block_size)  # the block was appended after the context: drop it
        return hidden

    @property
    def context_length(self) -> int:
        """Verified positions whose keys/values the draft cache holds."""
        return self.context.length

    def _processor_transform(self, input_ids):
        """Apply the target's logits processors (temperature, top-k/p, penalties...) to each draft row's scores."""
        processors, vocab = self.logits_processor, self.vocab_size

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


# ------------------------------------------------------------------------------------------------ multi-turn
@dataclass
class DraftContext:
    """The drafter's context cache beside a target cache: `length` verified positions, of the tokens
    `tokens[:, :length]` ([1, >= length]), drafted by the drafter `drafter()`."""

    drafter: weakref.ref
    cache: object
    length: int = 0
    tokens: torch.Tensor | None = None


def target_cache_of(model_kwargs) -> object | None:
    """The target cache of a generate call's model kwargs (`cache` from transformers 5.24, else `past_key_values`)."""
    model_kwargs = model_kwargs or {}
    cache = model_kwargs.get("cache")
    return cache if cache is not None else model_kwargs.get("past_key_values")


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
    context = DraftContext(weakref.ref(drafter), new_draft_cache())
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
            crop_to(context.cache, keep)
            context.length = keep
        if keep == 0:
            check_layer_count(target_cache, drafter.config.num_target_layers)
            target_cache.reset()  # the whole conversation again (also a cache of another model's shapes)
        elif holds_every_position(target_cache):
            crop_to(target_cache, keep)
        else:  # no going back: the drafter's context skips the positions it lacks (fewer drafts accepted, same tokens)
            context.length = cached
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


def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (`crop` takes how many to remove, from 5.18 on)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


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
