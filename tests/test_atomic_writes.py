"""Writes that must be atomic and must not lose the user's files: checkpoints, drafter exports, save_pretrained."""

import json

import pytest
import torch

from dflash2.training.trainer import TrainConfig, save_checkpoint
from helpers import tiny_drafter, tiny_target


def test_a_failing_checkpoint_write_raises_and_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    optimizer = torch.optim.AdamW(drafter.parameters())
    save_checkpoint(drafter, optimizer, 1, tmp_path / "ckpt", TrainConfig())
    files = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    real_save = torch.save

    def save_then_fail(obj, f, *args, **kwargs):  # the state file is half-written, then the disk fills up
        real_save(obj, f, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", save_then_fail)
    with torch.no_grad():
        next(drafter.parameters()).add_(1.0)  # step 2 differs from step 1
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(drafter, optimizer, 2, tmp_path / "ckpt", TrainConfig())
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert after == files  # byte for byte the step-1 checkpoint
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]  # no staging folder left behind


def test_exporting_into_a_folder_keeps_the_users_other_files(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    (folder / "README.md").write_text("my model card")
    (folder / "notes.txt").write_text("my notes")
    (folder / "eval").mkdir()
    (folder / "eval" / "results.json").write_text("{}")
    drafter.save_pretrained(folder, max_shard_size="20KB")  # a re-export with another shard count
    assert (folder / "README.md").read_text() == "my model card"
    assert (folder / "notes.txt").read_text() == "my notes"
    assert (folder / "eval" / "results.json").read_text() == "{}"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shards  # old shards gone, new set complete
    assert len(shards) > 1


def test_save_pretrained_takes_transformers_own_arguments(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "a", max_shard_size="30KB", safe_serialization=True)
    assert len(list((tmp_path / "a").glob("*.safetensors"))) > 1
    assert json.loads((tmp_path / "a" / "config.json").read_text())["auto_map"]["AutoModel"] == "drafter.DFlash2Drafter"


def test_push_to_hub_uploads_the_finished_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create", repo_id))

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload", repo_id, sorted(p.name for p in folder_path.iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path / "d", push_to_hub=True, repo_id="me/d2", token="t")
    upload = [c for c in calls if c[0] == "upload"][0]
    assert ("create", "me/d2") in calls and upload[1] == "me/d2"
    assert "config.json" in upload[2] and "round_core.py" in upload[2] and "custom_generate" in upload[2]
