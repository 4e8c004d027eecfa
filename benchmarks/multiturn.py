"""The cost of a follow-up turn in a long conversation: the cache of the last turn passed back against a full re-encode.

    python -m dflash2.benchmarks.multiturn --device cuda --out runs/multiturn.json
    python -m dflash2.benchmarks.multiturn --device cpu --history-tokens 512 --max-new-tokens 32

Builds a conversation of about `--history-tokens` tokens from offline text (MT-Bench questions as user turns,
HumanEval prompts as the assistant's answers), lets the model answer it (turn A), then asks one more question (turn B)
in two ways: with turn A's cache passed back (`past_key_values=out.past_key_values`, the whole conversation's ids) and
from scratch. For transformers' assisted loop (`loop="transformers"`) and DFlash 2's own loop (the default), it reports
per way:
- `encoded_tokens`: the tokens turn B's prefill encodes (the widths of the target forwards of a one-token turn B, listed
  in `prefill_widths`: chunks of at most 2048; a prefill replayed from a captured CUDA graph calls no forward and
  shows none, i.e. None);
- `first_token_s`: the median wall time of turn B with max_new_tokens=1 (prefill and first token);
- `turn_s`: the median wall time of turn B with `--max-new-tokens`, and its tokens;
- `same_tokens`: whether the two ways answered alike (always in fp32; in bf16 a different prefill width may move an
  argmax).
Each timed call with the cache gets a cache in the state turn A left (the assisted loop's is copied, the own loop's is
valid for one follow-up on its buffers, so turn A runs again, untimed).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from dflash2.benchmarks.common import wall_timed
from dflash2.modeling_dflash2 import CACHE_NAME

FOLLOW_UP = "Thank you. Now summarise our whole conversation in three sentences."
LOOPS = {"assisted": {"loop": "transformers"}, "own_loop": {"loop": "dflash2"}}


def long_conversation(tokenizer, history_tokens: int) -> list[dict]:
    """Chat messages of at least `history_tokens` templated tokens, ending with a user question."""
    from dflash2.tasks import conversation_ids, task_prompts

    questions, answers = task_prompts("mtbench"), task_prompts("humaneval")
    messages = [{"role": "user", "content": questions[0]}]
    turn = 1
    while len(conversation_ids(tokenizer, messages)) < history_tokens:
        messages += [{"role": "assistant", "content": answers[turn % len(answers)]},
                     {"role": "user", "content": questions[turn % len(questions)]}]
        turn += 1
    return messages


def run_multiturn(target, tokenizer, drafter, history_tokens: int = 4096, max_new_tokens: int = 64,
                  repeats: int = 3, loops=tuple(LOOPS)) -> dict:
    from dflash2.benchmarks.common import settle
    from dflash2.tasks import conversation_ids

    device = drafter.device
    messages = long_conversation(tokenizer, history_tokens)
    ids_a = torch.tensor([conversation_ids(tokenizer, messages)], device=device)
    common = dict(assistant_model=drafter, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    results = {"history_tokens": ids_a.shape[1], "max_new_tokens": max_new_tokens, "repeats": repeats}
    for loop in loops:
        settings = {**common, **LOOPS[loop]}

        def turn_a():
            return call(target, ids_a, device, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **settings)

        turn_a()  # warm-up: buffers, captured graphs
        settle(drafter, turn_a)  # the own loop on one GPU: switch to the round fused in the background
        out_a, seconds_a, _ = turn_a()
        answer = tokenizer.decode(out_a.sequences[0, ids_a.shape[1]:], skip_special_tokens=True)
        follow_up = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        ids_b = torch.tensor([conversation_ids(tokenizer, follow_up)], device=device)

        def cache_of_turn_a():
            if loop == "assisted":
                return copy.deepcopy(getattr(out_a, CACHE_NAME))
            return getattr(turn_a()[0], CACHE_NAME)  # the own loop's cache continues once on its buffers

        row = {"turn_a_s": round(seconds_a, 4), "follow_up_tokens": ids_b.shape[1]}
        answers = {}
        for way in ("cache", "full_encode"):
            firsts, turns, prefill = [], [], []
            for _ in range(repeats):
                for new, times in ((1, firsts), (max_new_tokens, turns)):
                    extra = {CACHE_NAME: cache_of_turn_a()} if way == "cache" else {}
                    out, seconds, widths = call(target, ids_b, device, max_new_tokens=new, **settings, **extra)
                    times.append(seconds)
                    prefill = widths if new == 1 else prefill  # one new token: the prefill's forwards only
            answers[way] = out[0, ids_b.shape[1]:].tolist()
            row[way] = {"encoded_tokens": sum(prefill) if prefill else None, "prefill_widths": prefill,
                        "first_token_s": round(statistics.median(firsts), 4),
                        "turn_s": round(statistics.median(turns), 4), "tokens": len(answers[way])}
        row["same_tokens"] = answers["cache"] == answers["full_encode"]
        row["first_token_speedup"] = round(row["full_encode"]["first_token_s"] / row["cache"]["first_token_s"], 2)
        results[loop] = row
    return results


def call(target, ids, device, **kwargs):
    """One generate call: (output, wall seconds, the widths of its target forwards that ran eagerly)."""
    widths = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        out, seconds = wall_timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs), device)
    finally:
        handle.remove()
    return out, seconds, widths


def main(argv=None):
    from dflash2.benchmarks.common import command_line, finish_report
    from dflash2.model_args import add_model_arguments, load_pair, positive_int

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, max_new_tokens=64)
    parser.add_argument("--history-tokens", type=positive_int, default=4096,
                        help="tokens of conversation before the follow-up turn (default 4096; e.g. 512 on a CPU)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls per measure (the median)")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    loops = tuple(args.loops.split(","))
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown:
        parser.error(f"--loops: unknown {unknown}; choose from {', '.join(LOOPS)}")
    target, tokenizer, drafter = load_pair(args)
    results = {"settings": {"command": command_line("dflash2.benchmarks.multiturn", argv),
                            "device": (torch.cuda.get_device_name(drafter.device) if drafter.device.type == "cuda"
                                       else "cpu"), "dtype": str(drafter.dtype), "torch": torch.__version__}}
    results.update(run_multiturn(target, tokenizer, drafter, args.history_tokens, args.max_new_tokens, args.repeats,
                                 loops))
    return finish_report(results, args.out)


if __name__ == "__main__":
    main()
