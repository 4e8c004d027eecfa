"""The round profiler (benchmarks/round_profile.py) on tiny shapes on the CPU: it runs and times every part."""

import json

from dflash2.benchmarks.round_profile import main

PARTS = ["round", "drafter forward", "LM head + top-k", "pair scores", "selector walk", "verify forward",
         "greedy accept", "bookkeeping", "sum of parts", "target step (1 token)", "target forward (16 tokens)",
         "target forward (16 tokens, round's capacity)"]


def test_smoke_reports_every_part_at_both_shapes(tmp_path):
    out = tmp_path / "round.json"
    report = main(["--smoke", "--shape", "smollm2-135m,qwen3-8b", "--block-size", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    for shape in ("smollm2-135m", "qwen3-8b"):
        result = report["shapes"][shape]
        assert list(result["ms"]) == PARTS
        assert all(value > 0 for value in result["ms"].values()), result["ms"]
        assert result["block_size"] == 8 and not result["captured"]
        assert result["round_over_verify16"] > 0


def test_capacity_sets_the_rounds_buffers_and_the_forward_it_is_compared_with():
    report = main(["--smoke", "--capacity", "512", "--replays", "1"])
    result = report["shapes"]["smollm2-135m"]
    assert result["capacity"] == 512
    assert result["ms"]["target forward (16 tokens, round's capacity)"] > 0


def test_parts_and_forwards_select_what_is_timed():
    report = main(["--smoke", "--replays", "1", "--parts", "round,verify forward", "--forwards", "forward16-capacity"])
    result = report["shapes"]["smollm2-135m"]
    assert list(result["ms"]) == ["round", "verify forward", "target forward (16 tokens, round's capacity)"]
    assert set(k for k in result if k.startswith("round_over")) == {"round_over_verify16_round_capacity"}


def test_tree_nodes_profile_the_tree_round_part_by_part_beside_the_path_round():
    report = main(["--smoke", "--replays", "1", "--tree-nodes", "0,16", "--forwards", "forward16"])
    path, tree = report["shapes"]["smollm2-135m"], report["shapes"]["smollm2-135m, tree 16"]
    assert path["tree_nodes"] == 0 and "selector walk" in path["ms"]
    assert tree["tree_nodes"] == 16
    assert list(tree["ms"]) == ["round", "drafter forward", "candidate scores", "draft tree", "tree masks",
                                "verify tree", "accept tree", "keep path", "bookkeeping", "sum of parts",
                                "target forward (16 tokens)"]
    assert all(value > 0 for value in tree["ms"].values()), tree["ms"]
