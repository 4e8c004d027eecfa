"""Inputs that used to slip through, each refused with one message naming the file or the value and the fix; and the
built-in `speculation_type="dflash"` path filling `drafter.last_stats` like every other path."""

import json
import re

import pytest
import torch
from transformers import AutoModel

from dflash2.generation import DFlash2Drafter, load_target
from helpers import EOS, VOCAB, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    """An exported tiny drafter in five shards, reading five target layers (`fc` fuses 5 x 64 inputs)."""
    folder = tmp_path_factory.mktemp("drafter")
    target = tiny_target()
    tiny_drafter(target, target_layer_ids=[0, 1, 2, 3, 4]).save_pretrained(folder, max_shard_size="100KB")
    return folder


def copy_of(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "drafter")


def shard_of(folder, tensor="fc.weight"):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


# ------------------------------------------------------------------------------------------------ drafter folders
def test_a_missing_shard_is_named(drafter_folder, tmp_path):
    folder = copy_of(drafter_folder, tmp_path)
    shard = shard_of(folder, "norm.weight")
    (folder / shard).unlink()
    message = (f"The drafter folder {folder} is incomplete: {shard} is missing (model.safetensors.index.json lists "
               "it). Copy the whole folder again, or export it again with drafter.save_pretrained(folder).")
    with pytest.raises(FileNotFoundError) as error:
        DFlash2Drafter.from_pretrained(folder)
    assert str(error.value) == message


def test_a_truncated_shard_is_named(drafter_folder, tmp_path):
    folder = copy_of(drafter_folder, tmp_path)
    path = folder / shard_of(folder)
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    message = (f"{path} is truncated or damaged: its tensors need {size} bytes, the file has {size // 2}. Copy the "
               "file again from where the drafter came from, or export the drafter again with "
               "drafter.save_pretrained(folder).")
    with pytest.raises(OSError) as error:
        DFlash2Drafter.from_pretrained(folder)
    assert str(error.value) == message
    path.write_bytes(b"\x01")  # not even the header's length
    with pytest.raises(OSError, match=re.escape(f"{path} is truncated or damaged: it has 1 bytes, fewer than")):
        DFlash2Drafter.from_pretrained(folder)


LAYER_MESSAGE = ("Invalid DFlash2Config: target_layer_ids=[0, 1, 2, 3] lists 4 target layers, but the checkpoint's "
                 "fc.weight ({shard}) fuses 5 (320 inputs = 5 x target_hidden_size 64). Give target_layer_ids the 5 "
                 "layers this drafter was trained on, in {folder}/config.json.")


def test_target_layer_ids_that_do_not_fit_the_checkpoint_get_the_config_message(drafter_folder, tmp_path):
    folder = copy_of(drafter_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["target_layer_ids"] = [0, 1, 2, 3]
    (folder / "config.json").write_text(json.dumps(config))
    message = LAYER_MESSAGE.format(shard=shard_of(folder), folder=folder)
    with pytest.raises(ValueError) as error:
        DFlash2Drafter.from_pretrained(folder)
    assert str(error.value) == message
    # the same through the Auto class, whose code is the folder's own copy (remote code)
    with pytest.raises(ValueError) as error:
        AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert str(error.value) == message


def test_a_config_passed_to_from_pretrained_is_checked_too(drafter_folder):
    from dflash2.configuration_dflash2 import DFlash2Config

    config = DFlash2Config.from_pretrained(drafter_folder)
    config.target_layer_ids = [0, 1, 2, 3]
    with pytest.raises(ValueError) as error:
        DFlash2Drafter.from_pretrained(drafter_folder, config=config)
    assert str(error.value) == LAYER_MESSAGE.format(shard=shard_of(drafter_folder), folder=drafter_folder)


def test_a_complete_folder_still_loads(drafter_folder):
    drafter = DFlash2Drafter.from_pretrained(drafter_folder)
    assert drafter.config.target_layer_ids == [0, 1, 2, 3, 4]


def test_a_missing_gguf_file_is_named(tmp_path):
    (tmp_path / "target").mkdir()
    with pytest.raises(FileNotFoundError) as error:
        load_target(target=str(tmp_path / "target"), gguf_file="model.Q4_1.gguf")
    assert str(error.value) == (f"No GGUF file model.Q4_1.gguf in {tmp_path / 'target'} (the target "
                                f"{tmp_path / 'target'}). Check the file name (gguf_file= / --gguf-file), or "
                                "reinstall the package that holds it.")


# ------------------------------------------------------------------------------------------------ generate requests
@pytest.fixture(scope="module")
def pair():
    target = tiny_target()  # pad_token_id 0, max_position_embeddings 512
    return target, tiny_drafter(target).attach(target)


def cpu_limited_pair():
    """A tiny pair whose drafter keeps the measured speculative batch limit (2 on a CPU)."""
    target = tiny_target()
    return target, tiny_drafter(target, max_speculative_batch_size=None).attach(target)


def test_a_right_padded_batch_without_attention_mask_is_refused(pair):
    target, drafter = pair
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    with pytest.raises(ValueError) as error:
        target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    assert str(error.value) == (
        "DFlash 2 got a batch of 2 prompts without attention_mask, and row 1 ends with the pad token 0: a right-padded "
        "batch. Pad on the left (tokenizer.padding_side = 'left') and pass the attention_mask the tokenizer returns "
        "(tokenizer(prompts, padding=True, return_tensors='pt')).")


def test_a_left_padded_batch_without_attention_mask_is_refused(pair):
    target, drafter = pair
    ids = torch.tensor([[0, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError) as error:
        target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter, pad_token_id=0)
    assert str(error.value) == (
        "DFlash 2 got a batch of 2 prompts without attention_mask, and row 0 starts with the pad token 0: a "
        "left-padded batch. Pass the attention_mask the tokenizer returns (tokenizer(prompts, padding=True, "
        "return_tensors='pt')).")
    # with its mask the same batch runs, and each row equals plain greedy of that row alone
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    assert torch.equal(out[1], target.generate(ids[1:], max_new_tokens=4, do_sample=False)[0])


def test_a_right_padded_batch_above_the_speculative_limit_is_refused():
    """A batch above the CPU's speculative batch limit (2) decodes without the drafter, but its padding is checked
    first: a right-padded mask gets the left-padding message instead of rows decoded from their padding."""
    target, drafter = cpu_limited_pair()
    ids = torch.tensor([[5, 6, 7], [8, 9, 0], [10, 0, 0]])
    with pytest.raises(ValueError) as error:
        target.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False,
                        assistant_model=drafter)
    assert str(error.value) == (
        "DFlash 2 needs left-padded prompts: each row's attention_mask must be 0 (padding) before its prompt and 1 "
        "from its first token to the end. Set tokenizer.padding_side = 'left', or drop the mask if the prompt has "
        "no padding.")


def test_a_prompt_longer_than_max_position_embeddings_is_refused(pair):
    target, drafter = pair
    ids = torch.randint(4, VOCAB, (1, 513), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as error:
        target.generate(ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    assert str(error.value) == (
        "The prompt has 513 tokens, more than the target's max_position_embeddings=512. Shorten it to fewer than 512 "
        "tokens, e.g. tokenizer(..., truncation=True, max_length=511).")



@pytest.mark.parametrize("batch, loop", [(1, {}), (1, {"cache_implementation": "static"}),
                                         (1, {"speculation_type": "dflash"}), (2, {})])
def test_an_empty_prompt_is_refused_in_every_loop(pair, batch, loop):
    """transformers' assisted loop, DFlash 2's own loop (one prompt and a batch) and the built-in DFlash path."""
    target, drafter = pair
    ids = torch.zeros(batch, 0, dtype=torch.long)
    with pytest.raises(ValueError) as error:
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, assistant_model=drafter, **loop)
    assert str(error.value) == (
        f"The prompt is empty (input_ids of shape ({batch}, 0)): speculative decoding drafts from the last prompt "
        "token, so it needs at least one. Pass a non-empty prompt (the chat template's output, or the BOS token "
        "alone: torch.tensor([[tokenizer.bos_token_id]])).")


@pytest.mark.parametrize("batch", [1, 2])
def test_more_eos_ids_than_the_own_loop_holds_are_refused(pair, batch):
    """The own loop's round holds the EOS ids in a fixed buffer: more are refused before any buffer is built."""
    target, drafter = pair
    runners = drafter.round_runners()
    ids = torch.tensor([[5, 6]] * batch)
    with pytest.raises(ValueError) as error:
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, assistant_model=drafter,
                        cache_implementation="static", eos_token_id=list(range(4, 21)))
    assert str(error.value) == (
        "eos_token_id lists 17 distinct ids; DFlash 2's own loop stops at up to 16. Pass the ids that end a turn only, "
        "or pass one prompt with loop='transformers' for transformers' assisted loop.")
    assert drafter.round_runners() == runners

# ------------------------------------------------------------------------------------------------ statistics
def test_builtin_dflash_path_fills_last_stats(pair):
    """transformers' own DFlash loop: one round per target forward (prefill included), the new tokens, and
    acceptance by position that adds up to the tokens the drafts contributed."""
    from dflash2.benchmarks.bench import ForwardCounter

    target, drafter = pair
    drafter.last_stats = None
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with ForwardCounter(target) as counter:
        out = target.generate(ids, max_new_tokens=21, do_sample=False, assistant_model=drafter,
                              speculation_type="dflash")
    stats = drafter.last_stats
    assert stats is not None
    assert stats.completion_tokens == out.shape[1] - 9 == 21
    assert stats.target_forwards == counter.count
    # every forward adds one token of its own plus the drafts it accepted
    assert sum(stats.accepted_per_position) == stats.completion_tokens - stats.target_forwards
    assert stats.acceptance_length == 21 / counter.count


def test_last_stats_describe_a_batch_decoded_without_the_drafter():
    """Above the speculative batch limit the batch decodes plainly: last_stats say so (one target forward per token of
    each row, tau 1), on a drafter that never speculated before."""
    target, drafter = cpu_limited_pair()
    ids = torch.randint(4, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="decoding without the drafter"):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                              assistant_model=drafter)
    new = out[:, 6:].tolist()
    tokens = sum(row.index(EOS) + 1 if EOS in row else len(row) for row in new)
    stats = drafter.last_stats
    assert stats.rows == 3
    assert stats.completion_tokens == tokens
    assert stats.target_forwards == tokens and stats.acceptance_length == 1.0
    assert stats.drafting_rounds == tokens - 3 and sum(stats.accepted_per_position) == 0
    assert stats.loop == "plain"
