"""The static-shape DFlash 2 loop: fixed buffers, fixed block shapes, one host synchronisation per round.

gpt-fast style, read top to bottom: `prefill`, then per round `draft_block` -> `select_path` -> `verify` ->
`accept`. Every tensor in a round has the same shape every round (the verified count lives in a tensor), so the round
can be captured by `torch.compile(mode="reduce-overhead")` (CUDA graphs) on a GPU.

Rollback needs no re-allocation: the target's static cache and the drafter's context buffer are written at the
block's positions every round; whatever a rejected draft left behind is either overwritten next round or hidden by
the mask (the drafter sees context positions < start, the target is causal).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import StaticCache

try:  # flat remote-code folder or this repository
    from .candidate_generator import DFlash2Stats, truncate_at_eos
    from .modeling_dflash2 import draft_gumbel, sample_gumbel
except ImportError:
    from generation.candidate_generator import DFlash2Stats, truncate_at_eos
    from modeling_dflash2 import draft_gumbel, sample_gumbel


# ------------------------------------------------------------------------------------------------ drafter context
class StaticDraftCache:
    """Context keys/values of the drafter in fixed buffers [b, kv_heads, capacity, head_dim] per layer.

    Each forward writes its first `num_context` key/value rows at `write_positions` and returns the whole buffer
    followed by the block's own keys/values; the block is never stored.
    """

    def __init__(self, drafter, batch: int, capacity: int, device, dtype):
        config = drafter.config
        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        for buffer in self.keys + self.values:  # written in place inside CUDA graphs: their address must not move
            torch._dynamo.mark_static_address(buffer)
        self.capacity = capacity
        self.write_positions: torch.Tensor | None = None

    def update(self, key, value, layer_idx, *args, **kwargs):
        count = self.write_positions.shape[0]
        self.keys[layer_idx].index_copy_(2, self.write_positions, key[:, :, :count].to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.write_positions, value[:, :, :count].to(self.keys[layer_idx].dtype))
        return (torch.cat([self.keys[layer_idx], key[:, :, count:]], dim=2),
                torch.cat([self.values[layer_idx], value[:, :, count:]], dim=2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


# ------------------------------------------------------------------------------------------------ sampling pieces
@dataclass
class Sampling:
    """Target-side warping the static loop supports (the eager path supports every logits processor)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_generation_config(cls, config) -> "Sampling":
        return cls(bool(config.do_sample), config.temperature or 1.0, config.top_k or 0, config.top_p or 1.0)


def eos_token_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def warped_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax of temperature/top-k/top-p-warped logits (fp32), as transformers' warpers compute them."""
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


@torch.compiler.disable
def cumulative_probabilities(sorted_logits: torch.Tensor) -> torch.Tensor:
    """softmax then cumsum over the vocabulary, kept out of compiled graphs: inductor (torch 2.11, Triton) fails to
    generate code for a scan this long ("Error in codegen ... SplitScan"). Eager, it stays on the device: a graph
    break, no host synchronisation."""
    return sorted_logits.softmax(-1).cumsum(-1)


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


# ------------------------------------------------------------------------------------------------ the loop
class StaticDFlash2Decoder:
    """Owns the fixed buffers for one (target, drafter, capacity) and runs rounds of fixed shape."""

    def __init__(self, target, drafter, capacity: int, compile: bool = False):
        config = drafter.config
        if config.is_causal or any(layer.self_attn.sliding_window for layer in drafter.layers):
            raise NotImplementedError("The static DFlash 2 loop supports full-attention, non-causal drafters; "
                                      "use the eager path (no cache_implementation) for this drafter.")
        self.target, self.drafter = target, drafter
        self.block_size = config.block_size
        self.layer_ids = list(config.target_layer_ids)
        self.device = drafter.device
        self.capacity = capacity
        self.cache_argument = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        self.target_cache = StaticCache(config=target.config, max_cache_len=capacity)
        self.draft_cache = StaticDraftCache(drafter, 1, capacity, self.device, drafter.dtype)
        self.block_offsets = torch.arange(self.block_size, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)
        self.compiled = compile
        self.round = torch.compile(self._round, mode="reduce-overhead", fullgraph=False) if compile else self._round

    # ---------------------------------------------------------------- pieces
    def verify(self, tokens: torch.Tensor, start: torch.Tensor):
        """Target forward over `tokens` at positions start, start+1, ...; logits and tapped features."""
        for layer in self.target_cache.layers:  # rollback = write from `start` on
            if getattr(layer, "is_initialized", True) and hasattr(layer, "cumulative_length") and torch.is_tensor(
                    layer.cumulative_length):
                layer.cumulative_length.copy_(start.view(()))
        positions = start.view(1, 1) + torch.arange(tokens.shape[1], device=tokens.device).view(1, -1)
        out = self.target(input_ids=tokens, position_ids=positions, output_hidden_states=True, use_cache=True,
                          **{self.cache_argument: self.target_cache})
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits.float(), features

    def draft_block(self, anchor, start, features, write_positions):
        """Write `features` into the drafter context at `write_positions`, denoise [anchor, MASK...] at `start`."""
        drafter = self.drafter
        block_ids = torch.full((1, self.block_size), drafter.config.mask_token_id, dtype=torch.long,
                               device=self.device)
        block_ids[:, 0] = anchor
        block_positions = start.view(1, 1) + self.block_offsets.view(1, -1)
        positions = torch.cat([write_positions.view(1, -1), block_positions], dim=1)
        visible = (self.key_positions < start.view(1)).view(1, 1, 1, -1).expand(1, 1, self.block_size, -1)
        mask = torch.cat([visible, torch.ones(1, 1, self.block_size, self.block_size, dtype=torch.bool,
                                              device=self.device)], dim=-1)
        self.draft_cache.write_positions = write_positions
        return drafter(noise_embeds=drafter.embed_block(block_ids), context_hidden_states=features,
                       position_ids=positions, attention_mask=mask, cache=self.draft_cache).last_hidden_state

    def _round(self, anchor, start, features, write_positions, sampling: Sampling, noise):
        """One round, fixed shapes: draft, select, verify, accept. Returns block tokens, count, next token, features."""
        hidden = self.draft_block(anchor, start, features, write_positions)
        gumbel_rows, uniform, gumbel_next = noise if sampling.do_sample else (None, None, None)
        proposal = self.drafter.propose(anchor.view(1), hidden, gumbel=gumbel_rows,
                                        transform=draft_temperature(sampling) if sampling.do_sample else None)
        block = torch.cat([anchor.view(1, 1), proposal.tokens], dim=1)
        logits, block_features = self.verify(block, start)
        if sampling.do_sample:
            q = proposal.proposal_logits.softmax(-1)
            accepted, next_token = speculative_accept(proposal.tokens, q, warped_probabilities(logits, sampling),
                                                      uniform, gumbel_next)
        else:
            accepted, next_token = greedy_accept(proposal.tokens, logits)
        return block, accepted, next_token, block_features

    # ---------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, sampling: Sampling, eos_token_ids=(), streamer=None,
                 generator: torch.Generator | None = None):
        prompt_length = input_ids.shape[1]
        if prompt_length + max_new_tokens + self.block_size > self.capacity:
            raise ValueError(f"prompt ({prompt_length}) + max_new_tokens ({max_new_tokens}) + block exceeds the "
                             f"static capacity {self.capacity}; build the decoder with a larger capacity.")
        self.target_cache.reset()
        stats = DFlash2Stats(self.block_size)
        self.drafter.last_stats = stats
        start = torch.tensor(0, device=self.device)
        logits, features = self.verify(input_ids, start)  # prefill: positions 0..P-1
        stats.target_forwards += 1
        first = first_token(logits[:, -1], sampling, generator)[0]
        tokens = [int(first)]
        write_positions = torch.arange(prompt_length, device=self.device)
        start = torch.tensor(prompt_length, device=self.device)
        anchor = first.view(())
        if prompt_length > self.block_size:
            # Every round keeps the compiled shape: the drafter's context takes all but the prompt's last block of
            # features now (one eager drafter pass; its block rows are discarded), the first round the rest.
            head = prompt_length - self.block_size
            self.draft_block(anchor, torch.tensor(head, device=self.device), features[:, :head],
                             write_positions[:head])
            features, write_positions = features[:, head:], write_positions[head:]
        eos = set(eos_token_ids or ())
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            noise = round_noise(self.drafter, 1, sampling, generator)
            # a prompt shorter than a block gives the first round a shape of its own: keep that round eager
            run = self.round if features.shape[1] == self.block_size else self._round
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier graph outputs may be reused
            block, accepted, next_token, block_features = run(anchor, start, features, write_positions, sampling,
                                                              noise)
            if self.compiled:  # graph outputs are overwritten by the next replay: keep what the next round reads
                block_features, next_token, accepted = block_features.clone(), next_token.clone(), accepted.clone()
            # the round's one host synchronisation: accepted count, drafts and next token in one copy
            count, *drafts, following = torch.cat([accepted.view(1), block[0, 1:], next_token.view(1)]).tolist()
            new = truncate_at_eos(drafts[:count] + [following], eos)
            stats.record_round(count)
            tokens += new
            if streamer is not None:
                streamer.put(torch.tensor(new))
            write_positions = start + self.block_offsets
            features = block_features
            start = start + accepted + 1
            anchor = next_token.view(())
        tokens = tokens[:max_new_tokens]
        if streamer is not None:
            streamer.end()
        stats.completion_tokens = len(tokens)
        return torch.cat([input_ids, torch.tensor([tokens], device=input_ids.device)], dim=1)


def first_token(logits, sampling: Sampling, generator=None):
    """The token after the prefill, per row: argmax, or a sample from the warped distribution."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    return torch.multinomial(warped_probabilities(logits, sampling), 1, generator=generator).squeeze(-1)


def round_noise(drafter, batch: int, sampling: Sampling, generator=None):
    """Randomness of one sampling round, drawn up front: Gumbel noise for the draft walk, uniforms for the
    acceptance tests, Gumbel noise for the residual / bonus sample. None when greedy."""
    if not sampling.do_sample:
        return None
    rows, vocab, device = drafter.config.block_size - 1, drafter.config.vocab_size, drafter.device
    return (draft_gumbel(drafter, batch, generator),
            torch.rand((batch, rows), device=device, generator=generator),
            sample_gumbel((batch, vocab), device, generator))


def draft_temperature(sampling: Sampling):
    """Draft side: temperature only (q need not match p for exactness; it only sets the acceptance rate)."""

    def transform(t, drafted, scores, candidates=None):
        return scores / sampling.temperature

    return transform


def static_generate(target, drafter, input_ids, generation_config, streamer=None, compile: bool | None = None):
    """`target.generate(..., assistant_model=drafter, cache_implementation="static")` lands here (batch 1)."""
    if input_ids.shape[0] != 1:
        raise ValueError("The static DFlash 2 loop runs one sequence; call generate once per prompt.")
    max_new_tokens = generation_config.max_new_tokens or (generation_config.max_length - input_ids.shape[1])
    sampling = Sampling.from_generation_config(generation_config)
    if compile is None:
        compile = input_ids.device.type == "cuda"
    needed = input_ids.shape[1] + max_new_tokens + drafter.config.block_size
    decoder = drafter.__dict__.get("_static_decoder")
    # like transformers' static cache: keep the largest buffers seen, so shorter requests reuse the compiled graphs
    if decoder is None or decoder.target is not target or decoder.compiled != compile or decoder.capacity < needed:
        capacity = _round_up(max(needed, decoder.capacity if decoder is not None else 0), 256)
        decoder = drafter.__dict__["_static_decoder"] = StaticDFlash2Decoder(target, drafter, capacity, compile)
    return decoder.generate(input_ids, max_new_tokens, sampling, eos_token_ids(generation_config), streamer)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
