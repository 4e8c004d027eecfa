"""A GGUF target is dequantised once per dtype and kept as an ordinary model folder (generation/drafter.py,
`converted_target`): later loads read it instead of converting again, with the same weights and tokenizer."""

import os
import warnings
from pathlib import Path

import pytest
import torch

from dflash2.generation import drafter as drafter_module
from helpers import tiny_target

SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


@pytest.mark.slow
def test_the_second_load_reads_the_converted_folder_with_the_same_weights_config_and_tokenizer(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from dflash2.configuration_dflash2 import DFlash2Config

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    config = DFlash2Config.from_pretrained(SHIPPED)
    converted, tokenizer = drafter_module.load_target(config, dtype=torch.float32)
    folders = list((tmp_path / "targets").iterdir())
    assert len(folders) == 1 and (folders[0] / "model.safetensors").is_file()
    assert not [p for p in folders[0].parent.iterdir() if p.name.startswith(".")]  # no scratch left

    loads = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: loads.append((args, kwargs)) or real(*args, **kwargs))
    again, tokenizer_again = drafter_module.load_target(config, dtype=torch.float32)
    assert [Path(args[0]) for args, _ in loads] == folders and "gguf_file" not in loads[0][1]
    assert again.lm_head.weight is again.model.embed_tokens.weight  # tied, as SmolLM2 is
    first, second = converted.state_dict(), again.state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert again.dtype == torch.float32 and again.generation_config.eos_token_id == converted.generation_config.eos_token_id
    # the converting load and a later one give one config: a fused round built by the first process serves the next
    assert converted.config.to_json_string() == again.config.to_json_string()
    chat = [{"role": "user", "content": "Write a function that adds two numbers."}]
    assert tokenizer_again.apply_chat_template(chat, add_generation_prompt=True) == tokenizer.apply_chat_template(
        chat, add_generation_prompt=True)
    assert tokenizer_again.eos_token_id == tokenizer.eos_token_id


def test_the_folder_name_follows_the_file_and_the_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"x" * 10)
    fp32 = drafter_module.converted_folder(gguf, torch.float32)
    bf16 = drafter_module.converted_folder(gguf, torch.bfloat16)
    assert fp32 != bf16 and fp32.parent == tmp_path / "cache" / "targets" and fp32.name.startswith("model.Q4_1.")
    os.utime(gguf, ns=(0, 10 ** 9))  # a changed file (here: its modification time) converts again
    assert drafter_module.converted_folder(gguf, torch.float32) != fp32
    monkeypatch.setenv("DFLASH2_CONVERT_GGUF", "0")
    assert drafter_module.converted_folder(gguf, torch.float32) is None


def test_a_folder_that_cannot_be_written_warns_and_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    model = tiny_target("llama", seed=1)
    folder = tmp_path / "targets" / "model.float32.abc"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.warns(UserWarning, match="could not keep the converted target .* No space left"):
        drafter_module.save_converted(model, None, folder)
    assert list(folder.parent.iterdir()) == []


def test_a_tiny_model_round_trips_through_the_converted_folder(tmp_path):
    """The writer alone: weights (tied ones once), config and generation config come back equal."""
    from transformers import AutoModelForCausalLM

    model = tiny_target("llama", seed=1, tied=True)
    tokenizer = type("Tokenizer", (), {"save_pretrained": lambda self, path: None})()
    folder = tmp_path / "targets" / "tiny"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter_module.save_converted(model, tokenizer, folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert model.state_dict().keys() == loaded.state_dict().keys()
