"""What the GPU path captures as CUDA graphs must not read the device from the host: no op whose output size depends
on the data (`unique`, `nonzero`, boolean indexing) and no scalar read (`item`). On a GPU such an op invalidates the
capture ("operation failed due to a previous error during capture"); on the CPU the profiler shows it by name, so
these tests guard the captured functions without a GPU."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dflash2.benchmarks.plain_graph import PlainGraphLoop
from dflash2.generation.round_core import RoundCore
from dflash2.generation.sampling import Sampling, is_any_of
from helpers import EOS, VOCAB, sliding_qwen3, tiny_drafter, tiny_target

# ops that synchronise with the host (data-dependent output sizes, scalar reads)
HOST_READS = {"aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::nonzero",
              "aten::nonzero_static", "aten::masked_select", "aten::_local_scalar_dense", "aten::item",
              "aten::is_nonzero", "aten::equal"}


def host_reads(fn) -> set[str]:
    """Names of the host-synchronising ops `fn()` runs."""
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        fn()
    return {event.name for event in trace.events()} & HOST_READS


def test_the_detector_sees_what_breaks_a_capture():
    tokens, eos = torch.tensor([[5, 9, 3, 7]]), torch.tensor([3] + [-1] * 15)
    assert "aten::_unique" in host_reads(lambda: torch.isin(tokens, eos))  # isin's sorting branch
    assert "aten::nonzero" in host_reads(lambda: tokens[tokens > 4])
    assert host_reads(lambda: is_any_of(tokens, eos)) == set()
    assert torch.equal(is_any_of(tokens, eos), torch.isin(tokens, eos))


@pytest.mark.parametrize("arch,batch,tree_nodes", [("llama", 1, 0), ("llama", 3, 0), ("llama", 1, 7),
                                                   ("sliding", 2, 7), ("qwen3", 1, 5)])
def test_rounds_and_prefill_encodings_read_nothing_on_the_host(arch, batch, tree_nodes):
    """Every round (greedy or tree, sampled) and the bucketed prompt encoding, at batch 1 (where torch.isin would sort
    the 16 EOS slots and call unique) and above, with EOS ids set."""
    target = sliding_qwen3() if arch == "sliding" else tiny_target(arch, seed=2)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=6, tree_width=2).attach(target)
    core = RoundCore(target, drafter, batch, 128, bucketed_prefill=True, tree_nodes=tree_nodes)
    ids = torch.randint(4, VOCAB, (batch, 9), generator=torch.Generator().manual_seed(0))
    for sampling in (Sampling(), Sampling(True, 0.8, 5, 0.9)):
        core.set_sampling(sampling, eos_token_ids=[EOS, 7])
        core.prefill(ids, torch.ones_like(ids), 40)
        rounds = [core.sampled_round] if sampling.do_sample else [core.round]
        for fn in rounds + [lambda: core.encode_prompt(16)]:
            assert host_reads(fn) == set(), (fn, sampling)
        core.draw_noise()


def test_the_plain_graph_step_reads_nothing_on_the_host():
    target = tiny_target("llama", seed=3)
    loop = PlainGraphLoop(target, 1, 64, eos_token_ids=list(range(3, 19)), capture=False)
    loop.prefill(torch.tensor([[5, 6, 7]]))
    assert host_reads(loop.step) == set()


@pytest.mark.parametrize("round_name,tree_nodes", [("round", 0), ("round", 5), ("sampled_round", 0), ("sampled_round", 5)])
def test_the_fused_round_writes_its_caches_in_place(round_name, tree_nodes):
    """Inductor must write the new keys/values into the cache buffers themselves: a write it cannot re-place (a
    `scatter_` into the buffer was one) makes it copy every layer's whole key and value buffers in every round. The
    compiled round's code (greedy, tree, sampled) allocates no buffer of a cache's shape."""
    from torch._inductor.utils import run_and_get_code

    target = tiny_target("llama", seed=2, layers=2)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=6, tree_width=2, target_layer_ids=[0, 1])
    core = RoundCore(target, drafter.attach(target), 1, 96, tree_nodes=tree_nodes)
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    core.set_sampling(Sampling(True, 0.8, 5, 0.9) if round_name == "sampled_round" else Sampling(), [EOS])
    core.prefill(ids, torch.ones_like(ids), 40)
    round_fn = getattr(RoundCore, round_name).__wrapped__  # without its no_grad decorator
    round_fn(core)  # every cache buffer exists before the compile
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(round_fn, dynamic=False), core)
    shapes = {tuple(b.shape) for cache in (core.target_cache, core.draft_cache) for b in cache.keys + cache.values}
    assert all(len(shape) == 4 and shape[2] == 96 for shape in shapes), shapes
    for shape in shapes:
        assert f"empty_strided_cpu({shape}" not in "\n".join(code), f"the fused round copies cache buffers {shape}"
