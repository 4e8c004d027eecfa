"""DFlash 2's own loop (the round core): one prompt with cache_implementation="static", and batches (each row equals
plain greedy of that row alone); exact sampling; the vectorised pieces against naive loops."""

import functools
import random

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash2.generation import attached_drafter
from dflash2.generation.round_core import RoundCore
from dflash2.tasks import left_padded as left_pad
from dflash2.generation.sampling import Sampling, row_warped_probabilities, speculative_accept, warped_probabilities
from helpers import (EOS, VOCAB, assert_follows, check_sampling_is_exact, exact_distribution_of_step, sampling_case,
                     sliding_qwen3, tiny_drafter, tiny_target)


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
def oracle(monkeypatch):
    """Overwrite a random-length prefix of each row's drafts with that row's reference continuation (new tokens),
    so rounds accept 0 .. B-1 drafts."""
    state = {"references": None, "rng": random.Random(0)}
    original = RoundCore.propose

    def propose(self, hidden, sampled=False):
        proposal = original(self, hidden, sampled=sampled)
        if state["references"] is None or sampled:  # (a captured runner's build runs its sampled round once)
            return proposal
        tokens = proposal.tokens.clone()
        for row, emitted in enumerate(self.output_length.tolist()[: len(state["references"])]):
            reference = state["references"][row]
            usable = max(0, min(state["rng"].randint(0, tokens.shape[1]), len(reference) - emitted))
            tokens[row, :usable] = torch.tensor(reference[emitted: emitted + usable], dtype=torch.long)
        proposal.tokens = tokens
        return proposal

    monkeypatch.setattr(RoundCore, "propose", propose)
    return state


@pytest.mark.parametrize("make,tree_nodes", [("llama", 0), ("llama", 5), ("sliding", 0), ("sliding", 5)])
def test_targets_with_eager_attention_equal_plain_greedy(make, tree_nodes, oracle):
    """transformers' eager attention adds the mask to the scores, so the rounds give the target additive masks (a
    boolean one would hide nothing there): with attn_implementation="eager", left-padded rows and a single row, path
    or tree rounds, a full-attention or sliding-window target, every row equals plain greedy."""
    target = sliding_qwen3() if make == "sliding" else tiny_target("llama", seed=7)
    target.set_attn_implementation("eager")
    drafter = tiny_drafter(target, block_size=4, selector_top_k=6, tree_width=2).attach(target)
    rng = random.Random(7)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (11, 4, 8)]
    references = [alone(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    oracle["references"] = references
    ids, mask = left_pad(prompts, 0)
    settings = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, assistant_model=drafter,
                    cache_implementation="static", tree_nodes=tree_nodes)
    out = target.generate(ids, attention_mask=mask, **settings)
    for row in range(len(prompts)):
        assert out[row, ids.shape[1]:].tolist() == references[row], row
    single = target.generate(torch.tensor([prompts[0]]), **settings)
    assert single[0, len(prompts[0]):].tolist() == references[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [2, 5, 8])
def test_batched_greedy_rows_equal_plain_greedy_alone(arch, batch, oracle):
    target = tiny_target(arch, seed=batch)
    drafter = tiny_drafter(target, seed=batch, block_size=[4, 8][batch % 2]).attach(target)
    rng = random.Random(batch)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(batch)]
    max_new = rng.choice([9, 17, 24])
    references = [alone(target, p, max_new_tokens=max_new) for p in prompts]
    oracle["references"] = references
    ids, mask = left_pad(prompts, 0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                          assistant_model=drafter)
    for row in range(batch):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row], row
    stats = drafter.last_stats
    assert stats.target_forwards < batch * max_new  # one verification per step for the whole batch
    assert stats.accepted_per_position[0] > 0


def test_batched_rows_stop_at_their_own_eos(oracle):
    target = tiny_target("llama", seed=9)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    prompts = [[5, 9, 14], [20, 7, 31, 40, 41], [8]]
    free = [alone(target, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    eos = free[1][3]  # a token the second row emits early
    references = [alone(target, p, max_new_tokens=20, eos_token_id=eos) for p in prompts]
    oracle["references"] = free
    ids, mask = left_pad(prompts, 0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, assistant_model=drafter)
    for row in range(3):
        got = out[row, ids.shape[1]:].tolist()
        assert got[: len(references[row])] == references[row]
        assert all(t == 0 for t in got[len(references[row]):])  # padded after its end


@pytest.mark.parametrize("mask", [[[1, 1, 0], [1, 1, 1]], [[1, 0, 1], [1, 1, 1]]], ids=["right", "hole"])
@pytest.mark.parametrize("static", [False, True])
def test_right_padding_and_holes_are_refused_clearly(mask, static):
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    extra = dict(cache_implementation="static") if static else {}
    with pytest.raises(ValueError, match="needs left-padded prompts"):
        target.generate(ids[:1] if static else ids, attention_mask=torch.tensor(mask)[:1] if static else torch.tensor(
            mask), max_new_tokens=4, assistant_model=drafter, **extra)


def test_batched_sampling_keeps_each_rows_distribution():
    """Two identical rows in one batch: each row's second token follows the target's distribution."""
    draws = 500
    target, drafter = sampling_case()
    prompt = [5, 6, 7]
    ids, mask = left_pad([prompt, prompt, prompt[1:]], 0)
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
    ids, mask = left_pad(prompts, 0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          custom_generate=str(tmp_path / "drafter"), trust_remote_code=True)
    for row in range(2):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row]
    assert attached_drafter(target).last_stats.target_forwards > 0


def test_batches_above_the_speculative_limit_fall_back_with_a_warning():
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, max_speculative_batch_size=2).attach(target)
    prompts = [[5, 9, 14], [20, 7], [8, 8, 8, 8]]
    references = [alone(target, p, max_new_tokens=10) for p in prompts]
    ids, mask = left_pad(prompts, 0)
    drafter.last_stats = None
    with pytest.warns(UserWarning, match="max_speculative_batch_size=2"):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant_model=drafter)
    assert drafter.last_stats.rows == 3 and drafter.last_stats.acceptance_length == 1.0  # plain decoding: no drafts
    for row in range(3):
        assert new_tokens(out[row], ids.shape[1], 0, EOS)[: len(references[row])] == references[row]
    with pytest.raises(ValueError, match="max_speculative_batch_size"):
        tiny_drafter(target, max_speculative_batch_size=0)


# ------------------------------------------------------------------------------------------------ one prompt, static
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", range(3))
def test_static_greedy_equals_plain_greedy(arch, seed, oracle):
    target = tiny_target(arch, seed=seed)
    drafter = tiny_drafter(target, seed=seed + 20, block_size=[4, 5, 8][seed]).attach(target)
    rng = random.Random(seed)
    for case in range(4):
        ids = torch.randint(4, VOCAB, (1, rng.randint(1, 10)), generator=torch.Generator().manual_seed(case))
        max_new = rng.choice([1, 3, 11, 26])
        reference = target.generate(ids, max_new_tokens=max_new, do_sample=False)
        oracle["references"] = [reference[0, ids.shape[1]:].tolist()]
        static = target.generate(ids, max_new_tokens=max_new, do_sample=False, assistant_model=drafter,
                                 cache_implementation="static")
        assert torch.equal(static, reference), (case, max_new)
    assert drafter.last_stats.target_forwards <= drafter.last_stats.completion_tokens


def test_static_loop_accepts_long_prefixes(oracle):
    target = tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = target.generate(ids, max_new_tokens=40, do_sample=False)
    oracle["references"] = [reference[0, 6:].tolist()]
    static = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                             cache_implementation="static")
    assert torch.equal(static, reference)
    assert drafter.last_stats.acceptance_length > 2.0


def test_static_greedy_stops_at_eos(oracle):
    target = tiny_target("qwen3", seed=3)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    free_run = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = free_run[0, 5 + 2].item()
    reference = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    oracle["references"] = [free_run[0, 5:].tolist()]
    static = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=drafter,
                             cache_implementation="static")
    assert torch.equal(static, reference)


def test_static_path_refuses_processors_it_cannot_apply():
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="temperature, top_k and top_p only"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=4, repetition_penalty=1.2, assistant_model=drafter,
                        cache_implementation="static")


def test_static_path_attends_to_pad_tokens_inside_the_prompt(oracle):
    """A chat template's end-of-turn token is often the pad token: with an explicit all-ones mask, plain decoding
    attends to it, and so must our loop (which never infers a mask from token values)."""
    target = tiny_target("llama", seed=4)
    drafter = tiny_drafter(target, block_size=8).attach(target)
    pad = 3
    ids = torch.tensor([[7, 9, pad, 11, 12, pad, 15]])
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                pad_token_id=pad, eos_token_id=None)
    oracle["references"] = [reference[0, 7:].tolist()]
    for mask in (None, torch.ones_like(ids)):
        static = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=pad,
                                 eos_token_id=None, assistant_model=drafter, cache_implementation="static")
        assert torch.equal(static, reference)


def test_one_set_of_buffers_serves_every_prompt_length(oracle):
    """Prompts of many lengths reuse one core (the same buffers a GPU captures once); a longer request grows it."""
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, block_size=4).attach(target)
    for length in (1, 2, 3, 5, 8, 13, 21):
        ids = torch.randint(4, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        reference = target.generate(ids, max_new_tokens=12, do_sample=False)
        oracle["references"] = [reference[0, length:].tolist()]
        assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                           cache_implementation="static"), reference)
    assert len(drafter.round_runners()) == 1
    core = drafter.round_runners()[0].core
    long_ids = torch.randint(4, VOCAB, (1, core.capacity), generator=torch.Generator().manual_seed(0))
    target.config.max_position_embeddings = 8 * core.capacity
    target.generate(long_ids, max_new_tokens=2, do_sample=False, assistant_model=drafter,
                    cache_implementation="static")
    assert max(runner.core.capacity for runner in drafter.round_runners()) >= 2 * core.capacity


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """The GPU path's logic on the CPU: a stand-in for CUDA graphs records each capture (a prefill bucket's width, or
    a round's name) and calls the function it would have captured on each replay. Returns (captured, replayed)."""
    from dflash2.generation import loop, graphs

    captured, replayed = [], []

    class Replay:  # what CapturedGraph would do, minus the graph: record the capture, run `fn` on each call
        def __init__(self, fn, pool=None, warmup=1):
            self.fn = fn
            self.name = fn.args[0] if isinstance(fn, functools.partial) else fn.__name__
            captured.append(self.name)

        def __call__(self):
            replayed.append(self.name)
            self.fn()

        def release(self):
            pass

    monkeypatch.setattr(graphs, "CapturedGraph", Replay)
    monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(loop, "uses_graphs", lambda target, drafter: True)
    return captured, replayed


def test_graph_path_buckets_prefills_and_replays_them(stand_in_graphs, oracle):
    """Prompts are left-padded to their prefill bucket, the bucket's graph replays their encoding (captured once, when
    the core is built), a prompt beyond the largest bucket encodes eagerly, and every output equals plain greedy."""
    from dflash2.generation.round_core import PREFILL_BUCKETS

    captured, replayed = stand_in_graphs
    target = tiny_target("llama", seed=6)
    target.config.max_position_embeddings = 8192
    drafter = tiny_drafter(target, block_size=4).attach(target)
    for length in (1, 5, 16, 17, 40, 2100):
        ids = torch.randint(4, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        reference = target.generate(ids, max_new_tokens=9, do_sample=False)
        oracle["references"] = [reference[0, length:].tolist()]
        replayed.clear()
        captures = len(captured)
        static = target.generate(ids, max_new_tokens=9, do_sample=False, assistant_model=drafter,
                                 cache_implementation="static", compile=False)  # graphs, no child building a package
        assert torch.equal(static, reference), length
        encoded = [w for w in replayed if isinstance(w, int)]
        bucket = next((b for b in PREFILL_BUCKETS if b >= max(length, 4)), None)
        assert encoded == ([bucket] if bucket else []), (length, encoded)
        built = "sampled_round" in captured[captures:]  # a new core: each round launched once right after its capture
        assert replayed.count("round") > int(built) and replayed.count("sampled_round") == int(built), replayed
    # 2100 + 9 + 4 columns outgrow the first core (512): a second core of the capacity it needs captured the buckets
    # up to 2048, which did not fit the first; the first stays for shorter requests
    assert [runner.core.capacity for runner in drafter.round_runners()] == [512, 4096]
    assert captured.count(256) == 2 and captured.count(512) == captured.count(1024) == captured.count(2048) == 1
    assert captured.count("round") == captured.count("sampled_round") == 2  # both rounds, once per core


# ------------------------------------------------------------------------------------------------ settings as data
def static_call(target, drafter, ids, max_new_tokens=16, **settings):
    return target.generate(ids, max_new_tokens=max_new_tokens, assistant_model=drafter, cache_implementation="static",
                           compile=False, **settings)


def test_one_runner_serves_greedy_and_every_sampling_setting(stand_in_graphs):
    """Greedy, then T=0.7, then T=1.0 with top-p 0.9, then greedy again: one runner, whose two rounds were captured
    once when it was built; each call replays the round its setting picks, with the settings in the core's tensors,
    and greedy outputs still equal plain greedy."""
    captured, replayed = stand_in_graphs
    target = tiny_target("llama", seed=11)
    drafter = tiny_drafter(target, seed=12, block_size=4).attach(target)
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(static_call(target, drafter, ids, do_sample=False), reference)
    (runner,) = drafter.round_runners()
    assert runner.kind == "graph (eager kernels)"
    assert [name for name in captured if isinstance(name, str)] == ["round", "sampled_round"]
    for settings in (dict(temperature=0.7), dict(temperature=1.0, top_p=0.9)):
        replayed.clear()
        static_call(target, drafter, ids, do_sample=True, top_k=0, **settings)
        assert drafter.round_runners() == [runner] and runner.core.do_sample
        assert "sampled_round" in replayed and "round" not in replayed
        torch.testing.assert_close(runner.core.temperature, torch.tensor([settings["temperature"]]))
        torch.testing.assert_close(runner.core.top_p, torch.tensor([settings.get("top_p", 1.0)], dtype=torch.float64))
    replayed.clear()
    assert torch.equal(static_call(target, drafter, ids, do_sample=False), reference)
    assert drafter.round_runners() == [runner] and not runner.core.do_sample
    assert "round" in replayed and "sampled_round" not in replayed
    assert [name for name in captured if isinstance(name, str)] == ["round", "sampled_round"]  # nothing captured since


def test_a_captured_runner_runs_the_sampled_eager_steps_once_without_touching_the_users_generator(stand_in_graphs):
    """Building a captured runner (a greedy call) also runs the eager steps a sampled call adds around its rounds (the
    first token's draw, the noise), so that on CUDA their kernels load then and not in the first sampled call; it
    draws on a private generator: the global RNG is where it was, and a seeded sampled call decodes what it would
    have decoded on a runner that skipped the warm-up."""
    from dflash2.generation.round_core import RoundCore

    target = tiny_target("llama", seed=11)
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    outputs = []
    for warm in (True, False):
        drafter = tiny_drafter(target, seed=12, block_size=4).attach(target)
        with pytest.MonkeyPatch.context() as patch:
            if not warm:
                patch.setattr(RoundCore, "warm_sampling_steps", lambda self: None)
            state = torch.get_rng_state()
            static_call(target, drafter, ids, do_sample=False)
            assert torch.equal(torch.get_rng_state(), state)  # the warm-up drew nothing from the user's generator
            (runner,) = drafter.round_runners()
            assert bool(runner.core.uniform.any()) == warm  # the noise buffers were filled (zeros until drawn)
            torch.manual_seed(5)
            outputs.append(static_call(target, drafter, ids, do_sample=True, temperature=0.8))
    assert torch.equal(outputs[0], outputs[1])


def test_a_new_eos_set_on_the_same_runner_stops_at_its_own_tokens():
    """Two calls on one runner with different EOS ids: each stops where plain greedy with its EOS stops."""
    target = tiny_target("qwen3", seed=16)
    drafter = tiny_drafter(target, seed=17, block_size=4).attach(target)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(16))
    free = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, 6:].tolist()
    first, second = free[4], next(t for t in free[9:] if t not in free[:9])  # EOS ids the target emits, one late
    never = next(t for t in range(4, VOCAB) if t not in free)
    runners = []
    for eos in (first, [second, never]):
        reference = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos)
        out = static_call(target, drafter, ids, max_new_tokens=24, do_sample=False, eos_token_id=eos)
        assert torch.equal(out, reference), eos
        runners += drafter.round_runners()
        assert runners[-1].core.eos_token_ids == sorted(eos if isinstance(eos, list) else [eos])
    assert runners[0] is runners[1]
    assert out.shape[1] >= 6 + 10  # the second call ran past where the first EOS stopped the first


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


def test_per_row_warping_equals_each_rows_own_setting():
    """The rounds' per-row warping (settings as tensors) against the one-setting reference and transformers' warpers,
    row by row, on logits [b, V] and [b, R, V]: rows with no warping, each warper alone, all three, and a top-k at or
    above the vocabulary."""
    settings = [Sampling(True), Sampling(True, 0.7), Sampling(True, 1.0, 5), Sampling(True, 1.0, 0, 0.8),
                Sampling(True, 1.3, 9, 0.9), Sampling(True, 0.5, 40, 0.95), Sampling(True, 2.0, 55, 1.0)]
    temperature = torch.tensor([s.temperature for s in settings])
    top_k = torch.tensor([s.top_k for s in settings])
    top_p = torch.tensor([s.top_p for s in settings], dtype=torch.float64)
    generator = torch.Generator().manual_seed(5)
    for shape in ((len(settings), 40), (len(settings), 3, 40)):
        logits = torch.randn(shape, generator=generator) * 3
        got = row_warped_probabilities(logits, temperature, top_k, top_p)
        for row, setting in enumerate(settings):
            torch.testing.assert_close(got[row], warped_probabilities(logits[row], setting))
            warpers = LogitsProcessorList([TemperatureLogitsWarper(setting.temperature)] + (
                [TopKLogitsWarper(setting.top_k)] if setting.top_k else []) + (
                [TopPLogitsWarper(setting.top_p)] if setting.top_p < 1 else []))
            want = warpers(None, logits[row].reshape(-1, 40).clone()).softmax(-1).reshape(logits[row].shape)
            torch.testing.assert_close(got[row], want)
    assert bool((got[2] > 0).sum(-1).eq(5).all()) and bool((got[0] > 0).all())  # top-k 5 cut; nothing cut


def test_rows_of_one_batch_sample_with_their_own_settings():
    """Two rows of one batch, the same prompt, different settings: each row's second token follows the target's
    distribution under that row's own warping (the core's sampled round, settings per row)."""
    draws = 500
    target, drafter = sampling_case()
    settings = [Sampling(True, 0.8), Sampling(True, 1.2, 6, 0.9)]
    core = RoundCore(target, drafter, 2, 64)
    core.set_sampling(settings)
    ids = torch.tensor([[5, 6, 7]] * 2)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, target.config.vocab_size, dtype=torch.float64)
    accepted = 0
    for _ in range(draws):
        core.prefill(ids, torch.ones_like(ids), 3, generator)
        core.draw_noise(generator)
        core.sampled_round()
        for row in range(2):
            counts[row, core.output[row, 1]] += 1
        accepted += int(core.accepted_per_position[:, 0].sum())
    assert accepted > draws * 0.05, "no draft was ever accepted: the test would not test acceptance"
    for row, setting in enumerate(settings):
        config = target.generation_config.__class__(do_sample=True, temperature=setting.temperature,
                                                    top_k=setting.top_k, top_p=setting.top_p)
        processors = target._get_logits_processor(config, 3)
        assert_follows(counts[row], exact_distribution_of_step(target, ids[:1], 1, processors) * draws)


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


@pytest.mark.parametrize("static", [True, False], ids=["own loop", "assisted loop"])
def test_sampling_settings_left_unset_take_transformers_defaults(static):
    """A sampling call that leaves top_k unset samples with transformers' global default cut, as plain `generate`
    does: the same seeded tokens as passing that default, other tokens than passing no cut."""
    target, drafter = sampling_case(vocab=96)  # a wide, flat target: the default cut removes tokens of real mass
    default_top_k = target._prepare_generation_config(None, do_sample=True)[0].top_k
    assert 0 < default_top_k < 96

    def sample(**settings):
        torch.manual_seed(0)
        return target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, do_sample=True, max_new_tokens=24,
                               eos_token_id=None, **({"cache_implementation": "static"} if static else {}),
                               **settings)[0].tolist()

    unset = sample()
    assert unset == sample(top_k=default_top_k)
    assert unset != sample(top_k=0)


@pytest.mark.parametrize("settings", [dict(temperature=1.0),
                                      pytest.param(dict(temperature=0.7, top_p=0.85), marks=pytest.mark.slow)])
def test_static_sampling_reproduces_the_target_distribution(settings):
    check_sampling_is_exact(settings, draws=1200, cache_implementation="static")
