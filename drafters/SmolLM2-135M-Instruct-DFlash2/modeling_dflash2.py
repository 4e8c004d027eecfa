# Generated from modeling_dflash2.py by `python -m dflash2.generation.flat_code`; do not edit.
"""DFlash 2 block drafter as a Hugging Face model (trust_remote_code).

The drafter reads the hidden states of several target layers (fused by `fc`, normed by `hidden_norm`), injects them
as keys/values into every draft layer, and denoises one block `[anchor, MASK x (B-1)]` in a single non-causal pass.
DFlash 2 adds two-tap dynamic convolutions around every attention and MLP sublayer and a low-rank bilinear selector
that walks one coherent path through the top-k candidates of each block row. The target's embeddings and LM head are
borrowed at run time (`bind_target`), never stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The name of a cache in the installed transformers' outputs and generate kwargs: transformers 5.24 renamed
# `past_key_values` to `cache` (the old name still works there, with a deprecation warning)
CACHE_NAME = "cache" if "cache" in getattr(BaseModelOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

from .configuration_dflash2 import DFlash2Config


# ----------------------------------------------------------------------------------------------- building blocks
class DFlash2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class DFlash2RotaryEmbedding(nn.Module):
    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def inverse_frequencies(config: DFlash2Config) -> tuple[torch.Tensor, float]:
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            return ROPE_INIT_FUNCTIONS[rope_type](config, None)
        base = config.rope_parameters.get("rope_theta", 10000.0)
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d] for the same n positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return hidden_states
    b, kv_heads, n, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv_heads, n_rep, n, d).reshape(b, kv_heads * n_rep, n, d)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


# ----------------------------------------------------------------------------------------------- dynamic convolution
def dynamic_block_conv(x: torch.Tensor, base_kernel: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution along the rows of each block, with per-row, per-group dynamic taps.

    x: [..., B, H] rows of one or more blocks; base_kernel: [T, H]; delta: [..., B, T, G] (G groups of H // G
    contiguous channels). Row t mixes rows t, t-1, ..., t-T+1 of its own block; rows before the block read zeros.
    Like the reference, base and correction are applied as two products (base*x + d*x), not as (base + d)*x.
    """
    taps, hidden = base_kernel.shape
    groups = delta.shape[-1]
    rows = x.shape[-2]
    out = torch.zeros_like(x)
    for tap in range(taps):
        if tap >= rows:
            break
        shifted = x if tap == 0 else F.pad(x[..., : rows - tap, :], (0, 0, tap, 0))
        correction = (shifted.unflatten(-1, (groups, hidden // groups)) * delta[..., tap, :, None]).flatten(-2)
        out = out + base_kernel[tap] * shifted + correction
    return out


class DFlash2DynamicConv(nn.Module):
    """Two-sided dynamic convolution around one sublayer: `prepare` before it, `finish` after it.

    Both sides' coefficients come from the sublayer's normed input u (side 0 acts on u, side 1 on the output z).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: [..., B, H] block rows. Returns the pre-convolved input and the side-1 coefficients."""
        delta = self.kernel_projection(u).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return dynamic_block_conv(u, self.base_kernel[0], delta[..., 0, :, :]), delta[..., 1, :, :]

    def finish(self, z: torch.Tensor, delta_after: torch.Tensor) -> torch.Tensor:
        return dynamic_block_conv(z, self.base_kernel[1], delta_after)

    @torch.no_grad()
    def silence(self) -> None:
        """Zero the output side (its base taps and the rows of `kernel_projection` that make its correction):
        `finish` then returns zeros, whatever the sublayer gives it."""
        self.base_kernel[1].zero_()
        self.kernel_projection.weight.unflatten(0, (2, -1))[1].zero_()


# ----------------------------------------------------------------------------------------------- attention and layers
class DFlash2Attention(nn.Module):
    """Queries from the block rows; keys/values from [fused target context; block rows]; RoPE at absolute positions."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        layer_type = config.layer_types[layer_idx]
        self.is_causal = config.is_causal if config.is_causal is not None else layer_type == "sliding_attention"
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        batch, num_rows, _ = hidden_states.shape
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(batch, num_rows, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query = apply_rotary(query, cos[:, -num_rows:], sin[:, -num_rows:])
        key = apply_rotary(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            is_causal=False,  # block rows see each other; any causal/sliding rule arrives as an explicit mask
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, num_rows, -1).contiguous())


class DFlash2MLP(nn.Module):
    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.block_size = config.block_size
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = DFlash2Attention(config, layer_idx)
        self.mlp = DFlash2MLP(config)
        self.input_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.uses_conv_and_selector:
            self.attention_conv = DFlash2DynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = DFlash2DynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    @torch.no_grad()
    def silence(self) -> None:
        """Make this layer add nothing to the residual stream (it passes its input through), while its sublayers keep
        their weights: DFlash 2 zeroes the output side of both convolutions, DFlash 1 the output projections."""
        if self.attention_conv is not None:
            self.attention_conv.silence()
            self.mlp_conv.silence()
        else:
            self.self_attn.o_proj.weight.zero_()
            self.mlp.down_proj.weight.zero_()

    def _in_blocks(self, x: torch.Tensor) -> torch.Tensor:
        # [b, n*B, H] -> [b, n, B, H]: the convolution never crosses a block boundary
        return x.unflatten(1, (-1, self.block_size))

    def _sublayer(self, x, norm, conv, sublayer):
        u = norm(x)
        if conv is None:
            return x + sublayer(u)
        u_blocks, delta_after = conv.prepare(self._in_blocks(u))
        z = sublayer(u_blocks.flatten(1, 2))
        return x + conv.finish(self._in_blocks(z), delta_after).flatten(1, 2)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        if isinstance(attention_mask, dict):  # one mask per layer type (full / sliding attention)
            attention_mask = attention_mask.get(self.attention_type)

        def attend(u):
            return self.self_attn(u, context, position_embeddings, attention_mask, past_key_values, **kwargs)

        hidden_states = self._sublayer(hidden_states, self.input_layernorm, self.attention_conv, attend)
        return self._sublayer(hidden_states, self.post_attention_layernorm, self.mlp_conv, self.mlp)


# ----------------------------------------------------------------------------------------------- candidate selector
class DFlash2CandidateSelector(nn.Module):
    """Low-rank bilinear pair scores between a row's candidate and the token chosen at the previous row."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))

    def forward(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """All K x K pair scores of every draft row, in fp32: see `pair_scores`."""
        return pair_scores(
            unary, candidates, anchor_ids, self.hidden_projection(hidden), self.predecessor_codebook,
            self.successor_codebook,
        )


def pair_scores(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    anchor_ids: torch.Tensor,
    gate: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
) -> torch.Tensor:
    """All pair scores S[b, t, i, j] of draft row t: predecessor = candidate i of row t-1 (the anchor for t = 0, the
    same for every i), successor = candidate j. unary, candidates: [b, R, K]; anchor_ids: [b]; gate: [b, R, r]."""
    batch, rows, k = candidates.shape
    predecessors = torch.cat([anchor_ids.view(batch, 1, 1).expand(batch, 1, k), candidates[:, :-1]], dim=1)
    return bilinear_scores(unary, candidates, predecessors, gate, predecessor_codebook, successor_codebook)


def bilinear_scores(unary, candidates, predecessors, gate, predecessor_codebook, successor_codebook) -> torch.Tensor:
    """S[..., i, j] = U(c_j) + sum_r A[p_i, r] * g[r] * Bs[c_j, r] in fp32.

    unary, candidates: [..., K]; predecessors: [..., P] token ids; gate: [..., r]. Returns [..., P, K].
    """
    left = predecessor_codebook[predecessors].float() * gate.float().unsqueeze(-2)  # [..., P, r]
    right = successor_codebook[candidates].float()  # [..., K, r]
    return unary.float().unsqueeze(-2) + left @ right.transpose(-1, -2)


def walk_path(
    pairs: torch.Tensor,
    candidates: torch.Tensor,
    gumbel: torch.Tensor | None = None,
    transform: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk one path through the candidates, Markov on the chosen token (a greedy walk, not Viterbi).

    pairs: [b, R, K, K] from `pair_scores`; candidates: [b, R, K]. Row t scores its candidates against the candidate
    chosen at row t-1 (the anchor for row 0). `transform(t, tokens_so_far [b, t], scores [b, K], candidate_ids [b, K])`
    may rewrite a row's scores before the choice (logits processors). Without `gumbel` the choice is the argmax; with Gumbel noise
    [b, R, K] it is an exact sample from softmax(scores). Returns the tokens [b, R] and the scores each choice was
    made from [b, R, K] (their softmax is the proposal distribution q).
    """
    batch, rows, k, _ = pairs.shape
    batch_index = torch.arange(batch, device=pairs.device)
    previous = torch.zeros(batch, dtype=torch.long, device=pairs.device)
    tokens, row_scores = [], []
    for t in range(rows):
        scores = pairs[batch_index, t, previous]
        if transform is not None:
            drafted = torch.stack(tokens, dim=1) if tokens else candidates[:, :0, 0]
            scores = transform(t, drafted, scores, candidates[:, t])
        choice = (scores if gumbel is None else scores + gumbel[:, t]).argmax(dim=-1)
        tokens.append(candidates[batch_index, t, choice])
        row_scores.append(scores)
        previous = choice
    return torch.stack(tokens, dim=1), torch.stack(row_scores, dim=1)


def sample_gumbel(shape, device, generator: torch.Generator | None = None, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Standard Gumbel noise (fp32); with `out`, written in place into that fixed buffer (graph inputs)."""
    if out is None:
        out = torch.empty(shape, device=device, dtype=torch.float32)
    return out.uniform_(generator=generator).clamp_(min=1e-20, max=1.0 - 1e-7).log_().neg_().log_().neg_()


def draft_gumbel(drafter, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gumbel noise for one sampled draft walk: [b, B-1, K] with a selector, [b, B-1, V] per-row (DFlash 1)."""
    config = drafter.config
    width = config.selector_top_k if drafter.candidate_selector is not None else config.vocab_size
    return sample_gumbel((batch, config.block_size - 1, width), drafter.device, generator)


def scatter_scores(row_scores: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Proposal logits over the whole vocabulary: the row scores at the candidate ids, -inf elsewhere."""
    full = row_scores.new_full((*row_scores.shape[:-1], vocab_size), float("-inf"))
    return full.scatter(-1, candidates, row_scores)


@dataclass
class DraftProposal:
    """One drafted block: tokens [b, B-1] and the proposal logits [b, B-1, V] (softmax = q, fp32) they came from."""

    tokens: torch.Tensor
    proposal_logits: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------- the model
class DFlash2PreTrainedModel(PreTrainedModel):
    config_class = DFlash2Config
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlash2DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DFlash2RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DFlash2RotaryEmbedding):
            # a non-persistent buffer: from_pretrained builds the model on the meta device, so recompute it here
            init.copy_(module.inv_freq, module.inverse_frequencies(module.config)[0])
        if isinstance(module, DFlash2DynamicConv):
            # identity: tap 0 passes the row through, every other tap and the dynamic correction are zero
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, DFlash2CandidateSelector):
            # successor codebook zero => bilinear term exactly zero => greedy walk = per-row argmax (DFlash 1)
            init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            init.zeros_(module.successor_codebook)


class DFlash2DraftModel(DFlash2PreTrainedModel):
    """The drafter network. Call `bind_target(target)` before drafting: it borrows the target's embedding matrix and
    LM head without storing them. Speculative decoding with it lives in `generation/` (`attach`)."""

    def __init__(self, config: DFlash2Config):
        config.check()  # again: from_pretrained(..., block_size=8) sets fields after the config's own check
        super().__init__(config)
        self.fc = nn.Linear(config.num_target_taps * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlash2RotaryEmbedding(config)
        self.candidate_selector = DFlash2CandidateSelector(config) if config.uses_conv_and_selector else None
        self._target_parts: dict[str, nn.Module] = {}  # plain dict: borrowed modules are not our parameters
        self.post_init()

    # --------------------------------------------------------------------------------------- generation guard
    @property
    def generation_config(self):
        # transformers' stock assisted path reads `assistant_model.generation_config` first: fail there, clearly.
        raise RuntimeError(
            "A DFlash 2 drafter was passed as `assistant_model` to a model it is not attached to. Call "
            "`dflash2.attach(drafter, target)` (or `drafter.attach(target)` on a drafter loaded with AutoModel) once, "
            "then `target.generate(..., assistant_model=drafter)`."
        )

    @generation_config.setter
    def generation_config(self, value):
        pass  # a drafter generates nothing by itself

    # --------------------------------------------------------------------------------------- the borrowed target
    def bind_target(self, target: PreTrainedModel) -> "DFlash2DraftModel":
        """Borrow `target`'s input embeddings and LM head (checks sizes, layer count and vocabulary first)."""
        self.config.check_target(target.config)
        self._target_parts = {"embed": target.get_input_embeddings(), "head": target.get_output_embeddings()}
        return self

    def is_bound_to(self, target: PreTrainedModel) -> bool:
        """Whether this drafter borrows `target`'s embeddings and LM head (`bind_target`, which `attach` calls)."""
        parts = self._target_parts
        return parts.get("embed") is target.get_input_embeddings() and parts.get("head") is (
            target.get_output_embeddings())

    def _target_part(self, name: str) -> nn.Module:
        if name not in self._target_parts:
            raise RuntimeError(
                "This DFlash 2 drafter has no target bound. Call `drafter.attach(target)` (or "
                "`drafter.bind_target(target)`) first: it borrows the target's embeddings and LM head."
            )
        return self._target_parts[name]

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Raw lookup in the target's embedding matrix (no model-specific scaling or norm) times the input scale."""
        embedding = self._target_part("embed")
        if type(embedding) is nn.Embedding:  # a plain table: calling it lets device_map/offload hooks place it
            embeds = embedding(block_ids.to(_execution_device(embedding, block_ids.device)))
        else:  # subclasses scale or normalise in forward: read the raw table
            embeds = F.embedding(block_ids.to(embedding.weight.device), embedding.weight)
        embeds = embeds.to(self.device, self.dtype)
        scale = self.config.input_embedding_scale
        return embeds if scale == 1.0 else embeds * scale

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on final-normed draft rows, times output_multiplier, then the optional softcap."""
        head = self._target_part("head")
        logits = head(hidden.to(_execution_device(head, hidden.device), head.weight.dtype)).to(hidden.device)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    # --------------------------------------------------------------------------------------- forward
    def forward(
        self,
        noise_embeds: torch.Tensor | None = None,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        input_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """One denoising pass over block rows.

        noise_embeds: [b, n*B, H] embeddings of the block rows (or `input_ids` [b, n*B] to embed them here);
        context_hidden_states: [b, C, taps*H_target] target features of the newly verified positions (C may be 0);
        position_ids: [b, C + n*B] absolute positions of those context rows followed by the block rows;
        attention_mask: None (every row sees all keys), a 2-D [b, keys] padding mask, or a 4-D boolean mask
        [b, 1, n*B, keys] (training); past_key_values / cache: the draft cache. The cache receives the context and
        block keys/values; crop the block back off (`cache.crop(-n*B)`) to keep only verified context.
        Returns `last_hidden_state` [b, n*B, H] after the final norm.
        """
        past_key_values = cache if cache is not None else past_key_values
        if noise_embeds is None:
            if input_ids is None:
                raise ValueError("Pass the block rows as `noise_embeds` or `input_ids`.")
            noise_embeds = self.embed_block(input_ids)
        elif self.config.input_embedding_scale != 1.0:
            noise_embeds = noise_embeds * self.config.input_embedding_scale
        hidden_states = noise_embeds.to(self.dtype)
        batch, num_rows, _ = hidden_states.shape
        if num_rows % self.config.block_size:
            raise ValueError(f"Got {num_rows} block rows; pass whole blocks of block_size={self.config.block_size}.")
        if context_hidden_states is None or context_hidden_states.shape[1] == 0:
            context = hidden_states.new_zeros(batch, 0, self.config.hidden_size)
        else:
            context = self.hidden_norm(self.fc(context_hidden_states.to(self.device, self.dtype)))
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + context.shape[1] + num_rows, device=self.device).expand(batch, -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids.to(self.device))
        mask = self._attention_mask(attention_mask, position_ids, past_key_values, context.shape[1], num_rows)

        for layer in self.layers:
            hidden_states = layer(hidden_states, context, position_embeddings, mask, past_key_values, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: past_key_values})

    def _attention_mask(self, attention_mask, position_ids, cache, num_context, num_rows):
        """The masks the layers get: None when every row may see every key, else one boolean mask [b, 1, rows, keys]
        per layer type. A per-layer-type dict passes through unchanged (the round core builds its own); a 4-D mask (the
        training block mask) is combined with each layer type's causal / window rule; a 2-D mask hides padded keys.

        A layer's keys are the past keys its cache hands back, then the context rows, then the block rows. The past key
        at cache index j sits at position j; the new rows sit at `position_ids`. A sliding layer of a transformers cache
        built from this config (`DynamicCache(config=...)`, which transformers' built-in `speculation_type="dflash"`
        loop uses) keeps and hands back only the last window - 1 past keys.
        """
        if isinstance(attention_mask, dict):
            return attention_mask
        given = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        padded = given is None and attention_mask is not None and not bool(attention_mask.all())
        position_ids = position_ids.to(self.device)
        queries = position_ids[:, -num_rows:]
        new_positions = position_ids[:, -(num_context + num_rows):]
        masks = {}
        for layer in self.layers:
            if layer.attention_type in masks:
                continue
            past, kept = _past_keys(cache, layer.self_attn.layer_idx)
            past_positions = torch.arange(past - kept, past, device=self.device).expand(new_positions.shape[0], -1)
            keys = torch.cat([past_positions, new_positions], dim=1)
            visible = attention_mask[:, -keys.shape[1]:].to(self.device, torch.bool) if padded else None
            rule = _layer_rule(layer.self_attn, queries, keys, visible)
            if given is not None and rule is not None:
                rule = (given & rule) if given.dtype == torch.bool else given.masked_fill(~rule,
                                                                                         torch.finfo(given.dtype).min)
            masks[layer.attention_type] = rule
        if given is not None and all(rule is None for rule in masks.values()):
            return given
        if given is not None:
            return {kind: given if rule is None else rule for kind, rule in masks.items()}
        return {kind: rule for kind, rule in masks.items() if rule is not None} or None

    def attention_masks(self, query_positions, key_positions, key_visible=None):
        """Boolean masks [b, 1, rows, keys] per layer type, applying each type's rule (causal for causal layers,
        |query - key| < window for sliding ones) and `key_visible` [b, keys]; None when nothing is hidden.

        query_positions [b, rows]; key_positions [b or 1, keys] (absolute positions of the keys).
        """
        masks = {}
        for layer in self.layers:
            if layer.attention_type not in masks:
                masks[layer.attention_type] = _layer_rule(layer.self_attn, query_positions, key_positions, key_visible)
        return {kind: rule for kind, rule in masks.items() if rule is not None} or None

    # --------------------------------------------------------------------------------------- drafting
    def propose(
        self,
        anchor_ids: torch.Tensor,
        block_hidden: torch.Tensor,
        gumbel: torch.Tensor | None = None,
        transform: Callable | None = None,
    ) -> DraftProposal:
        """Turn a denoised block into drafts.

        anchor_ids [b]; block_hidden [b, B, H] (row 0 the anchor). DFlash 2: top-k of the unary scores, pair scores,
        then the walk (argmax, or a sample when `gumbel` [b, B-1, K] is given). DFlash 1: per-row choice over the
        whole vocabulary. `transform` rewrites row scores before each choice (see `walk_path`).
        """
        draft_rows = block_hidden[:, 1:]
        unary = self.unary_logits(draft_rows).float()
        if self.candidate_selector is None:
            return per_row_choice(unary, gumbel, transform)
        candidates, pairs = self._candidates_and_pairs(anchor_ids, draft_rows, unary)
        tokens, row_scores = walk_path(pairs, candidates, gumbel, transform)
        return DraftProposal(tokens, scatter_scores(row_scores, candidates, unary.shape[-1]))

    def candidate_scores(self, anchor_ids: torch.Tensor, block_hidden: torch.Tensor):
        """The candidates of every draft row and their pair scores, for drafting a tree (`generation/tree.py`).

        anchor_ids [b]; block_hidden [b, B, H]. Returns candidates [b, B-1, K] (each row's top K unary tokens, best
        first) and pairs [b, B-1, K, K] in fp32: pairs[:, t, i, j] scores candidate j of row t after candidate i of
        row t-1 (after the anchor for t = 0, the same for every i). DFlash 2: the selector's pair scores over its top
        K. DFlash 1 (no selector): the unary scores of the top `selector_top_k`, the same after every predecessor.
        """
        draft_rows = block_hidden[:, 1:]
        unary = self.unary_logits(draft_rows).float()
        if self.candidate_selector is not None:
            return self._candidates_and_pairs(anchor_ids, draft_rows, unary)
        top_scores, candidates = unary.topk(min(self.config.selector_top_k, unary.shape[-1]), dim=-1)
        return candidates, top_scores.unsqueeze(-2).expand(*candidates.shape, candidates.shape[-1])

    def _candidates_and_pairs(self, anchor_ids, draft_rows, unary):
        top_scores, candidates = unary.topk(self.candidate_selector.top_k, dim=-1)
        pairs = self.candidate_selector(draft_rows, top_scores, candidates, anchor_ids.to(candidates.device))
        return candidates, pairs


def per_row_choice(logits: torch.Tensor, gumbel: torch.Tensor | None, transform: Callable | None) -> DraftProposal:
    """DFlash 1 drafting: each row chooses on its own over the whole vocabulary (logits [b, R, V])."""
    if transform is not None:
        rows, tokens = [], []
        for t in range(logits.shape[1]):
            prefix = torch.stack(tokens, dim=1) if tokens else logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
            scores = transform(t, prefix, logits[:, t])
            tokens.append((scores if gumbel is None else scores + gumbel[:, t]).argmax(-1))
            rows.append(scores)
        return DraftProposal(torch.stack(tokens, dim=1), torch.stack(rows, dim=1))
    tokens = (logits if gumbel is None else logits + gumbel).argmax(-1)
    return DraftProposal(tokens, logits)


def _layer_rule(attention, query_positions, key_positions, key_visible=None):
    """What one attention layer's rule lets each query see: [b, 1, rows, keys] bool, or None when it hides nothing.
    Causal layers see keys at or before the query's position; sliding layers keys with |query - key| < window."""
    if not attention.is_causal and not attention.sliding_window and key_visible is None:
        return None
    distance = query_positions[:, :, None] - key_positions[:, None, :]
    allowed = torch.ones_like(distance, dtype=torch.bool)
    if attention.is_causal:
        allowed = allowed & (distance >= 0)
    if attention.sliding_window:
        allowed = allowed & (distance.abs() < attention.sliding_window)
    if key_visible is not None:
        allowed = allowed & key_visible[:, None, :]
    return allowed[:, None]


def _past_keys(cache, layer_idx: int) -> tuple[int, int]:
    """(positions a cache holds for one layer, how many of their keys it hands back at the next update)."""
    if cache is None:
        return 0, 0
    past = cache.get_seq_length(layer_idx)
    layers = getattr(cache, "layers", None) or ()
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if layer is not None and getattr(layer, "is_sliding", False) and getattr(layer, "sliding_window", None):
        stored = layer.keys.shape[-2] if getattr(layer, "is_initialized", False) else 0
        return past, min(stored, layer.sliding_window - 1)
    return past, past


def _execution_device(module: nn.Module, fallback: torch.device) -> torch.device:
    """Where `module` computes: its weight's device, or (weights offloaded by accelerate) the hook's device."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device) if not isinstance(hook.execution_device, int) else torch.device(
            "cuda", hook.execution_device)
    device = module.weight.device
    return fallback if device.type == "meta" else device


def tap_target_features(hidden_states, layer_ids, rows: slice = slice(None)) -> torch.Tensor:
    """The drafter's input: hidden states of target decoder layers `layer_ids` (HF output index i + 1) concatenated
    along the feature axis, [b, rows, taps * H], on the device of the first tapped layer."""
    if hidden_states is None:
        raise ValueError("The target returned no hidden states for output_hidden_states=True, so the drafter has "
                         "nothing to read (DFlash 2 taps target layers). Use a target whose forward returns "
                         "hidden_states, or decode without the drafter.")
    device = hidden_states[layer_ids[0] + 1].device
    return torch.cat([hidden_states[i + 1][:, rows].to(device) for i in layer_ids], dim=-1)


def cache_keyword(model) -> str:
    """The name a model's forward takes its cache under: `cache` from transformers 5.24, else `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


__all__ = ["CACHE_NAME", "DFlash2Config", "DFlash2DraftModel", "DFlash2PreTrainedModel"]
