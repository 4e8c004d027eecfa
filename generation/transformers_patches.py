"""Every change dflash2 makes to transformers' objects, in one place: what, why, and how `detach` undoes it.

Only a target instance changes, never a class or a module of transformers:

1. `target.generate` becomes an instance attribute (`patch_target`): the wrapper `dispatch.attach` builds around the
   class's `generate`, which chooses between DFlash 2's own loop and transformers' assisted loop, checks the request
   and takes DFlash 2's own arguments. `unpatch_target` (called by `detach`) deletes it, restoring an instance
   attribute the target had before.
2. `target._get_candidate_generator` becomes an instance attribute (`patch_target`): transformers' assisted loop builds
   its candidate generator there, and for a DFlash 2 drafter it must be ours. Undone with 1.
3. `target.prepare_inputs_for_generation`, for the duration of one call (`encode_only_uncached`): transformers'
   `_assisted_decoding` (5.17-5.24) feeds the whole prompt to its first forward, also on top of a non-empty cache, so
   a later turn of a conversation would encode the earlier turns again. Restored when the call returns.
4. `update_candidate_strategy` of transformers' own DFlash candidate generator (`speculation_type="dflash"`), on that
   generator instance, which lives for one call (`count_rounds_of`): counts its rounds into `drafter.last_stats`.

`target.__dict__["_dflash2_drafter"]` holds the attached drafter (not a submodule of the target); `unpatch_target`
removes it too. Version branches, within the range pyproject.toml declares (transformers>=5.17,<6):
`assisted_loop_rolls_state_back` (5.25 and later), `assisted_loop_cuts_at_eos` (5.18 and later), `target_cache_of`.
"""

from __future__ import annotations

import contextlib
import functools

import transformers
from packaging.version import Version

from .stats import DFlash2Stats

PATCHED = ("_get_candidate_generator", "generate")


def original_methods(target) -> dict:
    """The target's own `_get_candidate_generator` and `generate` (None: the class's), saved at the first attach."""
    if "_dflash2_originals" not in target.__dict__:
        target.__dict__["_dflash2_originals"] = {
            "_get_candidate_generator": target._get_candidate_generator,
            "generate": target.__dict__.get("generate"),
        }
    return target.__dict__["_dflash2_originals"]


def patch_target(target, drafter, generate, get_candidate_generator) -> None:
    """Patches 1 and 2 (`original_methods` first), and the attached drafter."""
    original_methods(target)
    target._get_candidate_generator = get_candidate_generator
    target.generate = generate
    target.__dict__["_dflash2_drafter"] = drafter  # not nn.Module.__setattr__: the drafter is no submodule


def unpatch_target(target):
    """Undo `patch_target`: the target's own methods come back. Returns the drafter that was attached (or None)."""
    originals = target.__dict__.pop("_dflash2_originals", None)
    if originals is None:
        return None
    for name in PATCHED:
        target.__dict__.pop(name, None)
    if originals["generate"] is not None:
        target.generate = originals["generate"]
    return target.__dict__.pop("_dflash2_drafter", None)


@contextlib.contextmanager
def encode_only_uncached(target):
    """Patch 3: while inside, the first forward of transformers' assisted loop encodes only the ids past the target
    cache, as plain decoding's `_prefill` slices them."""
    own = target.__dict__.get("prepare_inputs_for_generation")
    prepare = target.prepare_inputs_for_generation

    @functools.wraps(prepare)  # its signature too: transformers checks generate's kwargs against it
    def prepare_inputs_for_generation(input_ids, *args, next_sequence_length=None, is_first_iteration=False, **kwargs):
        cache = target_cache_of(kwargs)
        if is_first_iteration and next_sequence_length is None and cache is not None:
            cached = cache.get_seq_length()
            mask = kwargs.get("attention_mask")
            whole = mask is None or mask.shape[-1] == input_ids.shape[1]
            if 0 < cached < input_ids.shape[1] and whole:
                next_sequence_length = input_ids.shape[1] - cached
        return prepare(input_ids, *args, next_sequence_length=next_sequence_length,
                       is_first_iteration=is_first_iteration, **kwargs)

    target.prepare_inputs_for_generation = prepare_inputs_for_generation
    try:
        yield
    finally:
        del target.prepare_inputs_for_generation
        if own is not None:
            target.prepare_inputs_for_generation = own


def count_rounds_of(generator, drafter, prompt_length: int) -> None:
    """Patch 4: transformers' own DFlash candidate generator fills `drafter.last_stats` as ours does: one round per
    verification forward, prefill included."""
    stats = drafter.last_stats = DFlash2Stats(drafter.config.block_size)
    update = generator.update_candidate_strategy

    def update_candidate_strategy(input_ids, scores, num_matches):
        stats.record_round(int(num_matches))
        stats.completion_tokens = input_ids.shape[1] - prompt_length
        return update(input_ids, scores, num_matches)

    generator.update_candidate_strategy = update_candidate_strategy


def target_cache_of(model_kwargs) -> object | None:
    """The target cache of a generate call's model kwargs (`cache` from transformers 5.24, else `past_key_values`)."""
    cache = (model_kwargs or {}).get("cache")
    return cache if cache is not None else (model_kwargs or {}).get("past_key_values")


def assisted_loop_cuts_at_eos() -> bool:
    """Whether transformers' assisted loop ends the tokens it accepts at their first EOS (5.18 and later). Before, a
    round that accepted a drafted EOS went on past it, so the drafts themselves must end at their first EOS."""
    return Version(transformers.__version__).release >= (5, 18)


def assisted_loop_rolls_state_back() -> bool:
    """Whether transformers' assisted loop verifies drafts for targets with recurrent layers (linear attention,
    Mamba): from 5.25 it records their states and rolls them back; before, it refused them."""
    return Version(transformers.__version__).release >= (5, 25)
