"""The training recipe on a tiny target: masks and anchors against naive loops, learning, checkpoints, resuming in
several jobs (by steps and by a time budget), epochs, the loss split the way several processes split it, block 16."""

import dataclasses
import json
import math
import types

import pytest
import torch

from helpers import VOCAB, tiny_drafter, tiny_target
from dflash2.training import trainer
from dflash2.training.trainer import (
    SoftLabels,
    TrainConfig,
    block_attention_mask,
    block_inputs,
    collate,
    default_gamma,
    drafter_loss_terms,
    drafter_losses,
    greedy_walk,
    held_out_acceptance,
    length_buckets,
    planned_steps,
    sample_anchors,
    save_checkpoint,
    target_features_and_labels,
    train,
)


def test_block_attention_mask_matches_naive_rule():
    anchors = torch.tensor([[2, 5], [1, 3]])
    length, block = 7, 3
    mask = block_attention_mask(anchors, length, block)
    assert mask.shape == (2, 1, 6, 7 + 6)
    for b in range(2):
        for row in range(6):
            n = row // block
            for key in range(length + 6):
                if key < length:
                    allowed = key < anchors[b, n]
                else:
                    allowed = (key - length) // block == n
                assert bool(mask[b, 0, row, key]) == allowed


def test_anchors_leave_a_response_token_to_predict():
    response = torch.zeros(2, 12, dtype=torch.bool)
    response[0, 5:] = True
    anchors = sample_anchors(response, 20, torch.Generator().manual_seed(0))
    assert anchors[1].eq(-1).all()  # no response: no anchors
    assert ((anchors[0] >= 4) & (anchors[0] <= 10)).all()


def test_block_inputs_targets_are_the_tokens_at_anchor_plus_k():
    ids = torch.arange(10, 20).unsqueeze(0)
    block_ids, positions, targets = block_inputs(ids, torch.tensor([[3, 8]]), 4, mask_token_id=99)
    assert block_ids.tolist() == [[13, 99, 99, 99, 18, 99, 99, 99]]
    assert positions[0, 10:].tolist() == [3, 4, 5, 6, 8, 9, 10, 11]
    assert targets[0].tolist() == [[13, 14, 15, 16], [18, 19, -100, -100]]


def self_distilled(target, count, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        prompt = torch.randint(4, VOCAB, (1, 4), generator=generator)
        out = target.generate(prompt, max_new_tokens=length, do_sample=False, eos_token_id=None)
        rows.append({"input_ids": out[0].tolist(), "prompt_length": 4})
    return rows


def test_training_lowers_loss_and_raises_tau(tmp_path):
    target = tiny_target("llama", seed=11)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    data = self_distilled(target, 48)
    held_out, sequences = data[:8], data[8:]
    drafter = tiny_drafter(target, seed=3, identity=True, block_size=4).bind_target(target)
    untrained = held_out_acceptance(drafter, target, [_batch(held_out)], drafter.config.target_layer_ids,
                                    torch.device("cpu"))
    config = TrainConfig(anchors_per_sequence=16, batch_size=8, max_length=64, learning_rate=3e-3, max_steps=300,
                         eval_every=1000, checkpoint_every=1000, log_every=50)
    history = train(drafter, target, sequences, config, tmp_path, held_out=held_out, progress=False,
                    log=lambda line: None)
    losses = [h["loss"] for h in history if "loss" in h]
    trained = history[-1]
    assert losses[-1] < 0.6 * losses[0]
    assert trained["held_out_anchor_mean"] > untrained["anchor_mean"] + 0.3, (untrained, trained)
    assert trained["held_out_tau"] > untrained["tau"] + 0.1, (untrained, trained)
    assert (tmp_path / "checkpoint" / "drafter" / "config.json").exists()


def test_resume_continues_from_the_checkpoint(tmp_path):
    target = tiny_target("qwen3", seed=12)
    data = self_distilled(target, 10, length=12)
    drafter = tiny_drafter(target, block_size=4).bind_target(target)
    config = TrainConfig(anchors_per_sequence=4, batch_size=4, max_length=32, max_steps=3, checkpoint_every=1000)
    train(drafter, target, data, config, tmp_path, progress=False, log=lambda line: None)
    lines = []
    config.max_steps = 5
    train(drafter, target, data, config, tmp_path, progress=False, log=lines.append)
    assert json.loads(lines[0])["resumed"] == 3
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 5


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    optimizer = torch.optim.AdamW(drafter.parameters())
    save_checkpoint(drafter, optimizer, 1, tmp_path / "ckpt", TrainConfig())
    before = sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))

    def explode(*args, **kwargs):
        raise OSError("disk full")

    contents = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    monkeypatch.setattr(torch, "save", explode)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(drafter, optimizer, 2, tmp_path / "ckpt", TrainConfig())
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before  # the old checkpoint is intact
    assert all(p.read_bytes() == data for p, data in contents.items())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging folder left behind


def _batch(rows):
    return collate(rows, 64, 0)


# ------------------------------------------------------------------------------------------------ resuming in jobs
def _frozen(target):
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    return target


def _weights(directory):
    from safetensors.torch import load_file

    return {k: v for f in sorted((directory / "checkpoint" / "drafter").glob("*.safetensors"))
            for k, v in load_file(f).items()}


def _quiet(config, drafter, target, data, folder, **kwargs):
    return train(drafter, target, data, config, folder, progress=False, log=lambda line: None, **kwargs)


def test_two_jobs_with_resume_reach_the_weights_of_one_job(tmp_path):
    """8 steps in one job == 5 steps, then a resumed job to the end (fp32, bit for bit): the resumed job gets the
    weights, the AdamW moments, the schedule position and the data order (the cut falls inside an epoch) from the
    checkpoint. A restart from the same weights without the rest of the state lands elsewhere. The memory probe at
    each job's start changes nothing."""
    target = _frozen(tiny_target("qwen3", seed=12))
    data = self_distilled(target, 10, length=16)  # 3 global batches of 4 per epoch: step 5 is inside epoch 2
    config = TrainConfig(anchors_per_sequence=4, batch_size=4, max_length=32, max_steps=8, learning_rate=3e-3,
                         warmup_fraction=0.25, checkpoint_every=1000, log_every=1, memory_probe=True)
    lines = []
    train(tiny_drafter(target, block_size=4).bind_target(target), target, data, config, tmp_path / "one",
          progress=False, log=lines.append)
    assert json.loads(lines[0])["memory_probe"] == "longest batch"  # a forward and backward without an update:
    _quiet(dataclasses.replace(config, memory_probe=False), tiny_drafter(target, block_size=4).bind_target(target),
           target, data, tmp_path / "no-probe")
    assert all(torch.equal(a, b) for a, b in zip(_weights(tmp_path / "one").values(),
                                                  _weights(tmp_path / "no-probe").values()))
    _quiet(dataclasses.replace(config, job_max_steps=5), tiny_drafter(target, block_size=4).bind_target(target),
           target, data, tmp_path / "two")
    first_job = torch.load(tmp_path / "two" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert (first_job["step"], first_job["epoch"], first_job["batch_in_epoch"]) == (5, 1, 2)
    assert first_job["planned_steps"] == 8 and set(first_job["rng"]) >= {"torch", "python"}
    assert first_job["optimizer"]["state"], "the optimizer state is in the checkpoint"
    half_way = _weights(tmp_path / "two")
    lines = []
    other_init = tiny_drafter(target, seed=99, block_size=4).bind_target(target)  # weights must come from the file
    train(other_init, target, data, config, tmp_path / "two", progress=False, log=lines.append)
    assert json.loads(lines[0])["resumed"] == 5
    one, two = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one), max((one[k] - two[k]).abs().max() for k in one)
    assert max(float((one[k] - half_way[k]).abs().max()) for k in one) > 1e-3  # the second job did train
    state_one = torch.load(tmp_path / "one" / "checkpoint" / "trainer_state.pt", weights_only=False)
    state_two = torch.load(tmp_path / "two" / "checkpoint" / "trainer_state.pt", weights_only=False)
    for key, moments in state_one["optimizer"]["state"].items():
        assert torch.equal(moments["exp_avg_sq"], state_two["optimizer"]["state"][key]["exp_avg_sq"])

    restarted = tiny_drafter(target, block_size=4).bind_target(target)
    restarted.load_state_dict({**restarted.state_dict(), **half_way})
    _quiet(dataclasses.replace(config, max_steps=3), restarted, target, data, tmp_path / "restart")
    again = _weights(tmp_path / "restart")
    assert max(float((one[k] - again[k]).abs().max()) for k in one) > 1e-4


class _Clock:
    """Training time that passes only inside training steps (0.125 s each, exact in binary)."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def test_a_time_budget_in_two_jobs_follows_the_schedule_of_one_job(tmp_path, monkeypatch):
    """--time-budget 2.5 in one job == two jobs of --job-time-limit 1.25 each: the second job continues the time
    consumed (the learning rate and the selector ramp follow the consumed time), 20 steps either way."""
    clock = _Clock()
    forward = trainer.target_features_and_labels

    def ticking(*args, **kwargs):
        clock.now += 0.125
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(time=clock.time))
    monkeypatch.setattr(trainer, "target_features_and_labels", ticking)
    target = _frozen(tiny_target("qwen3", seed=12))
    data = self_distilled(target, 10, length=16)
    config = TrainConfig(anchors_per_sequence=4, batch_size=4, max_length=32, max_steps=10 ** 6, time_budget_s=2.5,
                         learning_rate=3e-3, checkpoint_every=1000, log_every=1)
    one = _quiet(config, tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path / "one")
    in_jobs = []
    for _ in range(2):
        in_jobs += _quiet(dataclasses.replace(config, job_time_limit_s=1.25),
                          tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path / "two")
    state = torch.load(tmp_path / "two" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 20 and state["time_consumed_s"] == 2.5
    assert [(h["step"], h["lr"]) for h in one] == [(h["step"], h["lr"]) for h in in_jobs]
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a third job has nothing left to do: the budget is spent
    assert _quiet(dataclasses.replace(config, job_time_limit_s=1.25),
                  tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path / "two") == []


def test_resume_refuses_another_global_batch(tmp_path):
    target = _frozen(tiny_target("qwen3", seed=12))
    data = self_distilled(target, 10, length=12)
    config = TrainConfig(anchors_per_sequence=4, batch_size=4, max_length=32, max_steps=2, checkpoint_every=1000)
    _quiet(config, tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path)
    with pytest.raises(ValueError, match="global batches of 4"):
        _quiet(dataclasses.replace(config, batch_size=2, max_steps=4),
               tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path)


# ------------------------------------------------------------------------------------------------ data order, anchors
def test_one_epoch_visits_every_sequence_once_and_ends_the_schedule(tmp_path, monkeypatch):
    target = _frozen(tiny_target("qwen3", seed=12))
    data = self_distilled(target, 12, length=20, seed=5)
    for i, row in enumerate(data):  # distinct lengths, so a row is known by its length
        row["input_ids"] = row["input_ids"][: 6 + i]
    seen = []

    def recording(rows, *args):
        seen.append(sorted(len(r["input_ids"]) for r in rows))
        return collate(rows, *args)

    monkeypatch.setattr(trainer, "collate", recording)
    config = TrainConfig(anchors_per_sequence=2, batch_size=4, max_length=32, max_steps=100, epochs=1.0,
                         checkpoint_every=1000)
    _quiet(config, tiny_drafter(target, block_size=4).bind_target(target), target, data, tmp_path)
    assert len(seen) == 3  # 12 sequences / 4 per step: the epoch ends the schedule
    assert sorted(n for batch in seen for n in batch) == list(range(6, 18))
    assert seen != sorted(seen), "buckets are visited in a shuffled order"
    assert all(batch == list(range(batch[0], batch[0] + 4)) for batch in seen), "each bucket holds similar lengths"
    assert planned_steps(dataclasses.replace(config, epochs=2.5), 3) == 8
    assert planned_steps(dataclasses.replace(config, epochs=2.5, max_steps=5), 3) == 5


def test_a_long_row_keeps_its_response_in_the_window():
    def row(prompt, response):
        return {"input_ids": list(range(100, 100 + prompt + response)), "prompt_length": prompt}

    ids, mask = collate([row(30, 10), row(5, 3)], 64, 0)  # fits: unchanged, right-padded
    assert ids[0].tolist() == list(range(100, 140)) and mask[0].nonzero().flatten().tolist() == list(range(30, 40))
    assert ids[1, 8:].eq(0).all() and mask[1].nonzero().flatten().tolist() == [5, 6, 7]
    ids, mask = collate([row(100, 20)], 40, 0)  # long prompt: the whole response and the prompt's last 20 tokens
    assert ids[0].tolist() == list(range(180, 220)) and mask[0].sum() == 20 and not mask[0, :20].any()
    ids, mask = collate([row(100, 80)], 40, 0)  # long response: a quarter-window of prompt, the response's start
    assert ids[0].tolist() == list(range(190, 230)) and mask[0].nonzero().flatten().tolist() == list(range(10, 40))
    ids, mask = collate([row(4, 80)], 40, 0)  # short prompt, long response: from the start
    assert ids[0].tolist() == list(range(100, 140)) and mask[0].sum() == 36


def test_length_buckets_are_whole_and_cover_every_sequence():
    rows = [{"input_ids": [0] * n} for n in (5, 3, 9, 7, 1, 4, 8)]
    buckets = length_buckets(rows, 3)
    assert all(len(b) == 3 for b in buckets) and len(buckets) == 3
    assert set().union(*buckets) == set(range(7))
    assert length_buckets(rows[:2], 4) == [[1, 1, 0, 0]]  # fewer sequences than a batch: they repeat


def test_unique_anchors_use_each_position_once():
    response = torch.zeros(3, 12, dtype=torch.bool)
    response[0, 4:] = True  # positions 3..10 valid: 8
    response[1, 9:] = True  # positions 8..10: 3
    anchors = sample_anchors(response, 20, torch.Generator().manual_seed(0), unique=True)
    assert anchors.shape == (3, 8)
    assert anchors[0].tolist() == list(range(3, 11))
    assert anchors[1].tolist() == [8, 9, 10] + [-1] * 5
    assert anchors[2].eq(-1).all()
    repeated = sample_anchors(response, 20, torch.Generator().manual_seed(0))
    assert repeated.shape == (3, 20) and (repeated[1] >= 8).all()


# ------------------------------------------------------------------------------------------------ the loss in shares
def test_shares_normalised_by_the_global_weights_give_the_whole_batch_gradient():
    """What DrafterObjective does across processes, in one process: each half of a batch divides its weighted sums by
    the weights of the whole batch; the summed gradients equal the whole batch's. The mean of per-half means (what
    plain gradient averaging of per-process losses would give) does not."""
    target = _frozen(tiny_target("llama", seed=11))
    data = self_distilled(target, 4, length=20)
    data[0]["input_ids"] = data[0]["input_ids"][:10]  # halves with different numbers of weighted rows
    token_ids, response_mask = collate(data, 64, 0)
    drafter = tiny_drafter(target, block_size=4).bind_target(target)
    anchors = sample_anchors(response_mask, 6, torch.Generator().manual_seed(3))
    features = trainer.target_features_and_logits(target, token_ids, drafter.config.target_layer_ids)[0]
    gamma, selector_weight = default_gamma(4), 0.5

    def gradient(loss):
        drafter.zero_grad()
        loss.backward(retain_graph=True)
        return torch.cat([p.grad.flatten() for p in drafter.parameters()])

    token_loss, selector_loss, _ = drafter_losses(drafter, features, token_ids, response_mask, anchors, gamma)
    whole = gradient(token_loss + selector_weight * selector_loss)
    halves = [slice(0, 2), slice(2, 4)]
    terms = [drafter_loss_terms(drafter, features[h], token_ids[h], response_mask[h], anchors[h], gamma)
             for h in halves]
    token_total = sum(t["token_weight"] for t in terms).detach()
    selector_total = sum(t["selector_weight"] for t in terms).detach()
    assert not torch.isclose(terms[0]["token_weight"], terms[1]["token_weight"])
    shares = sum(gradient(t["token_sum"] / token_total + selector_weight * t["selector_sum"] / selector_total)
                 for t in terms)
    torch.testing.assert_close(shares, whole, rtol=1e-4, atol=1e-6)
    means = sum(gradient(t["token_sum"] / t["token_weight"] + selector_weight * t["selector_sum"]
                         / t["selector_weight"]) for t in terms) / 2
    assert (means - whole).abs().max() > 1e-3 * whole.abs().max()


# ------------------------------------------------------------------------------------------------ block size 16
def test_block_size_16_trains_and_its_held_out_tau_rises(tmp_path):
    target = _frozen(tiny_target("llama", seed=11))
    data = self_distilled(target, 40, length=40)
    held_out, sequences = data[:8], data[8:]
    drafter = tiny_drafter(target, seed=3, identity=True, block_size=16).bind_target(target)
    assert default_gamma(16) == 7.0
    untrained = held_out_acceptance(drafter, target, [_batch(held_out)], drafter.config.target_layer_ids,
                                    torch.device("cpu"))
    config = TrainConfig(anchors_per_sequence=8, batch_size=8, max_length=64, learning_rate=3e-3, max_steps=150,
                         eval_every=1000, checkpoint_every=1000, log_every=50)
    history = _quiet(config, drafter, target, sequences, tmp_path, held_out=held_out)
    trained = history[-1]
    assert trained["held_out_anchor_mean"] > untrained["anchor_mean"] + 0.5, (untrained, trained)  # blocks scored
    assert trained["held_out_tau"] > untrained["tau"] + 0.1, (untrained, trained)
    assert history[0]["step"] == 0 and history[0]["held_out_tau"] == untrained["tau"]  # where the run started
    assert len(next(h for h in history if "loss" in h)["top1_by_position"]) == 15


def test_greedy_walk_against_a_naive_decoding_loop():
    """`greedy_walk` is the round-by-round loop: each round adds its accepted drafts and one token of the target."""
    accepted = {5: 3, 9: 0, 10: 7, 12: 1}
    tokens, forwards = greedy_walk(accepted, first=5, end=15)
    produced, rounds, anchor = 1, 0, 5  # the prefill writes position 5
    while produced < 10:
        gained = min(accepted.get(anchor, 0) + 1, 10 - produced)
        produced, rounds, anchor = produced + gained, rounds + 1, anchor + gained
    assert (tokens, forwards) == (10, 1 + rounds) == (10, 4)  # anchors 5 -> 9 -> 10 -> 14 (capped at the end)
    assert greedy_walk({}, first=3, end=4) == (1, 1)


@pytest.mark.parametrize("loop", ["assisted", "static"])
def test_the_held_out_tau_counts_what_decoding_counts(tmp_path, loop):
    """The trainer's held-out estimate (one teacher-forced pass, drafts at every position, `greedy_walk`) gives answer
    by answer the tokens and target forwards that decoding counts on the same prompts (fp32, transformers' assisted
    loop and DFlash 2's own): the context and anchor each training block sees are the ones the decoding loop gives
    it. (Averaging acceptance over positions instead, each position alike, gives a higher number.)"""
    target = tiny_target("llama", seed=11)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    drafter = tiny_drafter(target, seed=3, identity=True, block_size=4).bind_target(target)
    config = TrainConfig(anchors_per_sequence=16, batch_size=8, max_length=64, learning_rate=3e-3, max_steps=80,
                         eval_every=1000, checkpoint_every=1000, log_every=1000)
    train(drafter, target, self_distilled(target, 32, seed=1), config, tmp_path, progress=False,
          log=lambda line: None)
    drafter = drafter.eval().attach(target)
    generator = torch.Generator().manual_seed(5)
    rows, counted = [], []
    for _ in range(6):
        prompt = torch.randint(4, VOCAB, (1, 5), generator=generator)
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, eos_token_id=None,
                              **({"cache_implementation": "static"} if loop == "static" else {}))
        stats = drafter.last_stats
        counted.append((stats.completion_tokens, stats.target_forwards))
        rows.append({"input_ids": out[0].tolist(), "prompt_length": 5})
    estimate = held_out_acceptance(drafter, target, [collate(rows, 64, 0)], drafter.config.target_layer_ids,
                                   torch.device("cpu"))
    assert estimate["answers"] == counted
    assert len({forwards for _, forwards in counted}) > 1 and min(f for _, f in counted) < 20  # drafts accepted
    assert estimate["tau"] == sum(t for t, _ in counted) / sum(f for _, f in counted)


# ------------------------------------------------------------------------------------------------ soft labels
def _soft_case(top_k=6):
    target = _frozen(tiny_target("llama", seed=11))
    data = self_distilled(target, 3, length=20)
    data[0]["input_ids"] = data[0]["input_ids"][:12]
    token_ids, response_mask = collate(data, 64, 0)
    drafter = tiny_drafter(target, block_size=4).bind_target(target)
    anchors = sample_anchors(response_mask, 5, torch.Generator().manual_seed(3))
    features, labels = target_features_and_labels(target, token_ids, drafter.config.target_layer_ids, top_k)
    return target, drafter, token_ids, response_mask, anchors, features, labels


def test_soft_labels_are_the_targets_top_k_after_each_position():
    target, drafter, token_ids, _, anchors, features, labels = _soft_case()
    torch.testing.assert_close(features, trainer.target_features_and_logits(target, token_ids,
                                                                            drafter.config.target_layer_ids)[0])
    blocks = labels.for_blocks(anchors, 4)
    assert blocks.probs.shape == (*anchors.shape, 3, 6)
    for b in range(anchors.shape[0]):
        logits = target(input_ids=token_ids[b:b + 1]).logits[0].float()
        for n in range(anchors.shape[1]):
            if anchors[b, n] < 0:
                continue
            for j in range(1, 4):  # draft row j predicts the token at anchor + j: the distribution after anchor + j - 1
                row = min(int(anchors[b, n]) + j - 1, token_ids.shape[1] - 1)
                probs, ids = logits[row].softmax(-1).topk(6)
                assert blocks.ids[b, n, j - 1].tolist() == ids.tolist()
                torch.testing.assert_close(blocks.probs[b, n, j - 1], probs / probs.sum())


def test_soft_label_loss_against_a_naive_loop():
    """The mixed label's cross-entropy, for the draft rows and the selector, row by row in Python."""
    _, drafter, token_ids, response_mask, anchors, features, labels = _soft_case()
    w, gamma = 0.3, default_gamma(4)
    terms = drafter_loss_terms(drafter, features, token_ids, response_mask, anchors, gamma, labels, w)
    hidden, _ = trainer.denoise_blocks(drafter, features, token_ids, anchors)
    unary = drafter.unary_logits(hidden[:, :, 1:]).float()
    position_weight = trainer.position_weights(4, gamma, "cpu")
    selector = drafter.candidate_selector
    token_sum = selector_sum = selector_weight = 0.0
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            for j in range(1, 4):
                if a < 0 or a + j >= token_ids.shape[1] or not response_mask[b, a + j]:
                    continue
                z, y = unary[b, n, j - 1], int(token_ids[b, a + j])
                p_ids, p = labels.ids[b, a + j - 1], labels.probs[b, a + j - 1]
                log_q = z.log_softmax(-1)
                token_sum += position_weight[j] * (-(1 - w) * log_q[y] - w * sum(
                    p[i] * log_q[p_ids[i]] for i in range(len(p))))
                top_scores, candidates = z.topk(selector.top_k)
                predecessor = token_ids[b, a + j - 1].view(1, 1, 1, 1)
                scores = trainer.bilinear_scores(
                    top_scores.view(1, 1, 1, -1), candidates.view(1, 1, 1, -1), predecessor,
                    selector.hidden_projection(hidden[b:b + 1, n:n + 1, j:j + 1]), selector.predecessor_codebook,
                    selector.successor_codebook).flatten().float().log_softmax(-1)
                mass = torch.tensor([sum(float(p[i]) for i in range(len(p)) if p_ids[i] == c) for c in candidates])
                hard = [k for k, c in enumerate(candidates.tolist()) if c == y]
                share = (1 - w) * bool(hard) + w * bool(mass.sum() > 0)
                loss = ((1 - w) * -scores[hard[0]] if hard else 0.0)
                if mass.sum() > 0:
                    loss = loss - w * (mass / mass.sum() * scores).sum()
                selector_sum += position_weight[j] * loss
                selector_weight += position_weight[j] * share
    torch.testing.assert_close(terms["token_sum"], torch.as_tensor(token_sum).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(terms["selector_sum"], torch.as_tensor(selector_sum).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(terms["selector_weight"], torch.as_tensor(selector_weight).float())


def test_one_hot_soft_labels_give_the_hard_loss():
    """Soft labels that put all their mass on the answer's own next token are the hard labels: any share of them
    leaves the loss as it was; the target's real distribution does not."""
    _, drafter, token_ids, response_mask, anchors, features, labels = _soft_case()
    gamma = default_gamma(4)
    hard = drafter_loss_terms(drafter, features, token_ids, response_mask, anchors, gamma)
    next_tokens = torch.cat([token_ids[:, 1:], token_ids[:, -1:]], dim=1).unsqueeze(-1)  # row t: the token t + 1
    one_hot = SoftLabels(torch.cat([torch.ones_like(next_tokens, dtype=torch.float),
                                    torch.zeros(*next_tokens.shape[:2], 2)], dim=-1),
                         torch.cat([next_tokens, (next_tokens + 1) % VOCAB, (next_tokens + 2) % VOCAB], dim=-1))
    for w in (0.0, 0.5, 1.0):
        mixed = drafter_loss_terms(drafter, features, token_ids, response_mask, anchors, gamma, one_hot, w)
        for key in ("token_sum", "token_weight", "selector_sum", "selector_weight"):
            torch.testing.assert_close(mixed[key], hard[key], rtol=1e-5, atol=1e-5)
    real = drafter_loss_terms(drafter, features, token_ids, response_mask, anchors, gamma, labels, 1.0)
    assert not torch.isclose(real["token_sum"], hard["token_sum"], rtol=1e-3)


def test_training_with_soft_labels_lowers_the_loss(tmp_path):
    target = _frozen(tiny_target("llama", seed=11))
    data = self_distilled(target, 24)
    drafter = tiny_drafter(target, seed=3, identity=True, block_size=4).bind_target(target)
    config = TrainConfig(anchors_per_sequence=16, batch_size=8, max_length=64, learning_rate=3e-3, max_steps=60,
                         eval_every=1000, checkpoint_every=1000, log_every=10, soft_label_weight=0.5,
                         soft_label_top_k=8)
    history = train(drafter, target, data, config, tmp_path, progress=False, log=lambda line: None)
    losses = [h["loss"] for h in history if "loss" in h]
    assert all(map(math.isfinite, losses)) and losses[-1] < 0.7 * losses[0]


def test_average_of_two_drafters_is_their_weighted_mean_and_refuses_other_configs(tmp_path):
    """`python -m dflash2.training.average`: every weight of the written drafter is w x second + (1 - w) x first;
    drafters of another config are refused by name, and nothing is written."""
    from dflash2.generation import DFlash2Drafter, export_drafter
    from dflash2.training import average

    target = tiny_target("llama")
    first, second = tiny_drafter(target, seed=1), tiny_drafter(target, seed=2)
    export_drafter(first, tmp_path / "first")
    export_drafter(second, tmp_path / "second")
    average.main([str(tmp_path / "first"), str(tmp_path / "second"), "--weight", "0.25", "--dtype", "float32",
                  "--out", str(tmp_path / "soup")])
    soup = DFlash2Drafter.from_pretrained(tmp_path / "soup", dtype=torch.float32).state_dict()
    mine, theirs = first.state_dict(), second.state_dict()
    assert soup.keys() == theirs.keys()
    moved = 0
    for name, weight in soup.items():
        torch.testing.assert_close(weight, 0.25 * theirs[name].float() + 0.75 * mine[name].float())
        moved += not torch.equal(mine[name], theirs[name])
    assert moved > 0, "the two drafters were equal: the test would not test averaging"
    export_drafter(tiny_drafter(target, seed=2, selector_top_k=4), tmp_path / "other")
    with pytest.raises(ValueError, match="selector_top_k"):
        average.main([str(tmp_path / "first"), str(tmp_path / "other"), "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------------------ T = 1 agreement
def test_t1_candidate_agreement_matches_a_naive_loop():
    generator = torch.Generator().manual_seed(4)
    n, rows, k, vocab = 5, 4, 3, 7
    candidates = torch.stack([torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(rows)])
                              for _ in range(n)])
    pairs = torch.randn(n, rows, k, k, generator=generator)
    log_probs = torch.randn(n, rows, vocab, generator=generator).log_softmax(-1)
    candidate_log_probs = log_probs.gather(2, candidates)
    truth = torch.where(torch.rand(n, rows, generator=generator) < 0.6, candidates[:, :, 0],
                        torch.randint(0, vocab, (n, rows), generator=generator))
    truth[0, 3] = -100
    coverage, acceptance, reachable = trainer.t1_candidate_agreement(candidates, pairs, candidate_log_probs, truth)
    for i in range(n):
        can_reach = True
        for t in range(rows):
            p = candidate_log_probs[i, t].exp()
            assert coverage[i, t] == pytest.approx(float(p.sum()), abs=1e-6)
            previous = 0
            if t > 0:
                hits = [j for j in range(k) if candidates[i, t - 1, j] == truth[i, t - 1]]
                can_reach = can_reach and bool(hits)
                previous = hits[0] if hits else 0
            assert bool(reachable[i, t]) == (can_reach and truth[i, t] >= 0)
            q = pairs[i, t, previous].softmax(-1)
            expected = sum(min(float(p[j]), float(q[j])) for j in range(k))
            assert acceptance[i, t] == pytest.approx(expected, abs=1e-6)
    assert reachable.any() and not reachable.all()


@pytest.mark.parametrize("version", [2, 1])
def test_held_out_t1_measures_match_blocks_drafted_one_at_a_time(version):
    target = _frozen(tiny_target("llama", seed=11))
    data = self_distilled(target, 3, length=14)
    drafter = tiny_drafter(target, seed=3, version=version, block_size=4).bind_target(target)
    token_ids, response_mask = collate(data, 64, 0)
    layer_ids = drafter.config.target_layer_ids
    estimate = held_out_acceptance(drafter, target, [(token_ids, response_mask)], layer_ids, torch.device("cpu"))
    # the same measures, one block at a time, from the target's softmax at each row's position
    logits = target(input_ids=token_ids).logits.float()
    features = trainer.target_features_and_logits(target, token_ids, layer_ids)[0]
    drafter.requires_grad_(False)
    coverage, first, accept_first, accept_reach = [], [], [], []
    for b in range(token_ids.shape[0]):
        response = response_mask[b].nonzero().flatten()
        for anchor in range(int(response[0]) - 1, int(response[-1])):
            hidden, block_ids = trainer.denoise_blocks(drafter, features[b: b + 1], token_ids[b: b + 1],
                                                       torch.tensor([[anchor]]))
            candidates, pairs = drafter.candidate_scores(block_ids[:, :1].flatten(), hidden[0])
            reach = True
            for t in range(3):
                position = anchor + t + 1
                if position > int(response[-1]):
                    break
                p = logits[b, anchor + t].softmax(-1)[candidates[0, t]]
                previous = 0
                if t > 0:
                    hits = (candidates[0, t - 1] == token_ids[b, position - 1]).nonzero().flatten()
                    reach = reach and len(hits) > 0
                    previous = int(hits[0]) if len(hits) else 0
                accept = float(torch.minimum(p, pairs[0, t, previous].softmax(-1)).sum())
                coverage.append(float(p.sum()))
                if t == 0:
                    first.append(float(p.sum()))
                    accept_first.append(accept)
                if reach:
                    accept_reach.append(accept)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert estimate["t1_coverage"] == pytest.approx(mean(coverage), abs=1e-5)
    assert estimate["t1_coverage_row1"] == pytest.approx(mean(first), abs=1e-5)
    assert estimate["t1_accept_row1"] == pytest.approx(mean(accept_first), abs=1e-5)
    assert estimate["t1_accept"] == pytest.approx(mean(accept_reach), abs=1e-5)
    assert 0 < estimate["t1_accept_row1"] <= estimate["t1_coverage_row1"] < 1 and 0 < estimate["t1_accept"] < 1


# ------------------------------------------------------------------------------------------------ deeper drafters
@pytest.mark.parametrize("version", [2, 1])
def test_a_deepened_drafter_drafts_as_before_and_its_new_layers_learn(version):
    from dflash2.training.recipe import deepened

    target = _frozen(tiny_target("llama", seed=11))
    drafter = tiny_drafter(target, seed=3, version=version, block_size=4).bind_target(target)
    grown = deepened(drafter, 4).bind_target(target)
    assert grown.config.num_hidden_layers == 4 and len(grown.config.layer_types) == 4
    assert deepened(drafter, 2) is drafter
    with pytest.raises(SystemExit, match="fewer"):
        deepened(grown, 2)
    data = self_distilled(target, 2, length=12)
    token_ids, response_mask = collate(data, 64, 0)
    features = trainer.target_features_and_logits(target, token_ids, drafter.config.target_layer_ids)[0]
    anchors = sample_anchors(response_mask, 4, torch.Generator().manual_seed(1))
    before, _ = trainer.denoise_blocks(drafter, features, token_ids, anchors)
    after, _ = trainer.denoise_blocks(grown, features, token_ids, anchors)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    # the new layers are copies of the last one, silenced at their outputs: one step moves them
    grown.train()
    optimizer = torch.optim.AdamW(grown.parameters(), lr=1e-2)
    loss = drafter_losses(grown, features, token_ids, response_mask, anchors, 2.0)[0]
    loss.backward()
    optimizer.step()
    moved, _ = trainer.denoise_blocks(grown, features, token_ids, anchors)
    assert not torch.allclose(moved, before)
    new_layer = dict(grown.layers[3].named_parameters())
    old_layer = dict(drafter.layers[1].named_parameters())
    assert any(not torch.equal(new_layer[name], old_layer[name]) for name in new_layer)


def test_sampled_held_out_answers_give_the_t1_measures(tmp_path):
    target = _frozen(tiny_target("llama", seed=11))
    greedy = self_distilled(target, 3, length=14)
    sampled = self_distilled(target, 3, length=14, seed=5)
    drafter = tiny_drafter(target, seed=3, block_size=4).bind_target(target)
    cpu = torch.device("cpu")
    on_greedy = held_out_acceptance(drafter, target, [_batch(greedy)], drafter.config.target_layer_ids, cpu)
    on_sampled = held_out_acceptance(drafter, target, [_batch(sampled)], drafter.config.target_layer_ids, cpu)
    config = TrainConfig(anchors_per_sequence=4, batch_size=4, max_length=64, max_steps=0, checkpoint_every=1000)
    train_data = self_distilled(target, 4, length=14, seed=9)
    lines = []
    train(drafter, target, train_data, dataclasses.replace(config, max_steps=1), tmp_path, held_out=greedy,
          held_out_sampled=sampled, progress=False, log=lines.append)
    first = json.loads(next(line for line in lines if '"held_out_tau"' in line))
    assert first["step"] == 0 and first["held_out_t1_on"] == "sampled"
    assert first["held_out_tau"] == round(on_greedy["tau"], 3)
    assert first["held_out_t1_accept"] == round(on_sampled["t1_accept"], 3) != round(on_greedy["t1_accept"], 3)
