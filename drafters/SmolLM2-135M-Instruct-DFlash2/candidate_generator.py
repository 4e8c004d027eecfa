"""DFlash 2 drafting inside transformers' assisted-generation loop (`target.generate(assistant_model=drafter)`).

Each round: take the target's hidden states of the newly verified positions from the last verification forward,
append them to the drafter's context cache, denoise one block `[anchor, MASK x (B-1)]`, and let the selector walk a
path through the top-k candidates. The loop then verifies the block with one target forward.
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .modeling_dflash2 import draft_gumbel, new_draft_cache, tap_target_features
from .stats import DFlash2Stats


class DFlash2CandidateGenerator(CandidateGenerator):
    """Drafts one block per round with a DFlash 2 (or DFlash 1) drafter; greedy walk or exact sampling."""

    requires_model_outputs = True

    def __init__(self, drafter, generation_config, logits_processor=None, input_ids=None):
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
        self.cache = new_draft_cache()
        self.context_length = 0  # verified positions whose keys/values the draft cache holds
        self.prompt_length = input_ids.shape[1] if input_ids is not None else None
        self.stats = DFlash2Stats(self.block_size)
        drafter.last_stats = self.stats

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

        # rows of the last target forward that are now verified: the whole prompt after prefill, else anchor + accepted
        num_new = input_ids.shape[1] - 1 if self.context_length == 0 else int(n_last_matches) + 1
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
        self.context_length += num_new
        self.cache.crop(-self.block_size)  # the block was appended after the context: drop it
        return hidden

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


def cut_after_eos(drafts: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """Drop drafts after the first EOS (batch 1): nothing after an end of sequence can be accepted."""
    if not eos_token_ids or drafts.shape[1] == 0:
        return drafts
    is_eos = torch.isin(drafts[0], torch.tensor(eos_token_ids, device=drafts.device))
    if not bool(is_eos.any()):
        return drafts
    return drafts[:, : int(is_eos.nonzero()[0]) + 1]
