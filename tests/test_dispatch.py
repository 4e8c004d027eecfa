"""Which loop `target.generate(..., assistant_model=drafter)` takes for one prompt, and that each choice is exact.

One prompt runs DFlash 2's own loop wherever it honours the call; anything it does not honour goes to transformers'
assisted loop by itself; `loop=` chooses explicitly."""

import random

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import MaxLengthCriteria, MinLengthLogitsProcessor

from helpers import EOS, VOCAB, tiny_drafter, tiny_target


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("seed", range(6))
def test_one_prompt_with_default_kwargs_runs_the_own_loop_and_equals_plain_greedy(seed):
    rng = random.Random(seed)
    target = tiny_target(("llama", "qwen3")[seed % 2], seed=seed)
    drafter = tiny_drafter(target, seed=seed + 20, block_size=rng.choice([4, 6, 8]),
                           tree_nodes=rng.choice([0, 4, 8])).attach(target)
    for case in range(3):
        ids = torch.randint(4, VOCAB, (1, rng.randint(1, 12)), generator=torch.Generator().manual_seed(100 * seed + case))
        max_new = rng.randint(1, 40)
        reference = greedy(target, ids, max_new_tokens=max_new)
        out = target.generate(ids, max_new_tokens=max_new, assistant_model=drafter)
        assert torch.equal(out, reference), (seed, case)
        assert drafter.last_stats.loop == "dflash2" and drafter.last_stats.loop_reason is None


def test_a_sampling_call_runs_the_own_loop():
    target = tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, seed=2).attach(target)
    target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9,
                    top_k=20, assistant_model=drafter)
    assert drafter.last_stats.loop == "dflash2"


class AddToToken(torch.nn.Module):
    """A logits processor the own loop cannot apply: favours one token."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 7] += 5.0
        return scores


FALLBACKS = {
    "repetition penalty": (dict(repetition_penalty=1.3), "repetition_penalty"),
    "no repeated n-grams": (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    "min_new_tokens": (dict(min_new_tokens=6, eos_token_id=EOS), "min_new_tokens"),
    "output scores": (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    "a logits processor": (dict(logits_processor=LogitsProcessorList([AddToToken()])), "logits_processor"),
    "a stopping criterion": (dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(14)])),
                             "stopping_criteria"),
    "loop='transformers'": (dict(loop="transformers"), "loop='transformers'"),
    "speculation_type='dflash'": (dict(speculation_type="dflash"), "speculation_type='dflash'"),
    "more EOS ids than the own loop stops at": (dict(eos_token_id=list(range(20, 40))), "20 EOS ids"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_what_the_own_loop_does_not_honour_runs_transformers_loop_exactly(name):
    kwargs, reason = FALLBACKS[name]
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, seed=4).attach(target)
    ids = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in ("loop", "speculation_type")}
    reference = greedy(target, ids, max_new_tokens=20, **plain_kwargs)
    out = greedy(target, ids, max_new_tokens=20, assistant_model=drafter, **kwargs)
    if kwargs.get("return_dict_in_generate"):
        assert len(out.scores) == out.sequences.shape[1] - ids.shape[1]  # transformers' loop returns them
        out, reference = out.sequences, reference.sequences
    assert torch.equal(out, reference)
    assert drafter.last_stats.loop == "transformers"
    assert reason in drafter.last_stats.loop_reason


def test_a_setting_of_the_models_generation_config_is_honoured_too():
    """A repetition penalty in the target's own generation config (as Hub models ship them) is not dropped."""
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, seed=6).attach(target)
    target.generation_config.repetition_penalty = 1.5
    ids = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(5))
    reference = greedy(target, ids, max_new_tokens=20, assistant_model=None)
    assert not torch.equal(reference, greedy(target, ids, max_new_tokens=20, repetition_penalty=1.0))
    assert torch.equal(greedy(target, ids, max_new_tokens=20, assistant_model=drafter), reference)
    assert drafter.last_stats.loop == "transformers" and "repetition_penalty" in drafter.last_stats.loop_reason


def test_loop_dflash2_refuses_what_it_cannot_honour():
    target = tiny_target("llama", seed=7)
    drafter = tiny_drafter(target, seed=8).attach(target)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="repetition_penalty.*loop='transformers'"):
        greedy(target, ids, max_new_tokens=5, assistant_model=drafter, loop="dflash2", repetition_penalty=1.2)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(3, EOS)])
    with pytest.raises(ValueError, match="logits_processor.*loop='transformers'"):
        greedy(target, ids, max_new_tokens=5, assistant_model=drafter, loop="dflash2", logits_processor=processors)


def test_loop_values_are_checked():
    target = tiny_target("llama", seed=9)
    drafter = tiny_drafter(target, seed=10).attach(target)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="loop='fast'.*'dflash2'.*'transformers'"):
        greedy(target, ids, max_new_tokens=5, assistant_model=drafter, loop="fast")
    with pytest.raises(ValueError, match="loop= needs a DFlash 2 drafter"):
        greedy(target, ids, max_new_tokens=5, loop="transformers")
    with pytest.raises(ValueError, match="tree_nodes=4: tree verification runs in DFlash 2's own loop.*loop='trans"):
        greedy(target, ids, max_new_tokens=5, assistant_model=drafter, loop="transformers", tree_nodes=4)


def test_a_conversation_continues_in_the_own_loop_by_default():
    """The cache a default call returns is the own loop's, and the next turn passes it back exactly."""
    target = tiny_target("llama", seed=11)
    drafter = tiny_drafter(target, seed=12).attach(target)
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(11))
    first = greedy(target, ids, max_new_tokens=12, assistant_model=drafter, return_dict_in_generate=True)
    follow_up = torch.cat([first.sequences, torch.tensor([[8, 9, 10]])], dim=1)
    reference = greedy(target, follow_up, max_new_tokens=12)
    cache = first.cache if hasattr(first, "cache") and first.cache is not None else first.past_key_values
    second = greedy(target, follow_up, max_new_tokens=12, assistant_model=drafter, return_dict_in_generate=True,
                    **{"cache" if hasattr(first, "cache") else "past_key_values": cache})
    assert torch.equal(second.sequences, reference)
    assert drafter.last_stats.loop == "dflash2"
