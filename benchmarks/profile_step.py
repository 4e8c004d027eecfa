"""Split one DFlash 2 round into its parts: target verification, drafter pass, selection, and loop overhead.

    python -m benchmarks.profile_step [--drafter DIR] [--context 512] [--repeats 30]

Prints median times and the bound they imply: speedup <= tau * t_plain_step / (t_verify + t_draft + t_select).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def median_time(call, device, repeats: int) -> float:
    from benchmarks.bench import synchronize

    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@torch.no_grad()
def profile(target, tokenizer, drafter, prompt: str, context: int, repeats: int, max_new_tokens: int) -> dict:
    from transformers import DynamicCache

    from generation.candidate_generator import DFlash2CandidateGenerator
    from generation.integration import chat_prompt_ids

    device = drafter.device
    block = drafter.config.block_size
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
    high = min(1000, target.config.vocab_size)  # ordinary tokens as filler, whatever the vocabulary's size
    filler = torch.randint(high // 10, high, (1, max(context - ids.shape[1], 0)), device=device)
    prefix = torch.cat([filler, ids], dim=1)
    cache = DynamicCache()
    out = target(input_ids=prefix, cache=cache, output_hidden_states=True) if _takes_cache(target) else target(
        input_ids=prefix, past_key_values=cache, output_hidden_states=True)
    cache_key = "cache" if _takes_cache(target) else "past_key_values"

    def verify(width):
        def call():
            target(input_ids=prefix[:, -width:], output_hidden_states=True, **{cache_key: cache})
            cache.crop(-width)
        return call

    generator = DFlash2CandidateGenerator(drafter, target.generation_config, None, prefix)
    features = torch.cat([out.hidden_states[i + 1][:, -4:] for i in drafter.config.target_layer_ids], dim=-1)
    generator.draft_block(prefix[:, -1], torch.cat([out.hidden_states[i + 1][:, :-4] for i in
                                                    drafter.config.target_layer_ids], dim=-1))

    def draft():
        generator.draft_block(prefix[:, -1], features)
        generator.cache.crop(-features.shape[1])
        generator.context_length -= features.shape[1]

    hidden = generator.draft_block(prefix[:, -1], features)

    def select():
        drafter.propose(prefix[:, -1], hidden).tokens.tolist()  # .tolist(): the host needs the drafts

    timings = {
        "t_plain_step": median_time(verify(1), device, repeats),
        "t_verify": median_time(verify(block), device, repeats),
        "t_draft": median_time(draft, device, repeats),
        "t_select": median_time(select, device, repeats),
    }
    # real generate calls: the whole round, loop overhead included, against plain decoding
    from benchmarks.bench import timed_generate

    speculative = dict(assistant_model=drafter, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                       do_sample=False)
    target.generate(ids, **{**speculative, "max_new_tokens": 16})  # warm-up
    _, total, _ = timed_generate(target, ids, speculative, device)
    stats = drafter.last_stats
    plain, plain_total, _ = timed_generate(target, ids, dict(attention_mask=torch.ones_like(ids),
                                                             max_new_tokens=max_new_tokens, do_sample=False), device)
    gen_ids = ids
    rounds = stats.target_forwards
    timings["t_round_measured"] = total / rounds
    timings["t_plain_step_measured"] = plain_total / (plain.shape[1] - gen_ids.shape[1])
    timings["t_overhead"] = timings["t_round_measured"] - timings["t_verify"] - timings["t_draft"] - timings["t_select"]
    tau = stats.acceptance_length
    timings["tau"] = tau
    timings["speedup_bound"] = tau * timings["t_plain_step"] / (timings["t_verify"] + timings["t_draft"] +
                                                               timings["t_select"])
    timings["speedup_measured"] = (stats.completion_tokens / total) / ((plain.shape[1] - gen_ids.shape[1]) /
                                                                       plain_total)
    timings["tokens"] = stats.completion_tokens
    return timings


@torch.no_grad()
def profile_static(target, tokenizer, drafter, prompt: str, repeats: int, max_new_tokens: int) -> dict:
    """The fixed-shape loop (`cache_implementation="static"`, CUDA graphs on a GPU): a measured generate call, then
    graph replays of one whole round and of its parts -- the drafter layers alone, plus the LM head and top-k on the
    draft rows, plus the selector's pair scores and walk; the 8-token verification -- and of a 1-token target step (the
    floor a compiled plain decoder runs at). head = (draft + head) - draft; select = (draft + head + select) -
    (draft + head); accept = round - (draft + head + select) - verify; host = measured round - replayed round (the
    per-round synchronisation, the Python loop, the graph launches), the measured round being a generate call's time
    after its first round (a 2-token call's time taken off), per round."""
    from benchmarks.bench import synchronize, timed_generate
    from generation.fast_path import Sampling
    from generation.integration import chat_prompt_ids

    device = drafter.device
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
    kwargs = dict(assistant_model=drafter, cache_implementation="static", attention_mask=torch.ones_like(ids),
                  max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    target.generate(ids, **kwargs)  # compiles (or loads) the round's graphs
    # a call that stops after its first round: prefill and set-up, to take out of the measured per-round time
    _, first_total, _ = timed_generate(target, ids, {**kwargs, "max_new_tokens": 2}, device)
    first_forwards = drafter.last_stats.target_forwards
    _, total, _ = timed_generate(target, ids, kwargs, device)
    stats = drafter.last_stats
    decoder = drafter.__dict__["_static_decoder"]
    compiled = decoder.compiled

    # the state after the prefill and one round: fixed inputs to replay
    start = torch.tensor(0, device=device)
    logits, prompt_features = decoder.verify(ids, start)
    anchor = logits[0, -1].argmax().view(())
    prompt_positions = torch.arange(ids.shape[1], device=device)
    start = torch.tensor(ids.shape[1], device=device)
    block, _, _, features = decoder._round(anchor, start, prompt_features, prompt_positions, Sampling(), None)
    write_positions = start + decoder.block_offsets
    start = start + 1

    def draft_and_head(anchor, start, features, write_positions):  # + LM head on the draft rows and their top-k
        hidden = decoder.draft_block(anchor, start, features, write_positions)
        return drafter.unary_logits(hidden[:, 1:]).float().topk(drafter.config.selector_top_k, dim=-1)

    def draft_and_select(anchor, start, features, write_positions):
        return drafter.propose(anchor.view(1), decoder.draft_block(anchor, start, features, write_positions)).tokens

    def graph(function):  # each piece captured on its own, as the round is
        return torch.compile(function, mode="reduce-overhead", dynamic=False) if compiled else function

    def replayed(function, *arguments):
        def call():
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            function(*arguments)
        return call

    def back_to_back(call) -> float:  # no synchronisation between calls: what the device needs per call
        for _ in range(3):
            call()
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize(device)
        return (time.perf_counter() - started) / repeats

    verify = graph(decoder.verify)  # static shapes: one graph for the 8-token block, one for the 1-token step
    draft_inputs = (anchor, start, features, write_positions)
    timings = {
        "t_round_replay": back_to_back(replayed(decoder.round, *draft_inputs, Sampling(), None)),
        "t_draft_replay": back_to_back(replayed(graph(decoder.draft_block), *draft_inputs)),
        "t_draft_head_replay": back_to_back(replayed(graph(draft_and_head), *draft_inputs)),
        "t_draft_select_replay": back_to_back(replayed(graph(draft_and_select), *draft_inputs)),
        "t_verify_replay": back_to_back(replayed(verify, block, start)),
        "t_plain_step_replay": back_to_back(replayed(verify, block[:, :1], start)),
    }
    timings["t_head_replay"] = timings["t_draft_head_replay"] - timings["t_draft_replay"]
    timings["t_select_replay"] = timings["t_draft_select_replay"] - timings["t_draft_head_replay"]
    timings["t_accept_replay"] = (timings["t_round_replay"] - timings["t_draft_select_replay"]
                                  - timings["t_verify_replay"])
    timings["t_round_measured"] = (total - first_total) / max(stats.target_forwards - first_forwards, 1)
    timings["t_host"] = timings["t_round_measured"] - timings["t_round_replay"]
    timings["tau"] = stats.acceptance_length
    timings["rounds"] = stats.target_forwards - 1
    timings["compiled"] = float(compiled)
    # what the round costs against the floor: tau tokens per round vs one token per 1-token graph step
    timings["speedup_bound_vs_graph_floor"] = stats.acceptance_length * timings["t_plain_step_replay"] / timings[
        "t_round_replay"]
    timings["speedup_bound_with_host"] = stats.acceptance_length * timings["t_plain_step_replay"] / timings[
        "t_round_measured"]
    return timings


def _takes_cache(model) -> bool:
    import inspect

    return "cache" in inspect.signature(model.forward).parameters


def main(argv=None):
    from dflash2_cli import add_model_arguments, load_pair

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    parser.add_argument("--context", type=int, default=0,
                        help="pad the prompt with random tokens to this cache length for the isolated timings (0: the"
                             " prompt alone, the context the measured generate call starts from)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--static", action="store_true",
                        help="profile the fixed-shape loop (cache_implementation='static', CUDA graphs on a GPU)")
    args = parser.parse_args(argv)
    target, tokenizer, drafter = load_pair(args)
    if args.static:
        timings = profile_static(target, tokenizer, drafter, args.prompt, args.repeats, args.max_new_tokens)
    else:
        timings = profile(target, tokenizer, drafter, args.prompt, args.context, args.repeats, args.max_new_tokens)
    print(json.dumps({k: round(v * 1000, 3) if k.startswith("t_") else round(v, 3) for k, v in timings.items()},
                     indent=1))
    print("times in ms; speedup_bound = tau * t_plain_step / (t_verify + t_draft + t_select)" if not args.static else
          "times in ms; speedup_bound_vs_graph_floor = tau * t_plain_step_replay / t_round_replay")


if __name__ == "__main__":
    main()
