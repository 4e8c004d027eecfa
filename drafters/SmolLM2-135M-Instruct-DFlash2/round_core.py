# Generated from generation/round_core.py by `python -m dflash2.generation.flat_code`; do not edit.
"""The one round core behind DFlash 2's own loops (batch 1 and batched, eager and CUDA graphs).

It owns fixed buffers for one (target, drafter, batch, capacity) and one round in which every tensor has the same
shape, stride and address each time, so the round can be captured once and replayed as a CUDA graph.

Sampling settings are data: each row's temperature, top-k and top-p and the request's EOS ids live in tensors of the
core, written before each request (`set_sampling`) like the rest of its state. So one core, and the graphs captured
or compiled from it, serves greedy search and every sampling setting. It has two rounds: `round` (greedy) and
`sampled_round` (exact speculative sampling); the greedy round does no sampling work (no sort of the vocabulary).

Layout. Row r lives in columns 0 .. capacity-1 of both caches. Its prompt is left-padded so that its first real token
sits in column `first_column[r]`; column c holds position c - first_column[r]. A round writes its block
[anchor, d1 .. d(B-1)] into columns start[r] .. start[r]+B-1 of the target cache, and the tapped features of the
previous block into the drafter's context at the columns that block occupied. Rejected drafts need no rollback: their
columns lie at or beyond the next start, where every mask hides them, and the next block overwrites them.

A round reads top to bottom: `draft_block` -> `propose` -> `verify` -> `accept`. `accept` advances the state in place
and appends the emitted tokens to a per-row output buffer, so rounds can be queued back to back with no host read in
between; a finished row (EOS or max_new_tokens) freezes until the host notices.

With `tree_nodes`, `tree_round` verifies a tree instead of a path (`tree.py`): `draft_block` -> `draft_tree` (greedy:
the beam's best nodes) or `sample_tree` (sampling: children sampled from the drafter's proposal into a fixed shape) ->
`verify_tree` (the tree's N nodes at columns start .. start+N-1, each seeing the context and its own root path) ->
`accept_tree` (the target's argmax after each node) or `speculative_accept_tree` (rejection sampling at every node)
-> `keep_path` (the accepted path's keys moved to the columns of depths 0 .. B-1) -> `accept` with the path as the
block, so the state after the round is laid out as after a path round.
"""

from __future__ import annotations

import copy

import torch
import transformers

from .configuration_dflash2 import tree_nodes_problem
from .modeling_dflash2 import cache_keyword, sample_gumbel, tap_target_features
from .sampling import (Sampling, draft_temperature, first_token, greedy_accept, is_any_of, padded_eos_ids,
                       row_warped_probabilities, speculative_accept)
from .transformers_patches import assisted_loop_rolls_state_back
from .tree import (DraftTree, SampledTree, SampledTreeShape, accept_tree, draft_tree, sample_tree,
                   speculative_accept_tree)

PREFILL_CHUNK = 2048  # prompt columns per prefill forward: bounds the [chunk, capacity] mask and the hidden states
# Prefill widths when prompts are bucketed (for captured prefill graphs): a prompt is left-padded to the next one.
# Steps of about 1.5x rather than 2x: the padding columns count towards the buffers a request needs, and a round
# attends over every column of its buffers (a 140-token prompt and 256 new tokens fit 512 columns from a 192 bucket,
# not from a 256 one)
PREFILL_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # up to PREFILL_CHUNK


# The round's state: every tensor of a `RoundCore`, declared once, in the order a fused round takes them. The
# captured graphs (graphs.py, `RoundRunner`) and the fused rounds (fused_package.py, `RoundProgram`: the state inputs
# of the compiled signature; background_build.py: the child's copy) read the core through `round_state`, which refuses
# a core whose tensors differ from this list: a new buffer is declared here, or no round of it is captured or compiled.
ROUND_STATE = (
    "columns", "offsets", "node_offsets", "mask_row",  # fixed index rows
    "temperature", "top_k", "top_p", "eos",  # the request's settings (`set_sampling`)
    "anchor", "start", "first_column", "context_columns", "features", "max_new_tokens", "done",  # every row's state
    "output", "output_length", "rounds", "accepted_per_position",  # what the rounds emitted
    "prompt_ids", "prompt_logits", "prompt_features",  # the prompt, staged for `encode_prompt`
    "draft_noise", "uniform", "bonus_noise", "node_gumbel", "node_uniform", "final_uniform",  # a sampled round's noise
)


def round_state(core) -> dict:
    """The core's state tensors by name, in `ROUND_STATE`'s order; an error when its tensors are not exactly those."""
    tensors = {name for name, value in vars(core).items() if isinstance(value, torch.Tensor)}
    if tensors != set(ROUND_STATE):
        raise RuntimeError(f"The round core's tensors differ from round_core.ROUND_STATE (undeclared: "
                           f"{sorted(tensors - set(ROUND_STATE))}, missing: {sorted(set(ROUND_STATE) - tensors)}): "
                           "declare every state tensor there, so that captured and fused rounds take it.")
    return {name: getattr(core, name) for name in ROUND_STATE}


def columns_per_round(block_size: int, tree_nodes: int = 0) -> int:
    """Columns a round writes past its anchor's: the block, or the tree's nodes when larger."""
    return max(block_size, tree_nodes)


def prefill_width(length: int, block_size: int, bucketed: bool = False) -> int:
    """Columns a prompt of `length` tokens is left-padded to (the first round's context is its last block)."""
    width = max(length, block_size)
    if bucketed and width <= PREFILL_BUCKETS[-1]:
        return next(bucket for bucket in PREFILL_BUCKETS if bucket >= width)
    return width


class ColumnCache:
    """Keys/values per layer in fixed buffers [b, kv_heads, capacity, head_dim], written at per-row columns.

    Before a forward, `set_write_columns(columns [b, n])` names where the first n new key/value rows of every row go.
    `update` writes them and returns the whole buffer, followed (drafter side, `append_unwritten`) by the rows it did
    not store: the drafter's block rows are attended to but never kept. Buffers are allocated at the first update, on
    the device of that layer's keys (a target spread by `device_map` keeps each layer's cache beside the layer).

    Writes and moves are `index_put_` into the 4-d buffers themselves. Inductor writes those in place; an
    `index_copy_` into a flattened view of the buffer, which it also lowers in place on a CPU, costs every layer a
    kernel over the whole buffer and a copy back on CUDA.
    """

    is_compileable = True

    def __init__(self, num_layers: int, capacity: int, append_unwritten: bool):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = capacity
        self.append_unwritten = append_unwritten
        self.write_columns: torch.Tensor | None = None
        self._write_index: dict[torch.device, tuple] = {}

    def set_write_columns(self, columns: torch.Tensor) -> None:
        self.write_columns = columns
        self._write_index = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            batch, heads, _, head_dim = key_states.shape
            shape = (batch, heads, self.capacity, head_dim)
            self.keys[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        count = self.write_columns.shape[1]
        device = keys.device
        if device not in self._write_index:  # once per forward and device, not per layer
            self._write_index[device] = column_index(keys, self.write_columns)
        index = self._write_index[device]
        keys.index_put_(index, key_states[:, :, :count])
        values.index_put_(index, value_states[:, :, :count])
        if not self.append_unwritten:
            return keys, values
        return torch.cat([keys, key_states[:, :, count:]], dim=2), torch.cat([values, value_states[:, :, count:]], dim=2)

    def move_columns(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy every layer's keys/values at columns `source` [b, n] to columns `dest` [b, n] (all read first). The
        indices are built once per buffer shape and device: each buffer costs one gather and one `index_put_`."""
        index = {}
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                if buffer is None:
                    continue
                key = (buffer.device, buffer.shape)
                if key not in index:
                    index[key] = column_index(buffer, source), column_index(buffer, dest)
                read, write = index[key]
                buffer.index_put_(write, buffer[read])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def grow(self, capacity: int) -> None:
        """At least `capacity` columns from now on; the columns held keep their keys/values (new buffers)."""
        if capacity > self.capacity:
            for buffers in (self.keys, self.values):
                buffers[:] = [None if b is None else torch.nn.functional.pad(b, (0, 0, 0, capacity - self.capacity))
                              for b in buffers]
            self.capacity = capacity

    def row_view(self, row: int) -> "ColumnCache":
        """This cache's row `row` alone: every layer's buffers sliced to that row (views: writes land here)."""
        view = ColumnCache(len(self.keys), self.capacity, self.append_unwritten)
        view.keys = [keys[row: row + 1] for keys in self.keys]
        view.values = [values[row: row + 1] for values in self.values]
        return view


ROW_BUFFERS = ("temperature", "top_k", "top_p", "anchor", "start", "first_column", "context_columns", "features",
               "max_new_tokens", "done", "output", "output_length", "rounds", "accepted_per_position", "prompt_ids",
               "prompt_logits", "prompt_features", "draft_noise", "uniform", "bonus_noise", "node_gumbel",
               "node_uniform", "final_uniform")  # a RoundCore's buffers with one entry per row (`RoundCore.row_view`)


def column_index(buffer: torch.Tensor, columns: torch.Tensor) -> tuple:
    """Indices of `buffer` [b, heads, capacity, d] at per-row `columns` [b, n], for every head: (rows [b, 1, 1],
    heads [1, heads, 1], columns [b, 1, n]), which select (`buffer[index]`) or write (`index_put_`) [b, heads, n, d]."""
    batch, heads = buffer.shape[:2]
    device = buffer.device
    return (torch.arange(batch, device=device).view(-1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1),
            columns.to(device)[:, None, :])


class DraftCore:
    """The drafter's side of a round over fixed buffers, for `batch` rows of `capacity` columns: its context cache (a
    `ColumnCache`), the last verified block's features and where they go, and the block [anchor, MASK ...] it denoises
    (`draft_block`). `RoundCore` adds the target's side; transformers' assisted loop drives one alone
    (`candidate_generator.py`), which passes the cache an earlier turn filled as `draft_cache`."""

    def __init__(self, drafter, batch: int, capacity: int, draft_cache: ColumnCache | None = None):
        config = drafter.config
        self.drafter, self.batch, self.capacity, self.block_size = drafter, batch, capacity, config.block_size
        self.device = device = drafter.device
        self.draft_cache = draft_cache or ColumnCache(config.num_hidden_layers, capacity, append_unwritten=True)
        block, long = self.block_size, dict(dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, **long)  # [capacity]
        self.offsets = torch.arange(block, **long)  # [B]
        self.mask_row = torch.full((1, block - 1), config.mask_token_id, **long)
        self.anchor = torch.zeros(batch, **long)  # last emitted token: row 0 of the next block
        self.start = torch.zeros(batch, **long)  # column of the anchor
        self.first_column = torch.zeros(batch, **long)  # first real (unpadded) column
        self.context_columns = torch.zeros(batch, block, **long)  # columns of `features`, the last verified block
        self.features = torch.zeros(batch, block, config.num_target_taps * config.target_hidden_size,
                                    dtype=drafter.dtype, device=device)

    def draft_block(self) -> torch.Tensor:
        """Store the last block's features in the drafter's context and denoise [anchor, MASK ...] at `start`.
        Returns the block's final hidden states [b, B, H]."""
        visible = (self.columns >= self.first_column.view(-1, 1)) & (self.columns < self.start.view(-1, 1))
        return self.denoise(self.features, self.context_columns, self.start.view(-1, 1) + self.offsets, visible)

    def store_context(self, features: torch.Tensor, columns: torch.Tensor) -> None:
        """Write features [b, n, taps*H] into the drafter's context at `columns` [b, n] (one drafter pass whose block
        rows see only themselves and are thrown away)."""
        hidden = torch.zeros(self.batch, self.capacity, dtype=torch.bool, device=self.device)
        self.denoise(features, columns, columns[:, -1:] + 1 + self.offsets, hidden)

    def denoise(self, features, columns, block_columns, visible) -> torch.Tensor:
        """One drafter pass: `features` [b, n, taps*H] written into the context at `columns` [b, n], and the block
        [anchor, MASK ...] at `block_columns` [b, B], which sees the buffer's columns where `visible` [b, capacity]
        and the whole block. Returns the block's final hidden states [b, B, H]."""
        drafter, batch, first = self.drafter, self.batch, self.first_column.view(-1, 1)
        block_ids = torch.cat([self.anchor.view(-1, 1), self.mask_row.expand(batch, -1)], dim=1)
        self.draft_cache.set_write_columns(columns)
        key_columns = torch.cat([self.columns.expand(batch, -1), block_columns], dim=1)  # buffer, then the block
        visible = torch.cat([visible, torch.ones_like(block_columns, dtype=torch.bool)], dim=1)
        masks = drafter.attention_masks(block_columns - first, key_columns - first, visible)
        positions = (torch.cat([columns, block_columns], dim=1) - first).clamp(min=0)
        return drafter(noise_embeds=drafter.embed_block(block_ids), context_hidden_states=features,
                       position_ids=positions, attention_mask=masks, cache=self.draft_cache).last_hidden_state


class RoundCore(DraftCore):
    """Fixed buffers and fixed-shape rounds for (target, drafter, batch, capacity, tree size), greedy and sampled; the
    settings of a request are written into its tensors (`set_sampling`).

    `tree_nodes` > 0: both rounds verify a tree of that many nodes (root included, `tree.py`), drafted by a beam of
    `drafter.config.tree_width`; 0: a path."""

    def __init__(self, target, drafter, batch: int, capacity: int, bucketed_prefill: bool = False, tree_nodes: int = 0):
        config = drafter.config
        check_target_fits(target)
        super().__init__(drafter, batch, capacity)
        self.target = target
        self.tree_width = config.tree_width
        check_tree_nodes(tree_nodes, config)
        self.tree_nodes = tree_nodes
        self.round_columns = columns_per_round(config.block_size, tree_nodes)
        self.layer_ids = list(config.target_layer_ids)
        device = self.device
        self.cache_keyword = cache_keyword(target)
        text = target.config.get_text_config()
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        self.target_window = text.sliding_window if "sliding_attention" in layer_types else None
        self.target_dtype = target.dtype  # of the additive masks the target is given
        self.target_cache = ColumnCache(text.num_hidden_layers, capacity, append_unwritten=False)
        self.serial = 0  # requests prefilled so far: what the buffers hold belongs to the latest

        block, long = self.block_size, dict(dtype=torch.long, device=device)
        self.node_offsets = torch.arange(max(tree_nodes, 1), **long)  # [N]: a tree's nodes, one column each
        # ---- the request's settings (`set_sampling`): which round runs, each row's warping, the EOS ids (-1: none)
        self.do_sample = False
        self.temperature = torch.ones(batch, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(batch, **long)  # 0: off
        self.top_p = torch.ones(batch, dtype=torch.float64, device=device)  # 1.0: off
        self.eos = torch.tensor(padded_eos_ids(()), **long)  # [MAX_EOS_TOKENS]
        # ---- state of every row beside the drafter's (`DraftCore`), advanced in place by each round
        self.max_new_tokens = torch.zeros(batch, **long)  # per row: a row admitted alone (`admit`) has its own
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        # ---- what the rounds emitted: max_new_tokens fits in capacity, and a round writes one block past the end
        self.output = torch.zeros(batch, capacity + block, **long)
        self.output_length = torch.zeros(batch, **long)
        self.rounds = torch.zeros(batch, **long)
        self.accepted_per_position = torch.zeros(batch, block - 1, **long)
        # ---- the prompt, staged for `encode_prompt`, and what encoding it leaves for `start_decoding`
        self.bucketed_prefill = bucketed_prefill
        self.prompt_ids = torch.zeros(batch, PREFILL_CHUNK if bucketed_prefill else block, **long)
        self.prompt_logits = torch.zeros(batch, text.vocab_size, dtype=torch.float32, device=device)
        self.prompt_features = torch.zeros_like(self.features)
        # ---- randomness of a sampling round, drawn outside the round (see `draw_noise`)
        width = config.selector_top_k if drafter.candidate_selector is not None else config.vocab_size
        self.draft_noise = torch.zeros(batch, block - 1, width, device=device)
        self.uniform = torch.zeros(batch, block - 1, device=device)
        self.bonus_noise = torch.zeros(batch, config.vocab_size, device=device)
        # a sampled tree round (`sample_tree`): its fixed shape, Gumbel noise per node over the candidates below it
        # (its children's draw), a uniform per node (its test) and one per row (the sample that ends the round)
        candidates = min(config.selector_top_k, config.vocab_size)
        self.sampled_shape = SampledTreeShape.grow(tree_nodes, block - 1, candidates, device) if tree_nodes else None
        self.node_gumbel = torch.zeros(batch, tree_nodes, candidates, device=device)
        self.node_uniform = torch.zeros(batch, tree_nodes, device=device)
        self.final_uniform = torch.zeros(batch, device=device)

    # ------------------------------------------------------------------------------------------ masks
    def target_masks(self, query_columns: torch.Tensor):
        """What verification queries at `query_columns` [b, q] see: real columns up to their own (a padding column
        sees itself, so no row is empty), within the target's window on its sliding layers (`layer_masks`)."""
        keys = self.columns.view(1, 1, -1)
        queries = query_columns[:, :, None]
        allowed = ((keys >= self.first_column.view(-1, 1, 1)) & (keys <= queries)) | (keys == queries)
        if self.target_window is None:
            return self.layer_masks(allowed)
        return self.layer_masks(allowed, allowed & (queries - keys < self.target_window))

    def layer_masks(self, allowed: torch.Tensor, sliding: torch.Tensor | None = None):
        """The target's masks from what its queries may see, [b, q, capacity] (and, with a window, what its sliding
        layers may see): additive masks [b, 1, q, capacity] (`additive_mask`), one per layer type when there are two."""
        full = additive_mask(allowed[:, None], self.target_dtype)
        if sliding is None:
            return full
        return {"full_attention": full, "sliding_attention": additive_mask(sliding[:, None], self.target_dtype)}

    # ------------------------------------------------------------------------------------------ one round
    def propose(self, hidden: torch.Tensor, sampled: bool = False):
        """Drafts [b, B-1] from the denoised block (selector walk), and their proposal distribution; `sampled`: a
        sample of each row's walk at its temperature, drawn with `draft_noise`."""
        return self.drafter.propose(self.anchor, hidden, gumbel=self.draft_noise if sampled else None,
                                    transform=draft_temperature(self.temperature) if sampled else None)

    def verify(self, block: torch.Tensor):
        """One target forward over the block [b, n] (n <= B) at columns start .. start+n-1: fp32 logits [b, n, V] and
        the tapped features [b, n, taps*H] of its rows."""
        block_columns = self.start.view(-1, 1) + self.offsets[: block.shape[1]]
        self.target_cache.set_write_columns(block_columns)
        out = self.target(input_ids=block, position_ids=block_columns - self.first_column.view(-1, 1),
                          attention_mask=self.target_masks(block_columns), use_cache=True, output_hidden_states=True,
                          **{self.cache_keyword: self.target_cache})
        return out.logits.float(), tap_target_features(out.hidden_states, self.layer_ids).to(self.device)

    def accept(self, block, accepted, next_token, features) -> None:
        """Emit each live row's accepted drafts and its next token, then advance its state; finished rows freeze."""
        live = ~self.done
        advance = torch.where(live, accepted + 1, torch.zeros_like(accepted))
        emitted = torch.cat([block[:, 1:], next_token.view(-1, 1)], dim=1).scatter(1, accepted.view(-1, 1),
                                                                                   next_token.view(-1, 1))
        slots = (self.output_length.view(-1, 1) + self.offsets).clamp(max=self.output.shape[1] - 1)
        self.output.scatter_(1, slots, emitted)  # a frozen row writes only past its length
        hit_eos = (is_any_of(emitted, self.eos) & (self.offsets <= accepted.view(-1, 1))).any(-1)
        self.accepted_per_position.add_(live.view(-1, 1) & (self.offsets[:-1] < accepted.view(-1, 1)))
        self.rounds.add_(live.long())
        self.output_length.add_(advance)
        self.done.logical_or_(live & (hit_eos | (self.output_length >= self.max_new_tokens)))
        self.context_columns.copy_(self.start.view(-1, 1) + self.offsets)
        self.features.copy_(features)
        self.start.add_(advance)
        self.anchor.copy_(torch.where(live, next_token, self.anchor))

    @torch.no_grad()
    def round(self) -> None:
        """draft -> propose -> verify -> accept, all on the device, every shape fixed (greedy; with `tree_nodes`, the
        tree round)."""
        if self.tree_nodes:
            return self.tree_round()
        hidden = self.draft_block()
        proposal = self.propose(hidden)
        block = torch.cat([self.anchor.view(-1, 1), proposal.tokens], dim=1)
        logits, features = self.verify(block)
        accepted, next_token = greedy_accept(proposal.tokens, logits)
        self.accept(block, accepted, next_token, features)

    @torch.no_grad()
    def sampled_round(self) -> None:
        """`round` with exact speculative sampling: drafts sampled at each row's temperature, accepted against the
        target's distribution warped by each row's settings (fill the noise first: `draw_noise`). With `tree_nodes`,
        the sampled tree round (`tree_round`)."""
        if self.tree_nodes:
            return self.tree_round(sampled=True)
        hidden = self.draft_block()
        proposal = self.propose(hidden, sampled=True)
        block = torch.cat([self.anchor.view(-1, 1), proposal.tokens], dim=1)
        logits, features = self.verify(block)
        target_probs = row_warped_probabilities(logits, self.temperature, self.top_k, self.top_p)
        accepted, next_token = speculative_accept(proposal.tokens, proposal.proposal_logits.softmax(-1), target_probs,
                                                  self.uniform, self.bonus_noise)
        self.accept(block, accepted, next_token, features)

    # ------------------------------------------------------------------------------------------ a round with a tree
    def tree_round(self, sampled: bool = False) -> None:
        """draft -> tree -> verify every node -> accept the longest root path the target follows -> keep it, every
        shape fixed. Greedy: the beam's tree and the target's argmax after each node. `sampled`: a tree sampled from
        the drafter's proposal, accepted by exact speculative sampling at each node (`speculative_accept_tree`)."""
        hidden = self.draft_block()
        if sampled:
            drafted = self.sample_tree(hidden)
            tree = drafted.tree
        else:
            tree = self.draft_tree(hidden)
        logits, features = self.verify_tree(tree)
        if sampled:
            target_probs = row_warped_probabilities(logits, self.temperature, self.top_k, self.top_p)  # [b, N, V]
            accepted, next_token, path = speculative_accept_tree(drafted, self.sampled_shape, target_probs,
                                                                 self.node_uniform, self.final_uniform,
                                                                 self.block_size)
        else:
            accepted, next_token, path = accept_tree(tree, logits.argmax(-1), self.block_size)  # path [b, B]
        self.keep_path(path)
        path_features = features.gather(1, path.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        self.accept(tree.tokens.gather(1, path), accepted, next_token, path_features)

    def draft_tree(self, hidden: torch.Tensor) -> DraftTree:
        """The beam's tree of `tree_nodes` nodes from the denoised block [b, B, H]."""
        candidates, pairs = self.drafter.candidate_scores(self.anchor, hidden)
        return draft_tree(self.anchor, candidates, pairs, self.tree_nodes, self.tree_width)

    def sample_tree(self, hidden: torch.Tensor) -> SampledTree:
        """The sampled tree of `tree_nodes` nodes (`sampled_shape`) from the denoised block [b, B, H], children drawn
        at each row's temperature with `node_gumbel`."""
        candidates, pairs = self.drafter.candidate_scores(self.anchor, hidden)
        return sample_tree(self.anchor, candidates, pairs, self.sampled_shape, self.temperature, self.node_gumbel)

    def verify_tree(self, tree: DraftTree):
        """One target forward over the tree's nodes at columns start .. start+N-1 (positions by depth): the target's
        logits after each node [b, N, V] and the nodes' tapped features [b, N, taps*H]."""
        node_columns = self.start.view(-1, 1) + self.node_offsets
        self.target_cache.set_write_columns(node_columns)
        positions = self.start.view(-1, 1) - self.first_column.view(-1, 1) + tree.depth
        out = self.target(input_ids=tree.tokens, position_ids=positions, attention_mask=self.tree_masks(tree),
                          use_cache=True, output_hidden_states=True, **{self.cache_keyword: self.target_cache})
        return out.logits, tap_target_features(out.hidden_states, self.layer_ids).to(self.device)

    def tree_masks(self, tree: DraftTree):
        """What the tree's nodes see: the row's real columns before `start`, and the columns of the nodes on their own
        root path (themselves included); within the target's window on its sliding layers (`layer_masks`)."""
        nodes = tree.tokens.shape[1]
        keys = self.columns.view(1, 1, -1)
        start, first = self.start.view(-1, 1, 1), self.first_column.view(-1, 1, 1)
        slot = keys - start  # [b, 1, C]: the node a column holds, when 0 <= slot < N
        in_tree = (slot >= 0) & (slot < nodes)
        on_root_path = tree.ancestors.gather(2, slot.clamp(0, nodes - 1).expand(-1, nodes, -1)) & in_tree
        allowed = ((keys >= first) & (keys < start)) | on_root_path  # [b, N, C]
        if self.target_window is None:
            return self.layer_masks(allowed)
        depth_of_slot = tree.depth.gather(1, slot.clamp(0, nodes - 1).squeeze(1)).unsqueeze(1)
        key_positions = torch.where(in_tree, start - first + depth_of_slot, keys - first)
        query_positions = (start - first).view(-1, 1, 1) + tree.depth.unsqueeze(-1)
        return self.layer_masks(allowed, allowed & (query_positions - key_positions < self.target_window))

    def keep_path(self, path: torch.Tensor) -> None:
        """Move the target keys/values of the accepted path's nodes (path [b, B], by depth) to columns start ..
        start+B-1, where a path round would have written them."""
        start = self.start.view(-1, 1)
        self.target_cache.move_columns(start + path, start + self.offsets)

    def live_entries(self, start=None, length=None, context_columns=None) -> dict[str, torch.Tensor]:
        """Which entries of the round's buffers anything reads later, as boolean masks: `output` up to each row's
        length, the `features` rows of columns before `start` (the verified block's accepted rows), and every cache
        column before `start` (`cache_columns`, [b, capacity]). Past them lie a rejected draft's token, features and
        keys/values, which the next round overwrites before reading (or never reads): two rounds that differ there
        alone (a near tie among rejected drafts in half precision) leave the same live state. `start`, `length` and
        `context_columns` ([b], [b], [b, B]) replace the core's own (a check compares up to other limits)."""
        start = (self.start if start is None else start).view(-1, 1)
        length = self.output_length if length is None else length
        context_columns = self.context_columns if context_columns is None else context_columns
        slots = torch.arange(self.output.shape[1], device=self.device)
        return {"output": slots < length.view(-1, 1),
                "features": (context_columns < start).unsqueeze(-1).expand_as(self.features),
                "cache_columns": self.columns < start}

    def draw_noise(self, generator: torch.Generator | None = None) -> None:
        """Fill the sampled round's random buffers in place: Gumbel noise for the walk and the bonus and uniforms for
        the tests of a path round; for a tree round, Gumbel noise for each node's children and uniforms for each
        node's test and the round's last sample."""
        if self.tree_nodes:
            sample_gumbel(self.node_gumbel.shape, self.device, generator, out=self.node_gumbel)
            self.node_uniform.uniform_(generator=generator)
            self.final_uniform.uniform_(generator=generator)
            return
        for buffer in (self.draft_noise, self.bonus_noise):
            sample_gumbel(buffer.shape, buffer.device, generator, out=buffer)
        self.uniform.uniform_(generator=generator)

    def warm_sampling_steps(self) -> None:
        """Run once the eager steps a sampled request adds around its captured rounds (the first token's draw from the
        warped prompt logits, the noise), on a private generator and into buffers every request overwrites. On CUDA a
        kernel's first use in a process loads it, which otherwise falls in the first sampled call (so does the sampled
        graph's first launch, which `graphs.capture_rounds` makes)."""
        generator = torch.Generator(self.device).manual_seed(0)
        first_token(self.prompt_logits, True, self.temperature, self.top_k, self.top_p, generator)
        self.draw_noise(generator)

    # ------------------------------------------------------------------------------------------ prefill
    def set_sampling(self, sampling: Sampling | list[Sampling], eos_token_ids=()) -> None:
        """The next request's settings, written into the round's tensors (before `prefill` or `resume`): `sampling`
        for every row, or one per row (rows beyond the list are not warped; all must agree on `do_sample`, which
        picks the round), and the EOS ids every row stops at (up to `MAX_EOS_TOKENS`)."""
        rows = [sampling] * self.batch if isinstance(sampling, Sampling) else list(sampling)
        if not 0 < len(rows) <= self.batch or len({row.do_sample for row in rows}) > 1:
            raise ValueError(f"set_sampling takes one Sampling, or 1 to {self.batch} that agree on do_sample; got "
                             f"{[row.do_sample for row in rows]}.")
        rows += [Sampling(rows[0].do_sample)] * (self.batch - len(rows))
        self.do_sample = rows[0].do_sample
        self.temperature.copy_(torch.tensor([row.temperature for row in rows], dtype=torch.float32))
        self.top_k.copy_(torch.tensor([row.top_k for row in rows], dtype=torch.long))
        self.top_p.copy_(torch.tensor([row.top_p for row in rows], dtype=torch.float64))
        self.eos.copy_(torch.tensor(padded_eos_ids(eos_token_ids), dtype=torch.long))

    @property
    def eos_token_ids(self) -> list[int]:
        """The EOS ids the current request stops at (`set_sampling`)."""
        return [token for token in self.eos.tolist() if token >= 0]

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask, max_new_tokens: int, generator=None, encode=None) -> None:
        """Encode left-padded prompts [b, P] into both caches and emit each row's first token.

        Three steps: `stage_prompt` (the prompt into fixed buffers, left-padded to `prefill_width`), `encode_prompt`
        (the target and drafter forwards: eager, or `encode()` when given, a replay of a graph captured from
        `encode_prompt(width)`), `start_decoding` (the first token and the round state)."""
        width, staged = self.stage_prompt(input_ids, attention_mask, max_new_tokens)
        if encode is not None and staged is self.prompt_ids:
            encode()
        else:
            self.encode_prompt(width, staged)
        self.start_decoding(width, max_new_tokens, generator)
        self.serial += 1

    @torch.no_grad()
    def resume(self, rows: list[list[int]], keep: list[int], max_new_tokens: int, generator=None) -> bool:
        """`prefill` for a later turn of the last request: rows[r] is row r's whole conversation (no padding), of which
        the buffers still hold the first keep[r] positions. Encodes only what follows, at least a block per row (each
        row's ids end at its own column; the re-encoded tail of what it holds gets the same keys and features), eagerly.
        Returns False, changing nothing, when the rows do not fit the buffers' columns (then `prefill` them anew)."""
        batch, device = self.batch, self.device
        lengths = [len(ids) for ids in rows]
        width = max([self.block_size] + [n - k for n, k in zip(lengths, keep)])
        first = self.first_column.tolist()
        shift = [f + n - width for f, n in zip(first, lengths)] + [0] * (batch - len(rows))  # empty rows: 0
        if min(shift) < 0 or max(shift) + width + max_new_tokens + self.round_columns > self.capacity:
            return False
        staged = torch.zeros(batch, width, dtype=torch.long, device=device)
        for row, ids in enumerate(rows):
            tail = ids[-width:]
            staged[row, width - len(tail):] = torch.tensor(tail, dtype=torch.long, device=device)
        self.first_column[len(rows):] = width  # an empty row: every column is padding
        shift = torch.tensor(shift, dtype=torch.long, device=device)
        self.encode_prompt(width, staged, shift)
        self.start_decoding(width, max_new_tokens, generator, shift)
        self.serial += 1
        return True

    def held_tokens(self, rows: list[list[int]]) -> list[list[int]]:
        """After decoding `rows` (each row's prompt, no padding): per row, the tokens of the positions whose keys and
        drafter context the buffers hold (all but the last block's drafter context; a frozen row's up to its end)."""
        batch = len(rows)
        held = torch.minimum(self.context_columns[:, 0], self.start) - self.first_column
        held = held.clamp(min=0)[:batch].tolist()
        lengths = self.output_length[:batch].tolist()
        return [(ids + emitted[:n])[:count]
                for ids, emitted, n, count in zip(rows, self.output[:batch].tolist(), lengths, held)]

    # ------------------------------------------------------------------------------------------ one row at a time
    def row_view(self, row: int) -> "RoundCore":
        """This core seen as a batch of one: row `row` of every per-row buffer and of both caches, as views. What the
        view's prefill and noise draw write lands in that row of this core's buffers (same storage, same addresses,
        so captured rounds read it); the other rows are not touched. The caches must exist (a first prefill or the
        runner's capture builds them)."""
        if any(keys is None for keys in self.target_cache.keys + self.draft_cache.keys):
            raise RuntimeError("row_view needs the caches built: prefill the whole batch once first.")
        view = copy.copy(self)
        view.batch = 1
        for name in ROW_BUFFERS:
            setattr(view, name, getattr(self, name)[row: row + 1])
        view.target_cache = self.target_cache.row_view(row)
        view.draft_cache = self.draft_cache.row_view(row)
        return view

    @torch.no_grad()
    def admit(self, row: int, input_ids: list[int], max_new_tokens: int, sampling: Sampling,
              generator: torch.Generator | None = None, keep: int = 0) -> bool:
        """Prefill one prompt (`input_ids`, no padding) into row `row` alone, with its own settings and token limit,
        while the other rows keep their state: the next round decodes it beside them. Eager (a batch of one), into
        the same fixed buffers the rounds read. The EOS ids stay the core's (`set_sampling`).
        `keep` > 0: the row still holds the first `keep` tokens of `input_ids` (an earlier turn decoded there: see
        `held_tokens` and `resume`), and only what follows is encoded when it fits. Returns whether it was."""
        view = self.row_view(row)
        view.do_sample = sampling.do_sample
        view.temperature.fill_(sampling.temperature)
        view.top_k.fill_(sampling.top_k)
        view.top_p.fill_(sampling.top_p)
        if keep > 0 and view.resume([list(input_ids)], [keep], max_new_tokens, generator):
            self.serial += 1
            return True
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        width, staged = view.stage_prompt(ids, torch.ones_like(ids), max_new_tokens)
        view.encode_prompt(width, staged)
        view.start_decoding(width, max_new_tokens, generator)
        self.serial += 1
        return False

    def copy_row(self, row: int, source: "RoundCore", source_row: int) -> None:
        """Row `source_row` of `source` (a core of the same pair and capacity, another batch size) into row `row`:
        its state, settings, output and both caches' columns, so that its next round here continues it exactly."""
        for name in ROW_BUFFERS:
            getattr(self, name)[row].copy_(getattr(source, name)[source_row])
        for mine, theirs in ((self.target_cache, source.target_cache), (self.draft_cache, source.draft_cache)):
            for buffer, other in zip(mine.keys + mine.values, theirs.keys + theirs.values):
                buffer[row].copy_(other[source_row])

    def prefill_width(self, length: int) -> int:
        """Columns the prompt is left-padded to: at least a block; with `bucketed_prefill`, the next prefill bucket."""
        return prefill_width(length, self.block_size, self.bucketed_prefill)

    def stage_prompt(self, input_ids, attention_mask, max_new_tokens: int):
        """The prompt left-padded to its prefill width, in the fixed staging buffer `prompt_ids` when it fits there
        (else in a tensor of its own); each row's first column set. Returns (width, the staged ids)."""
        batch, length = input_ids.shape
        width = self.prefill_width(length)
        if width + max_new_tokens + self.round_columns > self.capacity:
            raise ValueError(f"prompt ({length}) + max_new_tokens ({max_new_tokens}) + a round's columns does not fit the "
                             f"buffers' capacity {self.capacity}.")
        staged = self.prompt_ids if width <= self.prompt_ids.shape[1] else torch.zeros(
            batch, width, dtype=torch.long, device=self.device)
        staged[:, : width - length] = 0
        staged[:, width - length: width] = input_ids.to(self.device)
        self.first_column.copy_(width - attention_mask.to(self.device).long().sum(-1))
        return width, staged

    @torch.no_grad()
    def encode_prompt(self, width: int, staged: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> None:
        """The staged prompt's columns 0 .. width-1 through the target (in chunks) and into the drafter's context;
        writes `prompt_logits` [b, V] (the last column's) and `prompt_features` [b, B, taps*H] (the last block's).
        `shift` [b] (a later turn, `resume`): row r's staged column c goes to buffer column shift[r] + c.
        Reads and writes fixed buffers only, so one graph per width can be captured from it."""
        batch, first = self.batch, self.first_column.view(-1, 1)
        staged = self.prompt_ids if staged is None else staged
        recent = None  # features of the last block of columns, which may span two chunks
        for begin in range(0, width, PREFILL_CHUNK):
            columns = self.columns[begin: min(begin + PREFILL_CHUNK, width)].expand(batch, -1)
            if shift is not None:
                columns = columns + shift.view(-1, 1)
            self.target_cache.set_write_columns(columns)
            out = self.target(input_ids=staged[:, begin: begin + columns.shape[1]],
                              position_ids=(columns - first).clamp(min=0), attention_mask=self.target_masks(columns),
                              use_cache=True, output_hidden_states=True, logits_to_keep=1,
                              **{self.cache_keyword: self.target_cache})
            features = tap_target_features(out.hidden_states, self.layer_ids).to(self.device)
            self.store_context(features, columns)
            recent = features if recent is None else torch.cat([recent, features], dim=1)[:, -self.block_size:]
        self.prompt_logits.copy_(out.logits[:, -1])
        self.prompt_features.copy_(recent[:, -self.block_size:])

    def start_decoding(self, width: int, max_new_tokens: int, generator=None,
                       shift: torch.Tensor | None = None) -> None:
        """Each row's first token from the prompt's logits, and the state the first round starts from (`shift` as in
        `encode_prompt`)."""
        block, batch = self.block_size, self.batch
        token = first_token(self.prompt_logits, self.do_sample, self.temperature, self.top_k, self.top_p, generator)
        # the prompt's last block is stored again by the first round: same values, same columns
        self.context_columns.copy_(self.columns[width - block: width].expand(batch, -1))
        self.features.copy_(self.prompt_features)
        self.anchor.copy_(token)
        self.start.fill_(width)
        if shift is not None:
            self.context_columns.add_(shift.view(-1, 1))
            self.start.add_(shift)
        self.output[:, 0] = token
        self.output_length.fill_(1)
        self.max_new_tokens.fill_(max_new_tokens)
        self.done.copy_(is_any_of(token, self.eos) | (max_new_tokens <= 1))
        self.rounds.zero_()
        self.accepted_per_position.zero_()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one every attention implementation reads the same way: 0 where allowed, the
    dtype's lowest value elsewhere. transformers' eager attention adds the mask to the scores (a boolean mask would
    hide nothing there), and SDPA converts a boolean mask again in every layer."""
    return (~allowed).to(dtype) * torch.finfo(dtype).min


def check_tree_nodes(tree_nodes: int, config) -> None:
    """One clear error for a tree size the drafter cannot draft."""
    problem = tree_nodes_problem(tree_nodes, config)
    if problem:
        raise ValueError(problem)


def check_target_fits(target) -> None:
    """One clear error for targets whose layers the fixed-buffer loops cannot drive."""
    text = target.config.get_text_config()
    implementation = getattr(target.config, "_attn_implementation", None)
    if implementation not in (None, "sdpa", "eager"):
        raise ValueError(f"DFlash 2's own loops pass the target explicit boolean masks, which attn_implementation="
                         f"'{implementation}' does not take. Load the target with attn_implementation='sdpa', or "
                         "use transformers' assisted loop (one prompt, loop='transformers').")
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    unsupported = sorted(layer_types - {"full_attention", "sliding_attention"})
    if unsupported:
        if assisted_loop_rolls_state_back():
            advice = ("transformers' assisted loop (this version rolls such state back) takes it: pass "
                      "one prompt with loop='transformers', or decode without assistant_model.")
        else:
            advice = ("this version of transformers' assisted generation refuses such stateful models too: decode "
                      "this one without assistant_model.")
        raise ValueError(f"The target has {unsupported} layers, whose state DFlash 2's own loops cannot roll back "
                         f"to a verified position (they need attention-only targets); {advice}")
