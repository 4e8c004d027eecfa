"""`python -m dflash2.benchmarks.scale` end to end on the CPU with tiny shapes (`--smoke`): every part runs every
default method, and the JSON report carries what the GPU runs will be read for."""

import json

import pytest

from dflash2.benchmarks.scale import DEFAULT_METHODS, PUBLISHED_TAU, main

SPECULATIVE = {"assisted", "graph", "batched"}


@pytest.mark.slow
def test_smoke_run_writes_every_field(tmp_path):
    out = tmp_path / "scale.json"
    returned = main(["--smoke", "--parts", "8b,8b-long,32b,lossless", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["meta"]["smoke"] is True and report["meta"]["torch"] and report["meta"]["transformers"]
    assert set(report["parts"]) == {"8b", "8b-long", "32b", "lossless"}
    assert json.loads(json.dumps(returned, default=str)) == report

    for part in ("8b", "32b"):
        data = report["parts"][part]
        assert "error" not in data and data["target_bytes"] > 0 and set(data["drafter_bytes"]) == {"8", "16"}
        results = data["results"]
        assert not [r for r in results if "error" in r or "skipped" in r], results
        assert {r["method"] for r in results} == set(DEFAULT_METHODS)
        for r in results:  # (times are not compared: on a shared CPU a few milliseconds are noise)
            assert "peak_memory_gb" in r and r["prefill_s"] >= 0 and len(r["seconds"]) == 2
            if r["method"] in SPECULATIVE:
                assert isinstance(r["per_round_ms"], float) and r["tau"] >= 1.0 and r["block_size"] in (8, 16)
                assert r["rounds"][1] > r["rounds"][0]
            else:
                assert isinstance(r["per_token_ms"], float) and r["rounds"] == [5, 13]
            if r["method"] in ("graph", "batched"):
                assert r["kind"] == "eager" and r["draft_context_bytes"] > 0 and r["target_cache_bytes"] > 0
        assert {(r["batch"], r["block_size"]) for r in results if r["method"] == "batched"} == {
            (4, 8), (8, 8), (4, 16), (8, 16)}
        projected = data["projected"]
        assert {p["against"] for p in projected} == {"plain-eager", "plain-static", "plain-graph"}
        assert all(set(p["speedup"]) == {str(tau) for tau in PUBLISHED_TAU} for p in projected)
        assert len(projected) == 3 * sum(r["method"] in SPECULATIVE for r in results)
    assert report["parts"]["32b"]["device_map"]

    long = report["parts"]["8b-long"]["results"]
    graph = [r for r in long if r["method"] == "graph"]
    assert sorted(r["prompt_tokens"] for r in graph) == [40, 72]
    assert all(r["draft_context_bytes"] > 0 and "per_round_ms" in r and "prefill_s" in r for r in graph)
    assert len([r for r in long if r["method"] == "plain-eager"]) == 2

    lossless = report["parts"]["lossless"]
    assert lossless["all_identical"] is True
    cases = {(c["target"], c["loop"], c["drafts"]) for c in lossless["cases"]}
    assert cases == {(t, loop, d) for t in ("one device", "split") for loop in ("assisted", "graph", "batched")
                     for d in ("random", "oracle")}
    assert all(sum(c["accepted_per_position"]) > 0 for c in lossless["cases"] if c["drafts"] == "oracle")
