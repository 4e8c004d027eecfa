"""A lean batched decoding loop for self-distillation: Llama-family targets (llama, mistral, qwen2, qwen3) answered
over a key/value cache allocated once per batch and written in place.

transformers' `generate` spends most of a GPU's time answering large left-padded batches on copies, not on the
model: its dynamic cache concatenates every layer's keys and values at every step (the whole cache is copied each
step), its sdpa path repeats keys and values per query group under a padding mask, and a row that has ended keeps
its place until the batch's longest answer ends. Here:

- the prefill writes the prompts' keys and values into a cache `(2, layers, rows, kv_heads, width, head_dim)` as wide
  as the prompt plus the new tokens, and each decoding step (`decode_step`) writes one column of it in place;
- a decoding step attends to the whole width under a key mask (columns become valid as they are written), so every
  step of a batch has the same shapes: on CUDA it is captured once as a CUDA graph and replayed (`DecodeStep`);
- in a decoding step the query heads that share a key/value head are folded into the query axis, so keys and values
  are read as stored (`(rows, kv_heads, groups, head_dim)` queries);
- every few steps, once the rows still running fit in half the batch, the batch and its cache shrink to the smallest
  halving that holds them (a batch meets a few sizes, one graph each).

The layers' own modules compute everything but attention (norms, projections, rotary embedding, MLP), so the numbers
are the target's; only the order of a few floating-point sums differs from transformers'. In fp32 the greedy answers
equal `generate`'s token for token (tests/test_training_data.py). Other architectures answer through `generate`
(`--cache dynamic`); `supports` says which.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash2.tasks import left_padded

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def supports(target) -> str | None:
    """None when `answer_batch` can decode `target`, else why not (one sentence naming the fix)."""
    config = target.config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"the in-place decoding loop knows the architectures {', '.join(SUPPORTED_MODEL_TYPES)}, not "
                f"{model_type!r}: answer with --cache dynamic (transformers' generate)")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return (f"{model_type} with a sliding window ({config.sliding_window}) is not decoded in place: answer with "
                "--cache dynamic")
    if not hasattr(getattr(target, "model", None), "layers"):
        return "the target has no .model.layers: answer with --cache dynamic"
    return None


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """(rows, vocab) float logits -> (rows,) tokens: the argmax at temperature 0, else a sample from softmax(logits /
    temperature) restricted to the smallest set of tokens whose probability reaches `top_p` (the likeliest always)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1).squeeze(1)


@dataclass
class Layer:
    """One decoder layer's weights as the loop uses them: q, k and v projections fused into one matmul, gate and up
    projections into another; norms and the activation are the layer's own modules."""
    input_norm: torch.nn.Module
    qkv_weight: torch.Tensor  # (q_heads * d + 2 * kv_heads * d, hidden)
    qkv_bias: torch.Tensor | None
    q_norm: torch.nn.Module | None  # qwen3 normalises queries and keys per head
    k_norm: torch.nn.Module | None
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up_weight: torch.Tensor  # (2 * intermediate, hidden)
    act: torch.nn.Module
    down_proj: torch.nn.Module


@dataclass
class Decoder:
    embed: torch.nn.Module
    rotary: torch.nn.Module
    rotate: callable  # the model module's apply_rotary_pos_emb
    layers: list[Layer]
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    q_heads: int
    kv_heads: int
    head_dim: int
    scaling: float


def decoder_of(target) -> Decoder:
    why = supports(target)
    if why:
        raise ValueError(why)
    model = target.model
    layers = []
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        biases = [p.bias for p in projections]
        layers.append(Layer(
            input_norm=layer.input_layernorm,
            qkv_weight=torch.cat([p.weight for p in projections]),
            qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
            q_norm=getattr(attention, "q_norm", None), k_norm=getattr(attention, "k_norm", None),
            o_proj=attention.o_proj, post_norm=layer.post_attention_layernorm,
            gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), act=mlp.act_fn,
            down_proj=mlp.down_proj))
    first = model.layers[0].self_attn
    config = target.config.get_text_config()
    return Decoder(embed=model.embed_tokens, rotary=model.rotary_emb,
                   rotate=sys.modules[type(first).__module__].apply_rotary_pos_emb, layers=layers, norm=model.norm,
                   lm_head=target.lm_head, q_heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                   head_dim=first.head_dim, scaling=first.scaling)


def layer_forward(decoder: Decoder, layer: Layer, x, cos, sin, keys, values, columns, window: int, mask):
    """x (rows, T, hidden) at the cache columns `columns` (a (T,) long tensor); keys/values (rows, kv_heads, width,
    d) the layer's cache, written here; attention reads its first `window` columns under mask (rows, 1, T, window),
    bool, True where a query sees a key."""
    rows, length, _ = x.shape
    d, hq, hkv = decoder.head_dim, decoder.q_heads, decoder.kv_heads
    qkv = F.linear(layer.input_norm(x), layer.qkv_weight, layer.qkv_bias)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(rows, length, hq, d), k.view(rows, length, hkv, d), v.view(rows, length, hkv, d)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = decoder.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (rows, heads, T, d)
    keys.index_copy_(2, columns, k)
    values.index_copy_(2, columns, v.transpose(1, 2))
    seen_keys, seen_values = keys[:, :, :window], values[:, :, :window]  # views, never copies
    groups = hq // hkv
    if length == 1:  # decoding: the group's query heads side by side, keys and values as stored
        out = F.scaled_dot_product_attention(q.reshape(rows, hkv, groups, d), seen_keys, seen_values,
                                             attn_mask=mask, scale=decoder.scaling)  # (rows, kv_heads, groups, d)
        out = out.reshape(rows, 1, hq * d)
    else:  # prefill: once per batch, keys repeated per group
        out = F.scaled_dot_product_attention(q, seen_keys.repeat_interleave(groups, 1),
                                             seen_values.repeat_interleave(groups, 1), attn_mask=mask,
                                             scale=decoder.scaling)  # (rows, q_heads, T, d)
        out = out.transpose(1, 2).reshape(rows, length, hq * d)
    x = x + layer.o_proj(out)
    gate, up = F.linear(layer.post_norm(x), layer.gate_up_weight).chunk(2, dim=-1)
    return x + layer.down_proj(layer.act(gate) * up)


def forward_columns(decoder: Decoder, cache: torch.Tensor, input_ids, position_ids, columns, window: int, mask):
    """Logits (rows, vocab), float, of the last of `input_ids` (rows, T), whose keys and values go to the cache
    columns `columns` (T,). cache: (2, layers, rows, kv_heads, width, d)."""
    x = decoder.embed(input_ids)
    cos, sin = decoder.rotary(x, position_ids)
    for index, layer in enumerate(decoder.layers):
        x = layer_forward(decoder, layer, x, cos, sin, cache[0, index], cache[1, index], columns, window, mask)
    return decoder.lm_head(decoder.norm(x[:, -1:]))[:, 0].float()


def decode_step(decoder: Decoder, cache, key_valid, tokens, position, column):
    """One new token per row (tokens (rows,), positions (rows, 1)) at cache column `column` ((1,) long tensor),
    attending to every column of the cache that `key_valid` (rows, width) marks: the whole cache's width is read every
    step, so that every step has the same shapes (one CUDA graph serves all of them)."""
    return forward_columns(decoder, cache, tokens[:, None], position, column, cache.shape[-2],
                           key_valid[:, None, None, :])


class DecodeStep:
    """`decode_step` over one batch's cache and key mask; on CUDA captured once as a CUDA graph and replayed (the
    step's few hundred small kernels then cost one launch; eagerly a step of 1024 or 2048 rows is bound by launching
    them). Call it with the step's tokens, positions and column."""

    def __init__(self, decoder: Decoder, cache, key_valid, tokens, position, column: int, graph: bool = True):
        self.decoder, self.cache, self.key_valid = decoder, cache, key_valid
        self.tokens, self.position = tokens.clone(), position.clone()
        self.column = torch.tensor([column], device=cache.device)
        self.graph = None
        if graph and cache.device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # a warm-up outside the graph (it writes what the replay rewrites)
                self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()

    def _step(self):
        return decode_step(self.decoder, self.cache, self.key_valid, self.tokens, self.position, self.column)

    def __call__(self, tokens, position, column: int):
        self.tokens.copy_(tokens)
        self.position.copy_(position)
        self.column.fill_(column)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits


@torch.no_grad()
def answer_batch(target, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: list[int],
                 temperature: float = 0.0, top_p: float = 1.0, check_every: int = 8, prefill_rows: int = 512,
                 decoder: Decoder | None = None, graphs: bool = True) -> list[list[int]]:
    """One batch of prompts (token ids) answered greedily (temperature 0) or sampled within the `top_p` nucleus.

    Returns each prompt's new tokens; tokens after its first EOS are not meaningful. Every `check_every` steps, once
    the rows still running fit in half the batch, the batch and its cache shrink to the smallest halving of its size
    that holds them (running rows first, ended ones filling up), so that a batch meets few sizes (each a CUDA graph).
    Prefill runs `prefill_rows` prompts at a time. `graphs=False`: no CUDA graphs (the same kernels, launched one by
    one)."""
    decoder = decoder or decoder_of(target)
    device = decoder.lm_head.weight.device
    dtype = decoder.lm_head.weight.dtype
    input_ids, attention_mask = (t.to(device) for t in left_padded(prompts, pad_id))
    rows, width = input_ids.shape
    columns = -(-(width + max_new_tokens) // 16) * 16  # aligned rows for the attention kernels
    cache = torch.zeros((2, len(decoder.layers), rows, decoder.kv_heads, columns, decoder.head_dim), dtype=dtype,
                        device=device)
    key_valid = torch.zeros((rows, columns), dtype=torch.bool, device=device)  # a new column is valid once written
    key_valid[:, :width] = attention_mask.bool()
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as generate numbers them
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)
    prompt_columns = torch.arange(width, device=device)
    logits = torch.empty((rows, decoder.lm_head.weight.shape[0]), device=device)
    for start in range(0, rows, prefill_rows):
        part = slice(start, start + prefill_rows)
        # a padding query sees itself, so that no attention row is empty (an empty row would give NaN values)
        mask = (causal & key_valid[part, None, :width]) | diagonal  # (rows, width, width)
        logits[part] = forward_columns(decoder, cache[:, :, part], input_ids[part], position_ids[part],
                                       prompt_columns, width, mask[:, None])
    eos = torch.tensor(eos_ids, device=device)
    answers = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    row_of = torch.arange(rows, device=device)  # the prompt of each row of the batch
    ended = torch.zeros(rows, dtype=torch.bool, device=device)
    position = position_ids[:, -1:]
    step_of = None
    for step in range(max_new_tokens):
        tokens = next_tokens(logits, temperature, top_p)  # (rows,)
        answers[row_of, step] = tokens  # an ended row's later tokens land after its EOS
        ended |= torch.isin(tokens, eos)
        if step == max_new_tokens - 1:
            break
        if step % check_every == check_every - 1:
            running = int((~ended).sum())
            if running == 0:
                break
            size = len(row_of)
            while size // 2 >= running:
                size //= 2
            if size < len(row_of):
                keep = torch.argsort(ended.to(torch.int8), stable=True)[:size]  # the running rows first
                cache, key_valid = cache[:, :, keep], key_valid[keep]
                row_of, tokens, ended, position = row_of[keep], tokens[keep], ended[keep], position[keep]
                step_of = None
        column = width + step
        key_valid[:, column] = True
        position = position + 1
        if step_of is None:  # a new batch size: a new graph
            step_of = DecodeStep(decoder, cache, key_valid, tokens, position, column, graphs)
        logits = step_of(tokens, position, column)
    return answers.tolist()
