"""Batched DFlash 2 (batch > 1 through `generate`): each row equals plain greedy of that row alone; exact sampling."""

import random

import pytest
import torch

from generation.batched import BatchedDFlash2Decoder
from helpers import EOS, VOCAB, assert_follows, exact_distribution_of_step, sampling_case, tiny_drafter, tiny_target


def left_pad(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def alone(target, prompt, **kwargs):
    """Plain greedy of one row on its own: the new tokens only."""
    ids = torch.tensor([prompt])
    return target.generate(ids, do_sample=False, **kwargs)[0, len(prompt):].tolist()


def new_tokens(row_output, width, pad, eos):
    tokens = row_output[width:].tolist()
    if eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    while tokens and tokens[-1] == pad:  # padding after a row that stopped at max_new_tokens never happens
        break
    return tokens


@pytest.fixture
def batch_oracle(monkeypatch):
    """Overwrite a random prefix of each row's drafts with that row's reference continuation."""
    state = {"references": None, "rng": random.Random(0)}
    original = BatchedDFlash2Decoder.draft_block

    def draft_block(self, anchor, start, features, write_slots, write_valid):
        hidden = original(self, anchor, start, features, write_slots, write_valid)
        propose = type(self.drafter).propose.__get__(self.drafter)
        starts, rows = start.tolist(), list(self.live_rows)

        def patched(anchor_ids, block_hidden, **kwargs):
            proposal = propose(anchor_ids, block_hidden, **kwargs)
            if state["references"] is None:
                return proposal
            tokens = proposal.tokens.clone()
            for live, row in enumerate(rows):
                reference = state["references"][row]
                begin = starts[live] + 1
                right = state["rng"].randint(0, tokens.shape[1])
                usable = max(0, min(right, len(reference) - begin))
                tokens[live, :usable] = torch.tensor(reference[begin: begin + usable], dtype=torch.long)
            proposal.tokens = tokens
            return proposal

        self.drafter.propose = patched
        return hidden

    monkeypatch.setattr(BatchedDFlash2Decoder, "draft_block", draft_block)
    return state


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [2, 5, 8])
def test_batched_greedy_rows_equal_plain_greedy_alone(arch, batch, batch_oracle):
    target = tiny_target(arch, seed=batch)
    drafter = tiny_drafter(target, seed=batch, block_size=[4, 8][batch % 2]).attach(target)
    rng = random.Random(batch)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(batch)]
    max_new = rng.choice([9, 17, 24])
    references = [alone(target, p, max_new_tokens=max_new) for p in prompts]
    batch_oracle["references"] = [p + r for p, r in zip(prompts, references)]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          assistant_model=drafter)
    for row in range(batch):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row], row
    stats = drafter.last_stats
    assert stats.target_forwards < batch * max_new  # one verification per step for the whole batch
    assert stats.accepted_per_position[0] > 0


def test_batched_rows_stop_at_their_own_eos(batch_oracle):
    target = tiny_target("llama", seed=9)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    prompts = [[5, 9, 14], [20, 7, 31, 40, 41], [8]]
    free = [alone(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    eos = free[1][3]  # a token the second row emits early
    references = [alone(target, p, max_new_tokens=20, eos_token_id=eos) for p in prompts]
    batch_oracle["references"] = [p + f for p, f in zip(prompts, free)]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, assistant_model=drafter)
    for row in range(3):
        got = out[row, ids.shape[1]:].tolist()
        assert got[: len(references[row])] == references[row]
        assert all(t == 0 for t in got[len(references[row]):])  # padded after its end


def test_right_padding_is_refused_clearly():
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="left-padded"):
        target.generate(torch.tensor([[5, 6, 0], [7, 8, 9]]), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
                        max_new_tokens=4, assistant_model=drafter)


def test_batched_sampling_keeps_each_rows_distribution():
    """Two identical rows in one batch: each row's second token follows the target's distribution."""
    draws = 500
    target, drafter = sampling_case()
    prompt = [5, 6, 7]
    ids, mask = left_pad([prompt, prompt, prompt[1:]])
    generation = dict(do_sample=True, top_k=0, temperature=0.8, max_new_tokens=3, eos_token_id=None)
    processors = target._get_logits_processor(target.generation_config.__class__(**generation), 3)
    torch.manual_seed(0)
    counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    for _ in range(draws):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **generation)
        for row in (0, 1):
            counts[out[row, ids.shape[1] + 1]] += 1
    assert_follows(counts, exact_distribution_of_step(target, torch.tensor([prompt]), 1, processors) * 2 * draws)


def test_batched_through_custom_generate(tmp_path):
    target = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(target, seed=4)
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = [[5, 9, 14, 3 + 20], [7, 31]]
    references = [alone(target, p, max_new_tokens=12) for p in prompts]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          custom_generate=str(tmp_path / "drafter"), trust_remote_code=True)
    for row in range(2):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row]
    assert target._dflash2_drafter.last_stats.target_forwards > 0


def test_batches_above_the_speculative_limit_fall_back_with_a_warning():
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, max_speculative_batch_size=2).attach(target)
    prompts = [[5, 9, 14], [20, 7], [8, 8, 8, 8]]
    references = [alone(target, p, max_new_tokens=10) for p in prompts]
    ids, mask = left_pad(prompts)
    drafter.last_stats = None
    with pytest.warns(UserWarning, match="max_speculative_batch_size=2"):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant_model=drafter)
    assert drafter.last_stats is None  # the drafter did not run
    for row in range(3):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row]
    with pytest.raises(ValueError, match="max_speculative_batch_size"):
        tiny_drafter(target, max_speculative_batch_size=0)
