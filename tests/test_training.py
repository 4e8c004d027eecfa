"""The training recipe on a tiny target: masks and anchors against naive loops, learning, checkpoints."""

import torch

from helpers import VOCAB, tiny_drafter, tiny_target
from dflash2.training.trainer import (
    TrainConfig,
    block_attention_mask,
    block_inputs,
    held_out_tau,
    sample_anchors,
    save_checkpoint,
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
    untrained = held_out_tau(drafter, target, [_batch(held_out)], drafter.config.target_layer_ids,
                             torch.device("cpu"))
    config = TrainConfig(anchors_per_sequence=16, batch_size=8, max_length=64, learning_rate=3e-3, max_steps=300,
                         eval_every=1000, checkpoint_every=1000, log_every=50)
    history = train(drafter, target, sequences, config, tmp_path, held_out=held_out, progress=False,
                    log=lambda line: None)
    losses = [h["loss"] for h in history if "loss" in h]
    trained = history[-1]["held_out_tau"]
    assert losses[-1] < 0.6 * losses[0]
    assert trained > untrained + 0.3, (untrained, trained)
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
    assert lines[0] == "resumed from step 3"
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

    monkeypatch.setattr(torch, "save", explode)
    try:
        save_checkpoint(drafter, optimizer, 2, tmp_path / "ckpt", TrainConfig())
    except OSError:
        pass
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*")) == before  # the old checkpoint is intact


def _batch(rows):
    from dflash2.training.trainer import collate

    return collate(rows, 64, 0)
