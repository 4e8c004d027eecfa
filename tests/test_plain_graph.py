"""The plain decoding loop of the benchmarks (benchmarks/plain_graph.py), run eagerly on the CPU: its tokens equal
`generate(do_sample=False)`'s, with and without EOS inside, at several prompt lengths and for a batch; sampled, its
tokens follow the target's warped distribution (a chi-square test against the exact one)."""

import random

import pytest
import torch

from dflash2.benchmarks.plain_graph import PlainGraphLoop, device_ms, forward_fn, plain_graph_generate
from dflash2.generation.sampling import Sampling
from helpers import VOCAB, assert_follows, exact_distribution_of_step, sampling_case, tiny_target


def plain(target, ids, max_new_tokens, eos):
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loop_equals_plain_greedy_with_and_without_eos(arch):
    target = tiny_target(arch, seed=4)
    rng = random.Random(arch)
    ended_early, stops = 0, set()
    for length in (1, 6, 23):
        ids = torch.tensor([[rng.randrange(4, VOCAB) for _ in range(length)]])
        free = plain(target, ids, 30, None)
        eos = int(free[0, length + rng.randrange(2, 12)])  # a token greedy emits early: the call ends there
        stops.add(eos)
        for stop in (None, eos):
            reference = plain(target, ids, 30, stop)
            out = plain_graph_generate(target, ids, 30, eos_token_id=stop, pad_token_id=0)
            assert torch.equal(out, reference), (length, stop)
            ended_early += reference.shape[1] < length + 30
    assert ended_early == 3  # every EOS case ended inside the 30 tokens (and the loop stopped with it)
    assert len(target.plain_graph_loops) == 1 + len(stops)  # a loop per EOS setting, reused across prompts


def test_batch_rows_stop_at_their_own_eos_and_are_padded():
    target = tiny_target("llama", seed=5)
    ids = torch.tensor([[5, 9, 14, 20], [20, 7, 31, 40]])
    free = plain(target, ids, 20, None)
    eos = int(free[1, 4 + 3])  # the second row emits it early
    reference = plain(target, ids, 20, eos)
    loop = PlainGraphLoop(target, batch=2, capacity=64, eos_token_ids=[eos], check_every=3)
    assert loop.kind == "eager"
    assert torch.equal(loop.generate(ids, 20, pad_token_id=0), reference)
    with pytest.raises(ValueError, match="do not fit"):
        loop.generate(ids, 60)


@pytest.mark.parametrize("sampling", [Sampling(True, 0.7), Sampling(True, 1.0, top_k=5), Sampling(True, 1.3, top_p=0.8),
                                      Sampling(True, 1.0, top_k=6, top_p=0.9)], ids=["T", "top-k", "top-p", "both"])
def test_sampled_loop_follows_the_warped_distribution(sampling):
    check_sampled_loop(sampling)


def check_sampled_loop(sampling, device="cpu", compile=False):
    """The first and second new tokens of many rows (the prefill's sample, then the step's) against the exact
    distribution under transformers' warpers (`warped_probabilities`, computed on the CPU), over three calls of one
    loop (fresh noise each call, the settings filled in per call)."""
    from dflash2.generation.sampling import warped_probabilities

    target, _ = sampling_case()
    ids = torch.tensor([[5, 6, 7]])
    warp = lambda prefix, logits: warped_probabilities(logits, sampling).log()  # noqa: E731
    expected = [exact_distribution_of_step(target, ids, step, warp) for step in (0, 1)]
    rows, calls = 800, 3
    target, ids = target.to(device), ids.to(device)
    loop = PlainGraphLoop(target, batch=rows, capacity=16, sampling=sampling, compile=compile)
    assert loop.cuts == bool(sampling.top_k or sampling.top_p < 1)
    torch.manual_seed(0)
    counts = torch.zeros(2, target.config.vocab_size, dtype=torch.float64)
    for _ in range(calls):
        out = loop.generate(ids.expand(rows, -1), 2, sampling=sampling).cpu()
        for step in (0, 1):
            counts[step] += torch.bincount(out[:, 3 + step], minlength=target.config.vocab_size).double()
    for step in (0, 1):
        assert_follows(counts[step], expected[step] * rows * calls)
    return loop


def test_a_loop_keeps_to_the_kind_of_setting_it_was_built_for():
    """A greedy loop refuses a sampling setting and a temperature-only loop a cut (one clear error naming the way out);
    plain_graph_generate keeps a loop per kind, and a sampled loop at temperature 0.01 gives the greedy tokens."""
    target = tiny_target("llama", seed=5)
    ids = torch.tensor([[5, 9, 14, 20]])
    greedy = PlainGraphLoop(target, batch=1, capacity=64)
    with pytest.raises(ValueError, match="built for greedy decoding.*plain_graph_generate"):
        greedy.generate(ids, 4, sampling=Sampling(True, 1.0))
    hot = PlainGraphLoop(target, batch=1, capacity=64, sampling=Sampling(True, 1.0))
    with pytest.raises(ValueError, match="temperature only.*plain_graph_generate"):
        hot.generate(ids, 4, sampling=Sampling(True, 1.0, top_k=5))
    reference = plain(target, ids, 12, None)
    cold = plain_graph_generate(target, ids, 12, pad_token_id=0, sampling=Sampling(True, 0.01))
    assert torch.equal(cold, reference)
    plain_graph_generate(target, ids, 12, pad_token_id=0, sampling=Sampling(True, 1.0, top_p=0.9))
    plain_graph_generate(target, ids, 12, pad_token_id=0)
    assert sorted(key[-1] for key in target.plain_graph_loops) == ["cuts", "greedy", "temperature"]


def test_a_call_samples_as_generate_resolves_it():
    """call_sampling reads a generate call's setting as generate would: the model's generation config updated with the
    call's keywords, transformers' default top-k of 50 for a sampling call that leaves top_k out."""
    from dflash2.benchmarks.plain_graph import call_sampling

    target = tiny_target("llama", seed=5)
    before = target.generation_config.to_dict()
    assert call_sampling(target, {"do_sample": False, "max_new_tokens": 8, "pad_token_id": 0}).do_sample is False
    assert call_sampling(target, {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0}) == Sampling(
        True, 0.8, 0, 0.9)
    assert call_sampling(target, {"do_sample": True, "temperature": 1.0}).top_k == 50
    assert target.generation_config.to_dict() == before  # the model's own config is not changed


def test_a_timed_forward_replays_the_same_columns():
    target = tiny_target("qwen3", seed=6)
    for tokens in (1, 16):
        assert device_ms(forward_fn(target, tokens, context=12), target.device, replays=3) > 0


def test_the_fused_forward_computes_what_the_plain_one_does():
    """forward_fn(compile=True) -- the forward a fused round is compared with -- runs through inductor and picks the
    same tokens as the uncompiled forward, call after call."""
    target = tiny_target("llama", seed=6, layers=2)
    chosen = {}
    for compile in (False, True):
        forward = forward_fn(target, 16, context=12, capacity=64, compile=compile)
        for _ in range(3):
            forward()
        chosen[compile] = forward.chosen.clone()
    assert torch.equal(chosen[False], chosen[True])


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["graph", "fused-graph"])
def test_captured_loop_equals_plain_greedy_on_the_gpu(compile):
    """The step captured as a CUDA graph (fused by inductor first with compile=True) equals plain greedy in fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for arch in ("llama", "qwen3"):
        target = tiny_target(arch, seed=7).cuda()
        rng = random.Random(arch)
        for length in (1, 9, 40):
            ids = torch.randint(4, VOCAB, (1, length), device="cuda")
            free = plain(target, ids, 60, None)
            eos = int(free[0, length + rng.randrange(5, 40)])
            for stop in (None, eos):
                out = plain_graph_generate(target, ids, 60, eos_token_id=stop, pad_token_id=0, compile=compile)
                assert torch.equal(out, plain(target, ids, 60, stop)), (arch, length, stop)
        assert {loop.kind for loop in target.plain_graph_loops.values()} == {
            "graph (fused)" if compile else "graph (eager kernels)"}


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["graph", "fused-graph"])
@pytest.mark.parametrize("sampling", [Sampling(True, 1.0), Sampling(True, 0.8, top_k=6, top_p=0.9)], ids=["T", "cuts"])
def test_captured_sampled_loop_follows_the_warped_distribution(sampling, compile):
    """The sampled step captured as a CUDA graph (fused by inductor first with compile=True), its noise drawn before
    each replay, samples the target's warped distribution (fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loop = check_sampled_loop(sampling, "cuda", compile)
    assert loop.kind == ("graph (fused)" if compile else "graph (eager kernels)")
