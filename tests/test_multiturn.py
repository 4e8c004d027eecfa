"""Multi-turn conversations with the cache of the last turn passed back: lossless in every loop, and a follow-up turn
encodes only its new tokens (plus at most a block and two tokens the drafter re-reads)."""

import copy
from pathlib import Path

import pytest
import torch
from helpers import EOS, assert_follows, sampling_case, sliding_qwen3, tiny_drafter, tiny_target

from dflash2.modeling_dflash2 import CACHE_NAME
from dflash2.tasks import left_padded

ROOT = Path(__file__).resolve().parents[1]
TURNS = {"assisted": {"loop": "transformers"}, "static": {"cache_implementation": "static"}}
NEW_TOKENS = 10


def user_turns(batch: int, seed: int = 1):
    """Three user turns per row (random ids, no EOS): 12 prompt tokens, then rows of unequal lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(4, 90, (n + row,), generator=generator).tolist() for row in range(batch)]
            for n in (12, 5, 3)]


class ForwardWidths:
    """Widths (input ids per row) of the target's forwards while inside."""

    def __init__(self, target):
        self.target, self.widths = target, []

    def __enter__(self):
        self.handle = self.target.register_forward_pre_hook(
            lambda module, args, kwargs: self.widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def repeat_anchor_drafts(drafter):
    """Replace the drafts by the anchor repeated: the tiny targets often repeat a token, so rounds accept 0 .. B-1
    drafts (a random drafter's own drafts are never accepted). The drafter still drafts from its context."""
    original = drafter.propose

    def propose(anchor, hidden, *args, **kwargs):
        proposal = original(anchor, hidden, *args, **kwargs)
        proposal.tokens = anchor.view(-1, 1).expand_as(proposal.tokens).clone()
        return proposal

    drafter.propose = propose
    return drafter


def recorded_drafts(drafter):
    """Record the denoised block of every drafting round (what the drafter's context decides) in `drafter.blocks`."""
    original, drafter.blocks = drafter.propose, []

    def propose(anchor, hidden, *args, **kwargs):
        drafter.blocks.append(hidden.clone())
        return original(anchor, hidden, *args, **kwargs)

    drafter.propose = propose
    return drafter


def plain_greedy(target, row: list[int]) -> list[int]:
    ids = torch.tensor([row])
    return target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)[0, len(row):].tolist()


def converse(target, drafter, batch: int, **settings):
    """Three turns, each passing the last turn's cache back with the whole conversation. Checks each row's new tokens
    against plain greedy on the whole conversation; returns each turn's prefill width and the conversation lengths."""
    conversations = [[] for _ in range(batch)]
    cache, prefills, lengths, accepted = None, [], [], 0
    for turn in user_turns(batch):
        conversations = [c + t for c, t in zip(conversations, turn)]
        ids, mask = left_padded(conversations, 0)
        extra = {} if cache is None else {"past_key_values": cache}
        with ForwardWidths(target) as forwards:
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=NEW_TOKENS,
                                  do_sample=False, eos_token_id=None, return_dict_in_generate=True, **extra, **settings)
        for row in range(batch):
            new = out.sequences[row, ids.shape[1]:].tolist()
            assert new == plain_greedy(target, conversations[row]), (row, len(lengths))
            conversations[row] = conversations[row] + new
        prefills.append(forwards.widths[0])
        lengths.append(ids.shape[1])
        accepted += sum(drafter.last_stats.accepted_per_position)
        cache = out.past_key_values
    assert accepted > 0, "no draft was accepted: the turns would not test verification"
    return prefills, lengths


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("loop,batch", [("assisted", 1), ("static", 1), ("static", 2)])
def test_three_turns_equal_plain_greedy_and_encode_only_new_tokens(arch, loop, batch):
    target = tiny_target(arch)
    drafter = repeat_anchor_drafts(tiny_drafter(target).attach(target))
    prefills, lengths = converse(target, drafter, batch, **TURNS[loop])
    block = drafter.config.block_size
    assert prefills[0] == lengths[0]
    for turn in (1, 2):
        # the new user tokens (5 or 3, +1 in row 1), the last answer's final token (never in the target cache) and the
        # tail whose hidden states the drafter had not read yet: the last verified block and the last round's token
        new_user_tokens = (5, 3)[turn - 1] + batch - 1
        assert new_user_tokens < prefills[turn] <= new_user_tokens + block + 2, (prefills, lengths)


@pytest.mark.parametrize("loop", ["assisted", "static"])
def test_sliding_window_target_past_its_window_stays_exact(loop):
    """A target whose sliding layers dropped their oldest keys (window 8): its cache cannot be cropped back, the turn
    encodes from where it ends and the drafter skips the few positions it lacks."""
    target = sliding_qwen3(96, 0)
    drafter = repeat_anchor_drafts(tiny_drafter(target).attach(target))
    prefills, lengths = converse(target, drafter, 1, **TURNS[loop])
    assert prefills[1] < lengths[1] - lengths[0] and prefills[2] < lengths[2] - lengths[1]


def test_continued_drafter_context_drafts_as_a_fresh_one():
    """The drafter's context continues exactly: every block a follow-up turn denoises equals the one the same turn
    from scratch denoises (same context features at the same positions)."""
    target = tiny_target("llama")
    drafter = recorded_drafts(tiny_drafter(target).attach(target))
    ids = torch.tensor([user_turns(1)[0][0]])
    first = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, return_dict_in_generate=True)
    conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9, 10, 11]])], dim=1)
    settings = dict(assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
    drafter.blocks.clear()
    continued = target.generate(conversation, past_key_values=first.past_key_values, **settings)
    continued_blocks, drafter.blocks = drafter.blocks, []
    fresh = target.generate(conversation, **settings)
    assert torch.equal(continued, fresh)
    assert len(continued_blocks) == len(drafter.blocks) > 3
    for ours, reference in zip(continued_blocks, drafter.blocks):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loop", ["assisted", "static"])
@pytest.mark.parametrize("filled_by", ["plain generate", "another model"])
def test_a_cache_the_drafter_did_not_fill_is_encoded_again(loop, filled_by):
    """plain generate's cache, or another model's: the turn re-encodes the whole conversation (the drafter needs its
    hidden states) and equals plain greedy on it."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    ids = torch.tensor([user_turns(1)[0][0]])
    filler = target if filled_by == "plain generate" else tiny_target("llama", seed=4, hidden=32)
    first = filler.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            return_dict_in_generate=True)
    conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], dim=1)
    with ForwardWidths(target) as forwards:
        out = target.generate(conversation, past_key_values=first.past_key_values, assistant_model=drafter,
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, **TURNS[loop])
    assert out[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())
    assert forwards.widths[0] == conversation.shape[1]


def test_own_loop_cache_of_an_older_request_is_encoded_again():
    """Another request on the same buffers in between: the old cache no longer matches them, the turn starts over."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    static = dict(assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                  cache_implementation="static", return_dict_in_generate=True)
    ids = torch.tensor([user_turns(1)[0][0]])
    first = target.generate(ids, **static)
    target.generate(torch.tensor([[9, 8, 7, 6, 5, 4]]), **static)
    conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], dim=1)
    with ForwardWidths(target) as forwards:
        out = target.generate(conversation, past_key_values=first.past_key_values, **static)
    assert out.sequences[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())
    assert forwards.widths[0] == conversation.shape[1]


def test_unusable_caches_get_one_clear_error():
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    ids = torch.tensor([user_turns(1)[0][0]])
    settings = dict(assistant_model=drafter, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    own = target.generate(ids, cache_implementation="static", **settings)
    conversation = torch.cat([own.sequences, torch.tensor([[7, 8]])], dim=1)
    with pytest.raises(ValueError, match="own loop.*same settings"):
        target.generate(conversation, past_key_values=own.past_key_values, loop="transformers", **settings)
    other = tiny_target("llama", seed=4, layers=4).generate(ids, max_new_tokens=4, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="has 4 layers and the target 6"):
        target.generate(torch.cat([other.sequences, torch.tensor([[7, 8]])], dim=1),
                        past_key_values=other.past_key_values, **settings)
    for loop in ("transformers", "dflash2"):
        turn = target.generate(ids, loop=loop, **settings)
        mask = torch.ones(1, turn.sequences.shape[1] + 2, dtype=torch.long)
        with pytest.raises(ValueError, match="whole conversation"):  # only the new ids, with the whole mask
            target.generate(torch.tensor([[7, 8]]), attention_mask=mask, past_key_values=turn.past_key_values,
                            loop=loop, **settings)


def test_own_loop_follow_up_with_other_sampling_settings_continues_the_cache():
    """Sampling settings and EOS ids are data of the buffers, not part of them: a sampled follow-up (other EOS ids) on
    a greedy turn's cache, then a greedy turn on the sampled one's, each encode only their new tokens, on one runner;
    the last equals plain greedy on the whole conversation."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    static = dict(assistant_model=drafter, max_new_tokens=NEW_TOKENS, cache_implementation="static",
                  return_dict_in_generate=True)
    ids = torch.tensor([user_turns(1)[0][0]])
    turn = target.generate(ids, do_sample=False, eos_token_id=None, **static)
    for extra, settings in (([7, 8, 9], dict(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[40, 41])),
                            ([10, 11], dict(do_sample=False, eos_token_id=None))):
        conversation = torch.cat([turn.sequences, torch.tensor([extra])], dim=1)
        with ForwardWidths(target) as forwards:
            turn = target.generate(conversation, past_key_values=turn.past_key_values, **settings, **static)
        assert forwards.widths[0] < conversation.shape[1] - ids.shape[1], settings  # a tail, not the conversation
    assert turn.sequences[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())
    assert len(drafter.round_runners()) == 1


# ------------------------------------------------------------------------------------------------ sampling
@pytest.mark.slow
def test_follow_up_sampling_with_a_reused_cache_follows_the_target():
    """Assisted loop: the same first turn (its cache copied for each draw), then a sampled follow-up turn; its 2nd and
    3rd tokens follow the target's own distribution given the whole conversation."""
    from helpers import exact_distribution_of_step

    target, drafter = sampling_case()
    first = target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=4, do_sample=False,
                            eos_token_id=None, return_dict_in_generate=True)
    conversation = torch.cat([first.sequences, torch.tensor([[8]])], dim=1)
    length = conversation.shape[1]
    generation = dict(do_sample=True, top_k=0, temperature=1.0, max_new_tokens=3, eos_token_id=None)
    processors = target._get_logits_processor(target.generation_config.__class__(**generation), length)
    torch.manual_seed(0)
    draws, accepted = 1200, 0
    counts = torch.zeros(2, target.config.vocab_size, dtype=torch.float64)
    for _ in range(draws):
        out = target.generate(conversation, past_key_values=copy.deepcopy(first.past_key_values),
                              assistant_model=drafter, **generation)
        for row, step in enumerate((1, 2)):
            counts[row, out[0, length + step]] += 1
        accepted += drafter.last_stats.accepted_per_position[0]
    assert accepted > draws * 0.05, "no draft was ever accepted: the test would not test acceptance"
    for row, step in enumerate((1, 2)):
        assert_follows(counts[row], exact_distribution_of_step(target, conversation, step, processors) * draws)


@pytest.mark.slow
def test_own_loop_follow_up_sampling_follows_the_target():
    """Own loop: a sampled first turn of one token, then a sampled follow-up turn with its cache. The joint
    distribution of (the first turn's token, the follow-up's 2nd token) matches the target's."""
    from helpers import exact_distribution_of_step

    target, drafter = sampling_case()
    vocab, prompt = target.config.vocab_size, torch.tensor([[5, 6, 7]])
    generation = dict(do_sample=True, top_k=0, temperature=1.0, eos_token_id=None, assistant_model=drafter,
                      cache_implementation="static", return_dict_in_generate=True)
    processors = target._get_logits_processor(target.generation_config.__class__(do_sample=True, top_k=0), 3)
    torch.manual_seed(0)
    draws, accepted = 1000, 0
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(draws):
        first = target.generate(prompt, max_new_tokens=1, **generation)
        conversation = torch.cat([first.sequences, torch.tensor([[8, 9]])], dim=1)
        out = target.generate(conversation, past_key_values=first.past_key_values, max_new_tokens=2, **generation)
        counts[first.sequences[0, 3], out.sequences[0, conversation.shape[1] + 1]] += 1
        accepted += drafter.last_stats.accepted_per_position[0]
    assert accepted > draws * 0.05, "no draft was ever accepted: the test would not test acceptance"
    first_turn = exact_distribution_of_step(target, prompt, 0, processors)
    expected = torch.zeros(vocab, vocab, dtype=torch.float64)
    for token in first_turn.nonzero().flatten().tolist():
        conversation = torch.tensor([[5, 6, 7, token, 8, 9]])
        expected[token] = first_turn[token] * exact_distribution_of_step(target, conversation, 1, processors)
    assert_follows(counts.flatten(), expected.flatten() * draws)


def test_eos_in_an_earlier_turn_is_part_of_the_conversation():
    """A turn that ended at EOS: the conversation carries on after it (chat templates end turns so), still exact."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    row = user_turns(1)[0][0]
    for settings in TURNS.values():
        first = target.generate(torch.tensor([row + [EOS]]), assistant_model=drafter, max_new_tokens=6,
                                do_sample=False, return_dict_in_generate=True, **settings)
        conversation = torch.cat([first.sequences, torch.tensor([[EOS, 11, 12]])], dim=1)
        out = target.generate(conversation, past_key_values=first.past_key_values, assistant_model=drafter,
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, **settings)
        assert out[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())


# ------------------------------------------------------------------------------------------------ the default target
@pytest.mark.slow
def test_default_target_chat_turns_equal_plain_greedy_in_every_loop():
    """SmolLM2-135M-Instruct with the shipped drafter, fp32: three chat turns (the answer appended as an assistant
    message, the cache passed back), each equal to plain greedy on the whole conversation and encoding only the turn's
    new tokens (plus at most a block and two), in the assisted loop, the own loop and a batch of two."""
    from dflash2.generation import DFlash2Drafter, load_target
    from dflash2.tasks import conversation_ids

    drafter = DFlash2Drafter.from_pretrained(ROOT / "drafters" / "SmolLM2-135M-Instruct-DFlash2", dtype=torch.float32)
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    drafter.attach(target)
    questions = [["What is 2 + 2?", "And times 3?", "Say it in French."],
                 ["Name a colour.", "Another one?", "Which is warmer?"]]
    block, accepted, plain, eos = drafter.config.block_size, 0, {}, tokenizer.eos_token_id
    for loop, batch in (("assisted", 1), ("static", 1), ("static", 2)):
        chats, cache, previous = [[] for _ in range(batch)], None, None
        for turn in range(3):
            for row in range(batch):
                chats[row].append({"role": "user", "content": questions[row][turn]})
            rows = [conversation_ids(tokenizer, chat) for chat in chats]
            ids, mask = left_padded(rows, tokenizer.pad_token_id)
            extra = {} if cache is None else {"past_key_values": cache}
            with ForwardWidths(target) as forwards:
                out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=24,
                                      do_sample=False, return_dict_in_generate=True, **extra, **TURNS[loop])
            for row in range(batch):
                new = out.sequences[row, ids.shape[1]:].tolist()
                new = new[: new.index(eos) + 1] if eos in new else new  # a batch row is padded after its EOS
                key = tuple(rows[row])
                if key not in plain:  # the loops hold the same conversations while they equal plain greedy
                    alone = torch.tensor([rows[row]])
                    plain[key] = target.generate(alone, attention_mask=torch.ones_like(alone), max_new_tokens=24,
                                                 do_sample=False)[0, len(rows[row]):].tolist()
                assert new == plain[key], (loop, batch, turn, row)
                text = tokenizer.decode(new, skip_special_tokens=True)
                chats[row].append({"role": "assistant", "content": text})
            if previous is not None:  # only what follows the last answer's tokens is encoded
                grown = max(len(r) - len(p) for r, p in zip(rows, previous))
                assert forwards.widths[0] <= grown + block + 2, (loop, batch, turn, forwards.widths[0], grown)
            previous = [r + plain[tuple(r)] for r in rows]
            accepted += sum(drafter.last_stats.accepted_per_position)
            cache = out.past_key_values
    assert accepted > 0


def test_multiturn_benchmark_reports_a_follow_up_that_encodes_only_the_new_turn():
    from dflash2.benchmarks.multiturn import run_multiturn
    from test_generation import _tiny_tokenizer

    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, seed=3).attach(target)
    results = run_multiturn(target, _tiny_tokenizer(), drafter, history_tokens=120, max_new_tokens=6, repeats=1)
    assert results["history_tokens"] >= 120
    for loop in ("assisted", "own_loop"):
        row = results[loop]
        assert row["same_tokens"]  # fp32: the cache changes nothing but the work
        assert row["full_encode"]["encoded_tokens"] == row["follow_up_tokens"]
        assert row["cache"]["encoded_tokens"] < row["follow_up_tokens"] - results["history_tokens"] // 2
        assert row["cache"]["first_token_s"] > 0 and row["full_encode"]["turn_s"] > 0


def test_a_later_turn_resumes_on_its_own_buffers_when_smaller_ones_would_fit():
    """Cores of several capacities are kept (a round attends over every column, so a request takes the smallest that
    fits), but a turn whose cache lives in a larger core resumes there instead of encoding everything again."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target).attach(target)
    static = dict(assistant_model=drafter, do_sample=False, cache_implementation="static", return_dict_in_generate=True)
    prompt = user_turns(1)[0][0]
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    greedy = greedy[0, len(prompt):].tolist()
    stop = next(i for i in range(3, 40) if greedy[i] not in greedy[:i])  # the turn ends at this token
    target.generate(torch.tensor([[9, 8, 7, 6]]), max_new_tokens=4, **static)  # a small core first
    first = target.generate(torch.tensor([prompt]), max_new_tokens=300, eos_token_id=greedy[stop], **static)
    assert first.sequences[0, len(prompt):].tolist() == greedy[: stop + 1]
    assert [runner.core.capacity for runner in drafter.round_runners()] == [256, 512]
    conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], dim=1)
    with ForwardWidths(target) as forwards:
        out = target.generate(conversation, past_key_values=first.past_key_values, max_new_tokens=NEW_TOKENS,
                              eos_token_id=None, **static)
    assert out.sequences[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())
    assert forwards.widths[0] < conversation.shape[1]  # resumed in the 512 core, not encoded anew in the 256 one
    assert drafter.round_runners()[-1].core.capacity == 512


@pytest.mark.parametrize("loop", ["assisted", "static"])
def test_a_conversation_under_the_installed_cache_name_logs_no_deprecation(loop):
    """transformers 5.24 renamed a cache in generate's kwargs and outputs from `past_key_values` to `cache`. Passed and
    read back under `CACHE_NAME` (the installed version's name), a follow-up turn stays exact, and neither loop uses
    the old name itself (which logs a deprecation warning there)."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    target = tiny_target("llama")
    drafter = repeat_anchor_drafts(tiny_drafter(target).attach(target))
    settings = dict(assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                    return_dict_in_generate=True, **TURNS[loop])
    first_ids = torch.tensor([user_turns(1)[0][0]])
    logging.get_logger("transformers").warning_once.cache_clear()  # a message logged once before would hide it
    with CaptureLogger(logging.get_logger("transformers.utils.generic")) as captured:
        first = target.generate(first_ids, **settings)
        conversation = torch.cat([first.sequences, torch.tensor([[7, 8, 9, 10, 11]])], dim=1)
        out = target.generate(conversation, **{CACHE_NAME: getattr(first, CACHE_NAME)}, **settings)
    assert "deprecated" not in captured.out, captured.out
    assert out.sequences[0, conversation.shape[1]:].tolist() == plain_greedy(target, conversation[0].tolist())
