# Generated from generation/dispatch.py by `python -m dflash2.generation.flat_code`; do not edit.
"""Hooking a DFlash 2 drafter into `target.generate`: attach / detach, dispatch between the loops, request checks.
(The patches of the target themselves, and how detach undoes them: `transformers_patches.py`.)

After `attach(drafter, target)`, `target.generate(ids, assistant_model=drafter, ...)` runs DFlash 2's own loop
(`loop.py`: fixed buffers, CUDA graphs and the fused round on a GPU) wherever it is exact for the call: a batch, and
one prompt whose settings it honours (greedy search, temperature, top-k, top-p, EOS ids, max length, streaming, a
cache it returned). transformers' assisted loop with our candidate generator takes the rest of the one-prompt calls:
a target spread over several devices, a target the fixed buffers cannot drive, other logits processors and stopping
criteria, output scores, a cache from another loop, transformers' own `speculation_type="dflash"`. `loop=` chooses
explicitly: "dflash2" (the own loop, refusing what it cannot honour) or "transformers" (the assisted loop).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .candidate_generator import DFlash2CandidateGenerator
from .loop import LoopCache, check_left_padded, own_loop_generate, release_runners, single_device
from .sampling import MAX_EOS_TOKENS
from .stats import DFlash2Stats, truncate_at_eos
from .transformers_patches import (count_rounds_of, encode_only_uncached, original_methods, patch_target,
                                   unpatch_target)

# Largest batch at which batched DFlash 2 was measured faster than plain batched `generate` (docs/benchmarks.md):
# beyond it the verification of batch x block tokens stops being latency-bound and speculation costs time.
MEASURED_SPECULATIVE_BATCH_LIMIT = {"cuda": 8, "cpu": 2}


def is_dflash2_drafter(model) -> bool:
    # duck-typed: classes loaded through trust_remote_code are copies of ours under transformers_modules.*
    return getattr(getattr(model, "config", None), "model_type", None) == "dflash2" and hasattr(model, "propose")


# ------------------------------------------------------------------------------------------------ attach / detach
def attach(drafter, target, use_by_default: bool = False):
    """Make `target.generate(..., assistant_model=drafter)` draft with DFlash 2. Returns the target.

    `use_by_default=True` also speculates when `generate` gets no assistant (the pipeline one-liner).
    Only this target instance changes; `detach(target)` restores it.
    """
    drafter.bind_target(target)
    originals = original_methods(target)
    original_get_candidate_generator = originals["_get_candidate_generator"]
    original_generate = originals["generate"] or type(target).generate.__get__(target)

    def _get_candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        if is_dflash2_drafter(assistant_model) and getattr(generation_config, "speculation_type", None) != "dflash":
            return DFlash2CandidateGenerator(assistant_model, generation_config, logits_processor, input_ids,
                                             model_kwargs)
        generator = original_get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            *args, **kwargs,
        )
        if is_dflash2_drafter(assistant_model):  # transformers' own DFlash path: count its rounds into last_stats
            count_rounds_of(generator, assistant_model, input_ids.shape[1])
        return generator

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        if use_by_default and kwargs.get("assistant_model") is None and not _other_speculation(kwargs):
            kwargs["assistant_model"] = target._dflash2_drafter
        drafter_in_call = kwargs.get("assistant_model")
        tree_nodes = kwargs.pop("tree_nodes", None)
        loop = kwargs.pop("loop", None)
        if is_dflash2_drafter(drafter_in_call):
            check_request(target, drafter_in_call, args, kwargs)
            check_loop(loop, kwargs)
            batch = _batch_size(args, kwargs)
            earlier_cache = kwargs.get("past_key_values", kwargs.get("cache"))  # a conversation's earlier turn
            if batch > 1 and not speculation_pays_at(drafter_in_call, batch, target.device.type):
                return _plain_batch(original_generate, target, args, kwargs)  # faster than speculating at this size
            elif loop == "dflash2" or batch > 1 or (loop is None and kwargs.get("cache_implementation") == "static"):
                return _own_loop(target, args, kwargs, tree_nodes)
            else:
                reason, call = assisted_reason(target, drafter_in_call, args, kwargs, loop)
                if reason is None:  # one prompt whose settings the own loop honours
                    return _own_loop(target, args, kwargs, tree_nodes, call)
                if tree_nodes:
                    raise ValueError(
                        f"tree_nodes={tree_nodes}: tree verification runs in DFlash 2's own loop, and this call runs "
                        f"transformers' assisted loop ({reason}), which verifies one path. Drop tree_nodes, or what "
                        "sends the call there.")
                if isinstance(earlier_cache, LoopCache):
                    raise ValueError(
                        "This cache comes from DFlash 2's own loop, which keeps it in its own buffers; this call runs "
                        f"transformers' assisted loop ({reason}), which cannot read it. Continue the conversation "
                        "with the same settings as the turn that returned the cache.")
                return _assisted_loop(target, original_generate, args, kwargs, earlier_cache, reason)
        elif tree_nodes is not None or loop is not None:
            name = "tree_nodes" if tree_nodes is not None else "loop"
            raise ValueError(f"{name}= needs a DFlash 2 drafter as assistant_model; drop {name}.")
        return original_generate(*args, **kwargs)

    patch_target(target, drafter, generate, _get_candidate_generator)
    return target


def attached_drafter(target):
    """The DFlash 2 drafter `attach` hooked into `target`, or None."""
    return target.__dict__.get("_dflash2_drafter")


def detach(target):
    """Undo `attach`: the target's own `generate` and candidate-generator dispatch come back, and the drafter lets go
    of the target (its borrowed embeddings and head, and the round runners with their buffers and graphs)."""
    drafter = unpatch_target(target)
    if drafter is not None:
        drafter._target_parts = {}
        release_runners(drafter, target)
    return target


# ------------------------------------------------------------------------------------------------ dispatch
def _assisted_loop(target, original_generate, args, kwargs, earlier_cache, reason: str):
    """One prompt in transformers' assisted loop with our candidate generator; `last_stats.loop_reason` says why."""
    drafter = kwargs["assistant_model"]
    if earlier_cache is not None and kwargs.get("speculation_type") != "dflash":
        with encode_only_uncached(target):  # a later turn's cache: encode only the new ids
            out = original_generate(*args, **kwargs)
    else:
        out = original_generate(*args, **kwargs)
    stats = getattr(drafter, "last_stats", None)
    if stats is not None:
        stats.loop_reason = reason
    return out


def _own_loop(target, args, kwargs, tree_nodes=None, call=None):
    """DFlash 2's own fixed-buffer loop; `call`: the call already split by `_split_generate_call`."""
    cache = kwargs.pop("past_key_values", kwargs.pop("cache", None))
    drafter, inputs, attention_mask, streamer, compile_flag, config = call or _split_generate_call(target, args, kwargs)
    return own_loop_generate(target, drafter, inputs, attention_mask, config, streamer=streamer, compile=compile_flag,
                             past_key_values=cache, tree_nodes=tree_nodes)


def _plain_batch(original_generate, target, args, kwargs):
    """A batch above the speculative batch limit: plain batched decoding, described in the drafter's `last_stats`."""
    drafter = kwargs.pop("assistant_model")
    output = original_generate(*args, **kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    config = kwargs.get("generation_config") or target.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}
    new_tokens = sequences[:, _inputs_of(args, kwargs).shape[1]:].tolist()
    tokens = sum(len(truncate_at_eos(row, eos)) for row in new_tokens)
    drafter.last_stats = DFlash2Stats.of_plain_decoding(drafter.config.block_size, len(new_tokens), tokens)
    return output


LOOPS = ("dflash2", "transformers")


def check_loop(loop, kwargs) -> None:
    """`loop=`: None (DFlash 2's own loop wherever it is exact for the call), "dflash2" or "transformers"."""
    if loop not in (None,) + LOOPS:
        raise ValueError(f"loop={loop!r}: use 'dflash2' (DFlash 2's own loop), 'transformers' (transformers' assisted "
                         "loop) or leave it out (the own loop wherever it is exact for the call).")
    if loop == "dflash2" and kwargs.get("speculation_type") == "dflash":
        raise ValueError("loop='dflash2' with speculation_type='dflash': transformers' built-in DFlash path runs in its "
                         "assisted loop. Drop one of them.")


def assisted_reason(target, drafter, args, kwargs, loop) -> tuple[str | None, tuple | None]:
    """Why a one-prompt call runs transformers' assisted loop, or (None, the call split for the own loop)."""
    from .round_core import check_target_fits

    if loop == "transformers":
        return "loop='transformers'", None
    if kwargs.get("speculation_type") is not None:
        return f"speculation_type={kwargs['speculation_type']!r}", None
    earlier_cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if earlier_cache is not None and not isinstance(earlier_cache, LoopCache):
        return f"a cache the own loop did not return ({type(earlier_cache).__name__})", None
    if not single_device(target, drafter):
        return "the target is spread over several devices", None
    try:
        check_target_fits(target)
    except ValueError as error:
        return str(error), None
    call = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")}  # the own loop takes its own
    *split, unknown = _split_generate_call(target, args, call, strict=False)
    config = split[-1]
    if unknown:
        return f"arguments the own loop does not take: {sorted(unknown)}", None
    settings = unsupported_settings(config)
    if settings:
        return f"settings the own loop does not honour: {settings}", None
    eos = config.eos_token_id
    if isinstance(eos, (list, tuple)) and len(set(eos)) > MAX_EOS_TOKENS:
        return f"{len(set(eos))} EOS ids (the own loop stops at up to {MAX_EOS_TOKENS})", None
    return None, tuple(split)


def _split_generate_call(target, args, kwargs, strict: bool = True):
    """(drafter, input_ids, attention_mask, streamer, compile flag, generation config) of a generate call; with
    `strict=False` also the arguments the own loop does not take (else they raise)."""
    # custom_generate forwards every argument of generate, most of them None or empty: those ask for nothing.
    # A None that overrides a generation-config field (eos_token_id=None) does ask for something: keep it.
    config_fields = vars(target.generation_config)  # its fields (`to_dict` would deep-copy them on every call)
    kwargs = {k: v for k, v in kwargs.items() if k in config_fields or (
        v is not None and not (k in ("synced_gpus", "logits_processor", "stopping_criteria") and not v))}
    drafter = kwargs.pop("assistant_model")
    inputs = args[0] if args else kwargs.pop("inputs", None)
    inputs = inputs if inputs is not None else kwargs.pop("input_ids")
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    compile_flag = kwargs.pop("compile", None)
    for ignored in ("cache_implementation", "use_cache"):
        kwargs.pop(ignored, None)
    # transformers' own preparation: the call's settings over the model's generation config over transformers' global
    # defaults, so that the own loop samples from what plain `generate` samples from (top_k=50 where a sampling call
    # leaves top_k unset)
    config, unknown = target._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    if not strict:
        return drafter, inputs, attention_mask, streamer, compile_flag, config, unknown
    if unknown:
        raise ValueError(f"DFlash 2's own loop does not take {sorted(unknown)}; drop them (or pass one prompt with "
                         "loop='transformers' for transformers' assisted loop).")
    settings = unsupported_settings(config)
    if settings:
        raise ValueError(f"DFlash 2's own loop supports temperature, top_k and top_p only; got {settings}. Pass one "
                         "prompt with loop='transformers' for transformers' assisted loop, which honours every logits "
                         "processor.")
    return drafter, inputs, attention_mask, streamer, compile_flag, config


def speculation_pays_at(drafter, batch: int, device_type: str) -> bool:
    """False (with a warning naming the override) when `batch` exceeds the drafter's speculative batch limit."""
    limit = drafter.config.max_speculative_batch_size
    if limit is None:
        limit = MEASURED_SPECULATIVE_BATCH_LIMIT.get(device_type, 1)
    if batch <= limit:
        return True
    warnings.warn(
        f"DFlash 2: batch size {batch} is above max_speculative_batch_size={limit} for {device_type}, "
        "where batched speculation was measured slower than plain batched generate; decoding without the drafter. "
        "Set `drafter.config.max_speculative_batch_size` higher to speculate anyway.", stacklevel=3)
    return False


# Generation settings the own loop honours, or that do not change what is generated (cache and compile choices, the
# assisted loop's draft-length controls, beam-search-only knobs); any other setting counts only at its neutral value.
OWN_LOOP_SETTINGS = frozenset({
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id",
    "bos_token_id", "decoder_start_token_id", "return_dict_in_generate", "use_cache", "cache_implementation",
    "cache_config", "compile_config", "disable_compile", "max_cache_len", "prefill_chunk_size", "low_memory",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
    "target_lookbehind", "is_assistant", "early_stopping", "length_penalty", "continuous_batching_config",
    "transformers_version", "_from_model_config",
})
NEUTRAL_SETTINGS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "typical_p": 1.0,
                    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "diversity_penalty": 0.0, "min_length": 0,
                    "min_new_tokens": 0, "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1,
                    "guidance_scale": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0}


def unsupported_settings(config) -> dict:
    """The settings of a prepared generation config that DFlash 2's own loop does not honour (warps with
    temperature, top-k and top-p only; returns no scores), with their values."""
    found = {}
    for name, value in config.to_dict().items():
        if name in OWN_LOOP_SETTINGS or value in (None, False, [], (), {}) or value == NEUTRAL_SETTINGS.get(name):
            continue
        found[name] = value
    return found


def _other_speculation(kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in ("prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate"))


def check_request(target, drafter, args, kwargs) -> None:
    """One clear error for a generate call DFlash 2 cannot serve, before transformers gets a chance to crash."""
    if getattr(drafter, "_target_parts", {}).get("head") is not target.get_output_embeddings():
        raise ValueError(
            "This DFlash 2 drafter is attached to another model. Call `drafter.attach(target)` for the model whose "
            "`generate` you call."
        )
    config = kwargs.get("generation_config") or target.generation_config
    num_beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if num_beams > 1:
        raise ValueError(
            f"DFlash 2 speculative decoding does greedy search and sampling, not beam search (num_beams={num_beams}). "
            "Drop num_beams, or drop assistant_model to use beam search without speculation."
        )
    num_sequences = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    if num_sequences > 1:
        raise ValueError(
            f"DFlash 2 speculative decoding returns one sequence per prompt (num_return_sequences={num_sequences}). "
            "Repeat the prompt in the batch instead, or drop assistant_model."
        )
    inputs = _inputs_of(args, kwargs)
    if inputs is None or not hasattr(inputs, "dim") or inputs.dim() != 2:
        return
    if inputs.shape[1] == 0:
        raise ValueError(
            f"The prompt is empty (input_ids of shape {tuple(inputs.shape)}): speculative decoding drafts from the "
            "last prompt token, so it needs at least one. Pass a non-empty prompt (the chat template's output, or the "
            "BOS token alone: torch.tensor([[tokenizer.bos_token_id]]))."
        )
    limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and inputs.shape[1] > limit:
        raise ValueError(
            f"The prompt has {inputs.shape[1]} tokens, more than the target's max_position_embeddings={limit}. "
            f"Shorten it to fewer than {limit} tokens, e.g. tokenizer(..., truncation=True, max_length={limit - 1})."
        )
    mask = kwargs.get("attention_mask")
    if mask is not None:  # every loop, plain batched decoding above the speculative batch limit included
        check_left_padded(mask)
    elif inputs.shape[0] > 1:
        _refuse_padding_without_mask(inputs, kwargs.get("pad_token_id", getattr(config, "pad_token_id", None)))


def _refuse_padding_without_mask(inputs, pad) -> None:
    """A batch without attention_mask: padding at either end would be read as prompt tokens."""
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        return
    pad = int(pad)
    ends, starts = torch.stack([inputs[:, -1] == pad, inputs[:, 0] == pad]).tolist()  # one host read
    for side, flags, verb, fix in (("right", ends, "ends", "Pad on the left (tokenizer.padding_side = 'left') and pass"),
                                   ("left", starts, "starts", "Pass")):
        if any(flags):
            raise ValueError(
                f"DFlash 2 got a batch of {inputs.shape[0]} prompts without attention_mask, and row {flags.index(True)} "
                f"{verb} with the pad token {pad}: a {side}-padded batch. {fix} the attention_mask the tokenizer "
                "returns (tokenizer(prompts, padding=True, return_tensors='pt'))."
            )


def _inputs_of(args, kwargs):
    return args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))


def _batch_size(args, kwargs) -> int:
    inputs = _inputs_of(args, kwargs)
    return inputs.shape[0] if inputs is not None and hasattr(inputs, "shape") and inputs.dim() == 2 else 1
