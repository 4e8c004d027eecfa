"""Batched DFlash 2: several prompts per step, each row accepting its own number of drafts.

transformers' assisted loop runs one sequence; this loop runs a left-padded batch. Every round appends the whole
block (anchor + drafts) to both caches in the same slots for every row and marks, per row, which of those slots hold
verified tokens; rejected slots stay masked forever, so nothing is re-encoded and nothing is cropped. Each row keeps
its own absolute positions. Rows that finish leave the batch, so they cost no further work.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

try:  # flat remote-code folder or this repository
    from .candidate_generator import DFlash2Stats, truncate_at_eos
    from .fast_path import (Sampling, StaticDraftCache, draft_temperature, eos_token_ids, first_token, greedy_accept,
                            round_noise, speculative_accept, warped_probabilities)
except ImportError:
    from generation.candidate_generator import DFlash2Stats, truncate_at_eos
    from generation.fast_path import (Sampling, StaticDraftCache, draft_temperature, eos_token_ids, first_token,
                                      greedy_accept, round_noise, speculative_accept, warped_probabilities)


class BatchedDFlash2Decoder:
    def __init__(self, target, drafter, batch: int, capacity: int):
        if drafter.config.is_causal or any(layer.self_attn.sliding_window for layer in drafter.layers):
            raise NotImplementedError("Batched DFlash 2 supports full-attention, non-causal drafters.")
        self.target, self.drafter = target, drafter
        self.block_size = drafter.config.block_size
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.device = drafter.device
        self.capacity = capacity
        self.cache_argument = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        self.target_cache = DynamicCache()
        self.draft_cache = StaticDraftCache(drafter, batch, capacity, self.device, drafter.dtype)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)  # slot holds a verified token
        self.slots = 0  # slots used so far (the same for every row)

    def verify(self, tokens, positions, new_valid):
        """Target forward over `tokens` in the next slots; `new_valid` marks which of them each row may see."""
        slots = torch.arange(self.slots, self.slots + tokens.shape[1], device=self.device)
        mask = torch.cat([self.valid[:, : self.slots], new_valid], dim=1).long()
        out = self.target(input_ids=tokens, attention_mask=mask, position_ids=positions, output_hidden_states=True,
                          use_cache=True, **{self.cache_argument: self.target_cache})
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits.float(), features, slots

    def draft_block(self, anchor, start, features, write_slots, write_valid):
        """Write features into the drafter context (validity per row), denoise each row's block at its `start`."""
        drafter, block = self.drafter, self.block_size
        batch = anchor.shape[0]
        self.valid[:, write_slots] = write_valid
        block_ids = torch.full((batch, block), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, 0] = anchor
        context_positions = self.slot_positions[:, write_slots]
        block_positions = start.view(-1, 1) + torch.arange(block, device=self.device).view(1, -1)
        positions = torch.cat([context_positions, block_positions], dim=1)
        visible = self.valid.view(batch, 1, 1, -1).expand(batch, 1, block, -1)
        mask = torch.cat([visible, torch.ones(batch, 1, block, block, dtype=torch.bool, device=self.device)], dim=-1)
        self.draft_cache.write_positions = write_slots
        return drafter(noise_embeds=drafter.embed_block(block_ids), context_hidden_states=features,
                       position_ids=positions, attention_mask=mask, cache=self.draft_cache).last_hidden_state

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows from every buffer (their work stops here)."""
        self.valid = self.valid[rows]
        self.slot_positions = self.slot_positions[rows]
        self.draft_cache.keys = [k[rows] for k in self.draft_cache.keys]
        self.draft_cache.values = [v[rows] for v in self.draft_cache.values]
        self.target_cache.batch_select_indices(rows)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens: int, sampling: Sampling, eos_token_ids,
                 pad_token_id: int, generator=None):
        batch, prompt_length = input_ids.shape
        block = self.block_size
        stats = DFlash2Stats(block, rows=batch)
        self.drafter.last_stats = stats
        attention_mask = attention_mask.to(self.device).bool()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.slot_positions = torch.zeros(batch, self.capacity, dtype=torch.long, device=self.device)
        self.slot_positions[:, :prompt_length] = positions
        logits, features, slots = self.verify(input_ids.to(self.device), positions, attention_mask)
        self.slots = prompt_length
        stats.target_forwards += batch  # each row's prefill
        first = first_token(logits[:, -1], sampling, generator)
        outputs = [[int(t)] for t in first.tolist()]
        rows = list(range(batch))  # original row of each live row
        eos = set(eos_token_ids or ())
        start = attention_mask.sum(-1)  # next absolute position per row
        anchor = first
        write_slots, write_valid = slots, attention_mask
        live = [i for i in range(batch) if outputs[i][-1] not in eos and max_new_tokens > 1]
        if len(live) < batch:
            keep = torch.tensor([rows.index(i) for i in live], device=self.device)
            write_valid, features, anchor, start = write_valid[keep], features[keep], anchor[keep], start[keep]
            rows = live
            self.keep_rows(keep)
        while rows:
            self.live_rows = rows  # original index of each row still decoding
            hidden = self.draft_block(anchor, start, features, write_slots, write_valid)
            noise = round_noise(self.drafter, len(rows), sampling, generator)
            proposal = self.drafter.propose(anchor, hidden, gumbel=noise[0] if noise else None,
                                            transform=draft_temperature(sampling) if sampling.do_sample else None)
            tokens = torch.cat([anchor.view(-1, 1), proposal.tokens], dim=1)
            block_positions = start.view(-1, 1) + torch.arange(block, device=self.device).view(1, -1)
            logits, features, write_slots = self.verify(tokens, block_positions,
                                                        torch.ones(len(rows), block, dtype=torch.bool,
                                                                   device=self.device))
            self.slot_positions[:, write_slots] = block_positions
            self.slots += block
            if sampling.do_sample:
                accepted, next_token = speculative_accept(proposal.tokens, proposal.proposal_logits.softmax(-1),
                                                          warped_probabilities(logits, sampling), noise[1], noise[2])
            else:
                accepted, next_token = greedy_accept(proposal.tokens, logits)
            # the verify forward saw the whole block; from the next draft on (draft_block stores it) each row sees
            # only its anchor and accepted drafts in these slots
            write_valid = torch.arange(block, device=self.device).view(1, -1) <= accepted.view(-1, 1)
            accepted_list, next_list, drafted = accepted.tolist(), next_token.tolist(), tokens[:, 1:].tolist()
            still = []
            for live_index, row in enumerate(rows):
                count = accepted_list[live_index]
                stats.record_round(count)
                outputs[row] += truncate_at_eos(drafted[live_index][:count] + [next_list[live_index]], eos)
                if len(outputs[row]) < max_new_tokens and outputs[row][-1] not in eos:
                    still.append(live_index)
            start = start + accepted + 1
            anchor = next_token
            if len(still) < len(rows):
                keep = torch.tensor(still, device=self.device, dtype=torch.long)
                rows = [rows[i] for i in still]
                if rows:
                    write_valid, features, anchor, start = write_valid[keep], features[keep], anchor[keep], start[keep]
                    self.keep_rows(keep)
        outputs = [tokens[:max_new_tokens] for tokens in outputs]
        stats.completion_tokens = sum(len(t) for t in outputs)
        width = max(len(t) for t in outputs)
        generated = torch.full((batch, width), pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(outputs):
            generated[row, : len(tokens)] = torch.tensor(tokens)
        return torch.cat([input_ids, generated.to(input_ids.device)], dim=1)


def batched_generate(target, drafter, input_ids, attention_mask, generation_config):
    """`target.generate(batch, attention_mask=..., assistant_model=drafter)` with batch > 1 lands here."""
    max_new_tokens = generation_config.max_new_tokens or (generation_config.max_length - input_ids.shape[1])
    sampling = Sampling.from_generation_config(generation_config)
    eos = eos_token_ids(generation_config)
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("Batched DFlash 2 needs left-padded prompts (tokenizer.padding_side = 'left').")
    block = drafter.config.block_size
    capacity = input_ids.shape[1] + block * (max_new_tokens + 1)
    decoder = BatchedDFlash2Decoder(target, drafter, input_ids.shape[0], capacity)
    return decoder.generate(input_ids, attention_mask, max_new_tokens, sampling, eos, pad)
