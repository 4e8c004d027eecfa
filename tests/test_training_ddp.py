"""Training and self-distillation on two processes through torchrun (`python -m torch.distributed.run`, gloo on the
CPU), against one process: a tiny random target saved as a folder, the `dflash2 train` command end to end."""

import json

import pytest

import torch
from safetensors.torch import load_file

from training_helpers import save_tiny_target, torchrun, write_prompt_file
from dflash2.cli import build_parser
from dflash2.tasks import read_prompts
from dflash2.training.selfdistill import distill, distill_to_file, write_jsonl

# Tolerance of "the same weights": the two runs compute the same sums in a different order (each process pads and
# multiplies its half of the batch, gloo adds the two halves' gradients), so fp32 rounding differs, and AdamW turns
# tiny gradient differences into weight differences of at most about lr per step. Measured here (6 steps, lr 1e-3):
# max |difference| 6e-8; the run with another global batch differs from the one-process run by 5e-3.
SAME = 1e-6


def _weights(run):
    folder = run / "checkpoint" / "drafter"
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _train_args(tmp_path, out, batch_size, *extra):
    return ["train", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--data",
            str(tmp_path / "data.jsonl"), "--out", str(out), "--layers", "1", "--block-size", "8", "--anchors", "6",
            "--max-length", "48", "--steps", "6", "--lr", "1e-3", "--held-out", "4", "--eval-every", "3",
            "--selector-rank", "8", "--selector-top-k", "8", "--save-dtype", "float32", "--device", "cpu",
            "--batch-size", str(batch_size), *extra]


def _train_in_process(args):
    from dflash2.training.recipe import run

    return run(build_parser().parse_args(args))


@pytest.mark.slow
def test_torchrun_two_processes_train_like_one_process_with_their_global_batch(tmp_path):
    """2 processes x 2 sequences == 1 process x 4 sequences per step (the same global batches, anchors and
    normalisation), also when the 2-process run is cut into two torchrun jobs (--job-steps 3, then --resume). Process 0
    alone logs and writes the one checkpoint; the export is a drafter folder."""
    from dflash2.generation import load_target

    save_tiny_target(tmp_path / "target")
    write_prompt_file(tmp_path / "prompts.jsonl", 24)
    target, tokenizer = load_target(target=str(tmp_path / "target"))
    write_jsonl(distill(target, tokenizer, read_prompts(tmp_path / "prompts.jsonl"), max_new_tokens=24,
                        batch_size=8, progress=False), tmp_path / "data.jsonl")

    two = tmp_path / "two"
    torchrun(2, ["dflash2.cli", *_train_args(tmp_path, two, 2, "--job-steps", "3")], cwd=tmp_path)
    state = torch.load(two / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert (state["step"], state["world_size"], state["global_batch"]) == (3, 2, 4)
    torchrun(2, ["dflash2.cli", *_train_args(tmp_path, two, 2, "--resume")], cwd=tmp_path)
    state = torch.load(two / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 6

    one = tmp_path / "one"
    _train_in_process(_train_args(tmp_path, one, 4))
    other_batch = tmp_path / "other"
    _train_in_process(_train_args(tmp_path, other_batch, 2))

    difference = _max_difference(_weights(one), _weights(two))
    assert difference < SAME, difference
    # the logged statistics are the global batch's too (loss, gradient norm, accuracies, recall)
    first = [next(h for h in json.loads((run / "history.json").read_text()) if "loss" in h) for run in (one, two)]
    assert first[0]["step"] == first[1]["step"] == 1
    for key in ("loss", "token_loss", "selector_loss", "top_k_recall", "grad_norm", "lr"):
        assert abs(first[0][key] - first[1][key]) <= 1e-5 * abs(first[0][key]) + 1e-9, key
    torch.testing.assert_close(torch.tensor(first[0]["top1_by_position"]), torch.tensor(first[1]["top1_by_position"]))
    assert _max_difference(_weights(one), _weights(other_batch)) > 1000 * SAME

    log = [json.loads(line) for line in (two / "train_log.jsonl").read_text().splitlines()]
    assert [r["processes"] for r in log if "job" in r] == [2, 2]  # two jobs, each logged once (process 0)
    assert [r["stopped"] for r in log if "stopped" in r] == ["job step limit", "schedule done (steps)"]
    assert [r["step"] for r in log if "held_out_tau" in r and not r.get("final")] == [0, 3, 6]  # once each
    assert sorted(p.name for p in two.iterdir()) == ["checkpoint", "drafter", "history.json", "train_log.jsonl"]
    from dflash2.generation import DFlash2Drafter

    exported = DFlash2Drafter.from_pretrained(two / "drafter", dtype=torch.float32)
    assert exported.config.block_size == 8
    assert _max_difference(exported.state_dict(), _weights(two)) == 0.0


@pytest.mark.slow
def test_torchrun_self_distillation_shards_and_merges_in_prompt_order(tmp_path):
    """2 processes answer every other prompt (greedy and sampled each, conversations among them); process 0 merges the
    shards into one file ordered by (prompt, greedy first), whose greedy answers are one process's answers."""
    from dflash2.generation import load_target

    save_tiny_target(tmp_path / "target")
    write_prompt_file(tmp_path / "prompts.jsonl", 20, conversations=5)
    torchrun(2, ["dflash2.training.selfdistill", "--target", str(tmp_path / "target"), "--prompts",
                 str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "data.jsonl"), "--answers", "both",
                 "--temperature", "1.0", "--max-new-tokens", "16", "--batch-size", "4", "--device", "cpu"],
             cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sampled"]) for r in rows] == [(i, s) for i in range(20) for s in (False, True)]
    assert not list(tmp_path.glob(".data.jsonl*")), "the shard files are gone"

    target, tokenizer = load_target(target=str(tmp_path / "target"))
    prompts = read_prompts(tmp_path / "prompts.jsonl")
    summary = distill_to_file(target, tokenizer, prompts, tmp_path / "single.jsonl", max_new_tokens=16,
                              batch_size=4, progress=False)
    single = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
    assert summary["sequences"] == 20 and summary["processes"] == 1
    assert [r["input_ids"] for r in single] == [r["input_ids"] for r in rows if not r["sampled"]]
    greedy, sampled = rows[0::2], rows[1::2]
    assert all(g["input_ids"][: g["prompt_length"]] == s["input_ids"][: s["prompt_length"]]
               for g, s in zip(greedy, sampled))
    assert sum(g["input_ids"] != s["input_ids"] for g, s in zip(greedy, sampled)) >= 10
