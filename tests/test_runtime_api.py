"""The public runtime API of DFlash 2's own loop: which runners a drafter holds and how their rounds run, release and
detach freeing their buffers and graphs, and the bound on how many runners a drafter keeps."""

import gc
import weakref

import torch

from dflash2.generation import attached_drafter
from dflash2.generation.loop import MAX_RUNNERS
from dflash2.tasks import left_padded
from helpers import VOCAB, tiny_drafter, tiny_target


def static_call(target, drafter, **settings):
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    reference = target.generate(ids, max_new_tokens=10, do_sample=False, **settings)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=drafter,
                          cache_implementation="static", compile=False, **settings)
    assert torch.equal(out, reference)


def buffers_of(drafter) -> list:
    """Weak references to every runner's buffers: the target's and the drafter's caches and the round state."""
    refs = []
    for runner in drafter.round_runners():
        core = runner.core
        caches = [*core.target_cache.keys, *core.target_cache.values, *core.draft_cache.keys, *core.draft_cache.values]
        refs += [weakref.ref(t) for t in (*caches, core.output, core.features, core.prompt_logits)]
    return refs


def test_release_and_detach_free_the_runtime_buffers():
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target, seed=4, block_size=4).attach(target)
    static_call(target, drafter)
    (runner,) = drafter.round_runners(batch=1)
    assert runner.kind == "eager" and drafter.round_kind(1) == "eager" and drafter.round_kind(2) is None
    refs = buffers_of(drafter)
    assert len(refs) > 6 and all(ref() is not None for ref in refs)
    del runner
    drafter.release()
    gc.collect()
    assert drafter.round_runners() == [] and all(ref() is None for ref in refs)

    static_call(target, drafter)  # builds what it needs again
    refs = buffers_of(drafter)
    assert refs and attached_drafter(target) is drafter and drafter.is_bound_to(target)
    drafter.detach(target)
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert drafter.round_runners() == [] and attached_drafter(target) is None and not drafter.is_bound_to(target)


def test_a_drafter_keeps_a_bounded_number_of_runners():
    """One runner per batch bucket, whatever the sampling setting or EOS set; the least recently used go first."""
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, seed=6, block_size=4).attach(target)
    for batch in (1, 2, 3, 5, 9, 17):  # buckets 1 .. 32: MAX_RUNNERS + 2 of them
        bucket_call(target, drafter, batch)
    assert MAX_RUNNERS == 4 and [r.core.batch for r in drafter.round_runners()] == [4, 8, 16, 32]
    bucket_call(target, drafter, 3, do_sample=True, temperature=0.7, eos_token_id=12)  # used again: now the most recent
    assert [r.core.batch for r in drafter.round_runners()] == [8, 16, 32, 4]


def bucket_call(target, drafter, batch: int, **settings):
    prompts = [[5 + row, 9, 14][: 1 + row % 3] for row in range(batch)]
    ids, mask = left_padded(prompts, 0)
    target.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, assistant_model=drafter,
                    cache_implementation="static", compile=False, **settings)
