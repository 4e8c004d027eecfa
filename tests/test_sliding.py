"""Sliding-window drafter layers in every loop, against a naive reference.

Published semantics: a top-level `is_causal` decides causality when present; without it a `sliding_attention` layer is
causal and a `full_attention` layer is not. With window W, a query at absolute position p sees the keys whose position k
has |p - k| < W.

The reference recomputes every drafted block from scratch: the target's features of the whole verified context from
one fresh forward, and one drafter forward over [context; block] without any cache, under masks built position by
position in plain Python from the config fields. Each loop's block hidden states must equal it, round after round, and
each loop's output must equal plain greedy (fp32).
"""

import random

import pytest
import torch

from dflash2.generation import DFlash2CandidateGenerator
from dflash2.generation.round_core import RoundCore
from dflash2.modeling_dflash2 import tap_target_features
from helpers import VOCAB, tiny_drafter, tiny_target

# (layer_types, window, is_causal, block_size): mixed and uniform types, every causality rule, windows smaller than
# the context (prompts of 6-12 tokens, 20 new), one window smaller than the block.
CASES = [
    (["sliding_attention", "full_attention", "sliding_attention"], 3, None, 4),
    (["sliding_attention", "sliding_attention"], 5, False, 4),  # the published DFlash 2 rule (is_causal false)
    (["full_attention", "sliding_attention"], 4, True, 4),
    (["sliding_attention", "full_attention"], 3, False, 6),
]
IDS = ["mixed-W3-default", "sliding-W5-noncausal", "mixed-W4-causal", "mixed-W3-block6"]
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def make_case(layer_types, window, is_causal, block_size, seed=0):
    target = tiny_target("qwen3", seed=seed)
    drafter = tiny_drafter(target, seed=seed + 1, num_hidden_layers=len(layer_types), layer_types=layer_types,
                           sliding_window=window, is_causal=is_causal, block_size=block_size)
    return target, drafter.attach(target)


# ------------------------------------------------------------------------------------------------ the reference
def naive_masks(config, num_context: int):
    """Per layer type: which of the keys (context positions 0..C-1, then the block at C..C+B-1) each block row sees,
    decided one (query, key) pair at a time from the config fields."""
    masks = {}
    for kind in set(config.layer_types):
        causal = config.is_causal if config.is_causal is not None else kind == "sliding_attention"
        window = config.sliding_window if kind == "sliding_attention" else None
        rows = []
        for row in range(config.block_size):
            query = num_context + row
            rows.append([(not causal or key <= query) and (window is None or abs(query - key) < window)
                         for key in range(num_context + config.block_size)])
        masks[kind] = torch.tensor(rows)[None, None]
    return masks


@torch.no_grad()
def naive_block_hidden(target, drafter, tokens, start):
    """The block [tokens[start], MASK...] at position `start` with the verified context tokens[:start], from scratch."""
    config = drafter.config
    context = torch.tensor([tokens[:start]])
    features = tap_target_features(target(context, output_hidden_states=True).hidden_states, config.target_layer_ids)
    block = torch.tensor([[tokens[start]] + [config.mask_token_id] * (config.block_size - 1)])
    return drafter(noise_embeds=drafter.embed_block(block), context_hidden_states=features,
                   position_ids=torch.arange(start + config.block_size)[None],
                   attention_mask=naive_masks(config, start)).last_hidden_state[0]


def check_against_reference(target, drafter, records, sequences):
    """records: (row, start, hidden [B, H]) of every drafted block; sequences: each row's final tokens."""
    starts = set()
    for row, start, hidden in records:
        torch.testing.assert_close(hidden, naive_block_hidden(target, drafter, sequences[row], start), **TOLERANCE,
                                   msg=lambda m: f"row {row}, block at {start}: {m}")
        starts.add(start)
    window = drafter.config.sliding_window
    assert max(starts) > window + drafter.config.block_size, "no block had a context longer than the window"
    return starts


def plain_new_tokens(target, prompt, max_new):
    ids = torch.tensor([prompt])
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                           eos_token_id=None)[0, len(prompt):].tolist()


def prompts_for(seed, count):
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(6, 12))] for _ in range(count)]


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def oracle_tokens(drafts, emitted: int, reference, rng):
    """Overwrite a random-length prefix of one row's drafts with its true continuation, so rounds accept 0 .. B-1."""
    usable = max(0, min(rng.randint(0, drafts.shape[0]), len(reference) - emitted))
    drafts[:usable] = torch.tensor(reference[emitted: emitted + usable])
    return drafts


@pytest.fixture
def round_core_oracle(monkeypatch):
    """Record every RoundCore.draft_block (row, start, hidden) of live rows and make drafts partly right."""
    state = {"records": [], "references": None, "rng": random.Random(0)}
    draft_block, propose = RoundCore.draft_block, RoundCore.propose

    def recording_draft_block(self):
        hidden = draft_block(self)
        starts = (self.start - self.first_column).tolist()
        for row, done in enumerate(self.done.tolist()[: len(state["references"] or [])]):
            if not done:
                state["records"].append((row, starts[row], hidden[row].clone()))
        return hidden

    def oracle_propose(self, hidden):
        proposal = propose(self, hidden)
        tokens = proposal.tokens.clone()
        for row, emitted in enumerate(self.output_length.tolist()[: len(state["references"])]):
            oracle_tokens(tokens[row], emitted, state["references"][row], state["rng"])
        proposal.tokens = tokens
        return proposal

    monkeypatch.setattr(RoundCore, "draft_block", recording_draft_block)
    monkeypatch.setattr(RoundCore, "propose", oracle_propose)
    return state


# ------------------------------------------------------------------------------------------------ (a) the round core
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_round_core_blocks_equal_naive_reference(case, round_core_oracle):
    """RoundCore.draft_block after a left-padded prefill of rows of different lengths, round after round."""
    target, drafter = make_case(*case)
    prompts = prompts_for(1, 3)
    max_new = 20
    round_core_oracle["references"] = [plain_new_tokens(target, p, max_new) for p in prompts]
    ids, mask = left_pad(prompts)
    core = RoundCore(target, drafter, batch=3, capacity=64)  # greedy, no EOS: its initial settings
    core.prefill(ids, mask, max_new)
    while not bool(core.done.all()):
        core.round()
    lengths = core.output_length.tolist()
    sequences = [p + core.output[row, :lengths[row]].tolist() for row, p in enumerate(prompts)]
    for row, prompt in enumerate(prompts):  # lossless on the way
        assert sequences[row][len(prompt):][:max_new] == round_core_oracle["references"][row]
    check_against_reference(target, drafter, round_core_oracle["records"], sequences)
    assert int(core.accepted_per_position.sum()) > 0, "no draft accepted: context never grew by a whole block"


def test_reference_is_sensitive_to_the_window_and_the_causal_rule(round_core_oracle):
    """The reference would catch an off-by-one window or a wrong causality: the round core's blocks differ from it."""
    target, drafter = make_case(*CASES[0])
    prompt = prompts_for(2, 1)[0]
    round_core_oracle["references"] = [plain_new_tokens(target, prompt, 8)]
    ids = torch.tensor([prompt])
    core = RoundCore(target, drafter, batch=1, capacity=64)  # greedy, no EOS: its initial settings
    core.prefill(ids, torch.ones_like(ids), 8)
    core.round()
    row, start, hidden = round_core_oracle["records"][-1]
    tokens = prompt + core.output[0, : int(core.output_length[0])].tolist()
    for change in (dict(sliding_window=2), dict(sliding_window=4), dict(is_causal=False), dict(is_causal=True)):
        original = {name: getattr(drafter.config, name) for name in change}
        for name, value in change.items():
            setattr(drafter.config, name, value)
        try:
            wrong = naive_block_hidden(target, drafter, tokens, start)
        finally:
            for name, value in original.items():
                setattr(drafter.config, name, value)
        assert (hidden - wrong).abs().max() > 1e-2, change
    torch.testing.assert_close(hidden, naive_block_hidden(target, drafter, tokens, start), **TOLERANCE)


# ------------------------------------------------------------------------------------------------ (b) every loop
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_static_loop_equals_plain_greedy_and_reference(case, round_core_oracle):
    target, drafter = make_case(*case, seed=3)
    prompt = prompts_for(3, 1)[0]
    reference = plain_new_tokens(target, prompt, 20)
    round_core_oracle["references"] = [reference]
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                          max_new_tokens=20, eos_token_id=None, cache_implementation="static")
    assert out[0, len(prompt):].tolist() == reference
    check_against_reference(target, drafter, round_core_oracle["records"], [prompt + reference])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_batched_loop_equals_plain_greedy_and_reference(case, round_core_oracle):
    target, drafter = make_case(*case, seed=4)
    prompts = prompts_for(4, 3)
    references = [plain_new_tokens(target, p, 20) for p in prompts]
    round_core_oracle["references"] = references
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=20,
                          eos_token_id=None, pad_token_id=0)
    for row in range(len(prompts)):
        assert out[row, ids.shape[1]:].tolist() == references[row], row
    check_against_reference(target, drafter, round_core_oracle["records"],
                            [p + r for p, r in zip(prompts, references)])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_assisted_loop_equals_plain_greedy_and_reference(case, monkeypatch):
    """transformers' assisted loop with our candidate generator (the drafter side of the own loop's buffers)."""
    target, drafter = make_case(*case, seed=5)
    prompt = prompts_for(5, 1)[0]
    reference = plain_new_tokens(target, prompt, 20)
    records, rng = [], random.Random(0)
    draft_block, get_candidates = DFlash2CandidateGenerator.draft_block, DFlash2CandidateGenerator.get_candidates

    def recording_draft_block(self, anchor_ids, features):
        hidden = draft_block(self, anchor_ids, features)
        records.append((0, self.context.length, hidden[0].clone()))
        return hidden

    def oracle_get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = get_candidates(self, input_ids, *args, **kwargs)
        drafts = oracle_tokens(candidates[0, input_ids.shape[1]:].clone(), input_ids.shape[1] - len(prompt),
                               reference, rng)
        return torch.cat([input_ids, drafts[None]], dim=1), logits

    monkeypatch.setattr(DFlash2CandidateGenerator, "draft_block", recording_draft_block)
    monkeypatch.setattr(DFlash2CandidateGenerator, "get_candidates", oracle_get_candidates)
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                          max_new_tokens=20, eos_token_id=None, loop="transformers")
    assert out[0, len(prompt):].tolist() == reference
    assert drafter.last_stats.accepted_per_position[0] > 0 and drafter.last_stats.draft_step == "eager"
    check_against_reference(target, drafter, records, [prompt + reference])


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_builtin_dflash_loop_equals_plain_greedy_and_reference(case, monkeypatch):
    """transformers' own `speculation_type="dflash"` loop builds its draft cache from the drafter's config, whose
    sliding layers keep only the last window - 1 keys; the drafter's masks must follow that layout."""
    target, drafter = make_case(*case, seed=6)
    prompt = prompts_for(6, 1)[0]
    reference = plain_new_tokens(target, prompt, 20)
    records, forward = [], type(drafter).forward

    def recording_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:  # the loop's calls, not the reference's
            records.append((0, int(kwargs["position_ids"][0, -self.config.block_size]),
                            out.last_hidden_state[0].clone()))
        return out

    monkeypatch.setattr(type(drafter), "forward", recording_forward)
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                          max_new_tokens=20, eos_token_id=None, speculation_type="dflash")
    assert out[0, len(prompt):].tolist() == reference
    check_against_reference(target, drafter, records, [prompt + reference])


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_training_blocks_see_what_inference_blocks_see(case):
    """Training packs many blocks in one forward under a 4-D block mask; each layer type's causal / window rule must
    apply on top of it, so every training block equals the reference block at its anchor."""
    from dflash2.training.trainer import denoise_blocks

    target, drafter = make_case(*case, seed=7)
    tokens = prompts_for(7, 1)[0] + prompts_for(8, 1)[0] + prompts_for(9, 1)[0]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        features = tap_target_features(target(ids, output_hidden_states=True).hidden_states,
                                       drafter.config.target_layer_ids)
        anchors = torch.tensor([[2, drafter.config.sliding_window + 3, len(tokens) - drafter.config.block_size]])
        hidden, _ = denoise_blocks(drafter, features, ids, anchors)
    for n, anchor in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(hidden[0, n], naive_block_hidden(target, drafter, tokens, anchor), **TOLERANCE)
