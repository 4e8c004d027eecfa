"""`lab.profile_step` on a tiny target: both profiles run end to end and their parts add up."""

import pytest

from helpers import tiny_drafter, tiny_target
from test_generation import _tiny_tokenizer


@pytest.fixture
def pair():
    target = tiny_target("llama", seed=7)
    return target, _tiny_tokenizer(), tiny_drafter(target, seed=7, block_size=8).attach(target)


def test_static_profile_splits_a_round_into_parts_that_add_up(pair):
    from dflash2.lab.profile_step import profile_static

    target, tokenizer, drafter = pair
    timings = profile_static(target, tokenizer, drafter, "a b c a b c a b c a b", repeats=2, max_new_tokens=24)
    for part in ("t_round_replay", "t_draft_replay", "t_draft_head_replay", "t_draft_select_replay",
                 "t_verify_replay", "t_plain_step_replay", "t_round_measured"):
        assert timings[part] > 0, part
    assert timings["t_head_replay"] == pytest.approx(timings["t_draft_head_replay"] - timings["t_draft_replay"])
    assert timings["t_draft_replay"] + timings["t_head_replay"] + timings["t_select_replay"] + timings[
        "t_verify_replay"] + timings["t_accept_replay"] == pytest.approx(timings["t_round_replay"])
    assert timings["tau"] >= 1.0 and timings["rounds"] >= 1 and timings["fused"] == 0.0  # CPU: eager


def test_eager_profile_reports_a_bound_from_its_parts(pair):
    from dflash2.lab.profile_step import profile

    target, tokenizer, drafter = pair
    timings = profile(target, tokenizer, drafter, "a b c a b", context=16, repeats=2, max_new_tokens=12)
    assert min(timings["t_plain_step"], timings["t_verify"], timings["t_draft"], timings["t_select"]) > 0
    bound = timings["tau"] * timings["t_plain_step"] / (timings["t_verify"] + timings["t_draft"] + timings["t_select"])
    assert timings["speedup_bound"] == pytest.approx(bound)
