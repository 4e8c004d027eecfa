"""Split one DFlash 2 round into its parts: target verification, drafter pass, selection, and loop overhead.

    python -m dflash2.lab.profile_step [--drafter DIR] [--context 512] [--repeats 30]

Prints median times and the bound they imply: speedup <= tau * t_plain_step / (t_verify + t_draft + t_select).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def median_time(call, device, repeats: int) -> float:
    from dflash2.benchmarks.bench import synchronize

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

    from dflash2.generation.candidate_generator import DFlash2CandidateGenerator
    from dflash2.modeling_dflash2 import cache_keyword, tap_target_features
    from dflash2.tasks import chat_prompt_ids

    device = drafter.device
    block = drafter.config.block_size
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
    high = min(1000, target.config.vocab_size)  # ordinary tokens as filler, whatever the vocabulary's size
    filler = torch.randint(high // 10, high, (1, max(context - ids.shape[1], 0)), device=device)
    prefix = torch.cat([filler, ids], dim=1)
    cache = DynamicCache()
    cache_key = cache_keyword(target)
    out = target(input_ids=prefix, output_hidden_states=True, **{cache_key: cache})

    def verify(width):
        def call():
            target(input_ids=prefix[:, -width:], output_hidden_states=True, **{cache_key: cache})
            cache.crop(-width)
        return call

    generator = DFlash2CandidateGenerator(drafter, target.generation_config, None, prefix)
    taps = drafter.config.target_layer_ids
    features = tap_target_features(out.hidden_states, taps, slice(-4, None))
    generator.draft_block(prefix[:, -1], tap_target_features(out.hidden_states, taps, slice(None, -4)))

    def draft():
        generator.draft_block(prefix[:, -1], features)
        generator.cache.crop(-features.shape[1])
        generator.context.length -= features.shape[1]

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
    from dflash2.benchmarks.bench import timed_generate

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
def profile_static(target, tokenizer, drafter, prompt: str, repeats: int, max_new_tokens: int,
                   compile: bool | None = None) -> dict:
    """DFlash 2's own loop (`cache_implementation="static"`; on a GPU the round replayed as a CUDA graph): a measured
    generate call, then back-to-back runs of one whole round and of its parts -- the drafter layers alone, plus the
    LM head and top-k on the draft rows, plus the selector's pair scores and walk; the block's verification -- and of
    a 1-token target step (the floor a compiled plain decoder runs at), each run the way the round runs (captured
    graphs on a GPU; compiled first when the round is fused). head = (draft + head) - draft; select = (draft + head +
    select) - (draft + head); accept = round - (draft + head + select) - verify; host = measured round - replayed
    round (the host reads, the Python loop, the graph launches), the measured round being a generate call's time
    after its first round (a 2-token call's time taken off), per round."""
    from dflash2.benchmarks.bench import synchronize, timed_generate
    from dflash2.generation.graphs import CapturedGraph
    from dflash2.tasks import chat_prompt_ids

    device = drafter.device
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
    kwargs = dict(assistant_model=drafter, cache_implementation="static", attention_mask=torch.ones_like(ids),
                  max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                  compile=compile)
    target.generate(ids, **kwargs)  # builds the round core and captures (compiles) its round
    runner = drafter.round_runners(batch=1)[-1]
    core = runner.core
    # a call that stops after its first round: prefill and set-up, to take out of the measured per-round time
    _, first_total, _ = timed_generate(target, ids, {**kwargs, "max_new_tokens": 2}, device)
    first_forwards = drafter.last_stats.target_forwards
    _, total, _ = timed_generate(target, ids, kwargs, device)
    stats = drafter.last_stats
    fused = runner.kind == "graph (fused)"

    # the state the call ended in (every row done, so rounds replay without advancing it)
    block = torch.cat([core.anchor.view(-1, 1), core.mask_row.expand(core.batch, -1)], dim=1)

    def draft_and_head():  # + LM head on the draft rows and their top-k
        hidden = core.draft_block()
        return drafter.unary_logits(hidden[:, 1:]).float().topk(drafter.config.selector_top_k, dim=-1)

    def draft_and_select():
        return core.propose(core.draft_block()).tokens

    def plain_step():  # one token through the target at the anchor's column
        columns = core.start.view(-1, 1)
        core.target_cache.set_write_columns(columns)
        return target(input_ids=block[:, :1], position_ids=columns - core.first_column.view(-1, 1),
                      attention_mask=core.target_masks(columns), use_cache=True,
                      **{core.cache_keyword: core.target_cache}).logits

    def as_the_round_runs(function):
        if fused:
            function = torch.compile(function, mode="default", dynamic=False)
        return CapturedGraph(function) if device.type == "cuda" and runner.kind.startswith("graph") else function

    def back_to_back(call) -> float:  # no synchronisation between calls: what the device needs per call
        for _ in range(3):
            call()
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize(device)
        return (time.perf_counter() - started) / repeats

    timings = {
        "t_round_replay": back_to_back(runner),
        "t_draft_replay": back_to_back(as_the_round_runs(core.draft_block)),
        "t_draft_head_replay": back_to_back(as_the_round_runs(draft_and_head)),
        "t_draft_select_replay": back_to_back(as_the_round_runs(draft_and_select)),
        "t_verify_replay": back_to_back(as_the_round_runs(lambda: core.verify(block))),
        "t_plain_step_replay": back_to_back(as_the_round_runs(plain_step)),
    }
    timings["t_head_replay"] = timings["t_draft_head_replay"] - timings["t_draft_replay"]
    timings["t_select_replay"] = timings["t_draft_select_replay"] - timings["t_draft_head_replay"]
    timings["t_accept_replay"] = (timings["t_round_replay"] - timings["t_draft_select_replay"]
                                  - timings["t_verify_replay"])
    timings["t_round_measured"] = (total - first_total) / max(stats.target_forwards - first_forwards, 1)
    timings["t_host"] = timings["t_round_measured"] - timings["t_round_replay"]
    timings["tau"] = stats.acceptance_length
    timings["rounds"] = stats.target_forwards - 1
    timings["fused"] = float(fused)
    # what the round costs against the floor: tau tokens per round vs one token per 1-token step
    timings["speedup_bound_vs_graph_floor"] = stats.acceptance_length * timings["t_plain_step_replay"] / timings[
        "t_round_replay"]
    timings["speedup_bound_with_host"] = stats.acceptance_length * timings["t_plain_step_replay"] / timings[
        "t_round_measured"]
    return timings




def main(argv=None):
    from dflash2.pairs import add_model_arguments, load_pair

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
