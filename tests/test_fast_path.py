"""The static-shape loop (`cache_implementation="static"`): lossless greedy, exact sampling, pieces vs naive loops."""

import random

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from generation.fast_path import Sampling, StaticDFlash2Decoder, speculative_accept, warped_probabilities
from helpers import VOCAB, check_sampling_is_exact, tiny_drafter, tiny_target


@pytest.fixture
def fast_oracle(monkeypatch):
    """Overwrite a random-length prefix of each round's drafts with the reference continuation."""
    state = {"reference": None, "start": None, "rng": random.Random(0)}
    original_draft_block = StaticDFlash2Decoder.draft_block

    def draft_block(self, anchor, start, features, write_positions):
        state["start"] = int(start)
        hidden = original_draft_block(self, anchor, start, features, write_positions)
        original_propose = type(self.drafter).propose.__get__(self.drafter)  # not an earlier patch

        def propose(anchor_ids, block_hidden, **kwargs):
            proposal = original_propose(anchor_ids, block_hidden, **kwargs)
            reference = state["reference"]
            if reference is not None:
                begin = state["start"] + 1
                right = state["rng"].randint(0, proposal.tokens.shape[1])
                usable = max(0, min(right, reference.shape[1] - begin))
                proposal.tokens = proposal.tokens.clone()
                proposal.tokens[:, :usable] = reference[:, begin: begin + usable]
            return proposal

        self.drafter.propose = propose
        return hidden

    monkeypatch.setattr(StaticDFlash2Decoder, "draft_block", draft_block)
    return state


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", range(3))
def test_static_greedy_equals_plain_greedy(arch, seed, fast_oracle):
    target = tiny_target(arch, seed=seed)
    drafter = tiny_drafter(target, seed=seed + 20, block_size=[4, 5, 8][seed]).attach(target)
    rng = random.Random(seed)
    for case in range(4):
        ids = torch.randint(4, VOCAB, (1, rng.randint(1, 10)), generator=torch.Generator().manual_seed(case))
        max_new = rng.choice([1, 3, 11, 26])
        reference = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        fast_oracle["reference"] = reference
        fast = target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=drafter,
                               cache_implementation="static")
        assert torch.equal(fast, reference), (case, max_new)
    assert drafter.last_stats.target_forwards <= drafter.last_stats.completion_tokens


def test_static_loop_accepts_long_prefixes(fast_oracle):
    target = tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    fast_oracle["reference"] = reference
    fast = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                           cache_implementation="static")
    assert torch.equal(fast, reference)
    assert drafter.last_stats.acceptance_length > 2.0


def test_static_greedy_stops_at_eos(fast_oracle):
    target = tiny_target("qwen3", seed=3)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    free_run = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = free_run[0, 5 + 2].item()
    reference = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    fast_oracle["reference"] = free_run
    fast = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=drafter,
                           cache_implementation="static")
    assert torch.equal(fast, reference)


def test_static_path_refuses_processors_it_cannot_apply():
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="temperature, top_k and top_p only"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=4, repetition_penalty=1.2, assistant_model=drafter,
                        cache_implementation="static")


def test_static_path_refuses_a_mask_that_hides_prompt_tokens():
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="hides some prompt tokens"):
        target.generate(torch.tensor([[0, 5, 6]]), attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=4,
                        assistant_model=drafter, cache_implementation="static")


def test_static_path_attends_to_pad_tokens_inside_the_prompt(fast_oracle):
    """A chat template's end-of-turn token is often the pad token: with an explicit all-ones mask, plain decoding
    attends to it, and so must the static loop (which never infers a mask from token values)."""
    target = tiny_target("llama", seed=4)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    pad = 3
    ids = torch.tensor([[7, 9, pad, 11, 12, pad, 15]])
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=pad, eos_token_id=None)
    fast_oracle["reference"] = reference
    for mask in (None, torch.ones_like(ids)):
        fast = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=pad,
                               eos_token_id=None, assistant_model=drafter, cache_implementation="static")
        assert torch.equal(fast, reference)


# ------------------------------------------------------------------------------------------------ sampling pieces
@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(temperature=1.3,
                                                                                                  top_k=9, top_p=0.9)])
def test_warped_probabilities_match_transformers_warpers(settings):
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    warpers = LogitsProcessorList()
    if "temperature" in settings:
        warpers.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    want = warpers(None, logits.clone()).softmax(-1)
    got = warped_probabilities(logits, Sampling(True, settings.get("temperature", 1.0), settings.get("top_k", 0),
                                                settings.get("top_p", 1.0)))
    torch.testing.assert_close(got, want)


def naive_speculative_accept(drafts, q, p, uniform, gumbel):
    """One position at a time, as the algorithm is written in the papers."""
    for t in range(len(drafts)):
        token = drafts[t]
        if uniform[t] * q[t, token] < p[t, token]:
            continue
        residual = (p[t] - q[t]).clamp(min=0)
        residual = p[t] if residual.sum() <= 0 else residual
        return t, int((residual.log() + gumbel).argmax())
    return len(drafts), int((p[len(drafts)].log() + gumbel).argmax())


def test_speculative_accept_matches_naive_loop():
    torch.manual_seed(4)
    for _ in range(200):
        rows, vocab = 5, 9
        q = torch.randn(1, rows, vocab).mul(2).softmax(-1)
        p = torch.randn(1, rows + 1, vocab).mul(2).softmax(-1)
        drafts = torch.multinomial(q[0], 1).view(1, rows)
        uniform = torch.rand(1, rows)
        gumbel = -torch.log(-torch.log(torch.rand(1, vocab)))
        accepted, next_token = speculative_accept(drafts, q, p, uniform, gumbel)
        want = naive_speculative_accept(drafts[0], q[0], p[0], uniform[0], gumbel[0])
        assert (int(accepted), int(next_token)) == want


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.85)])
def test_static_sampling_reproduces_the_target_distribution(settings):
    check_sampling_is_exact(settings, draws=1200, cache_implementation="static")
