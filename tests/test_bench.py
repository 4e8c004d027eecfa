"""`dflash2 bench` end to end on a tiny target: every method runs, fp32 greedy agrees, reports are written."""

import json

from helpers import tiny_drafter, tiny_target
from test_generation import _tiny_tokenizer


def test_benchmark_runs_every_method_and_writes_reports(tmp_path):
    from dflash2.benchmarks.bench import run_benchmark, write_reports

    target = tiny_target("llama", seed=3)
    tokenizer = _tiny_tokenizer()
    drafters = {"dflash2": tiny_drafter(target, seed=3).attach(target),
                "dflash1": tiny_drafter(target, seed=4, version=1).attach(target)}
    results = run_benchmark(target, tokenizer, drafters, tasks=("humaneval", "mtbench"), num_prompts=2,
                            max_new_tokens=10, static=True, progress=False, command="test")
    for task in ("humaneval", "mtbench"):
        rows = results["tasks"][task]
        assert set(rows) == {"plain", "plain-static", "plain-graph", "prompt-lookup", "hf-dflash", "dflash1", "dflash2",
                             "dflash2-static"}
        assert rows["dflash2-static"]["speedup_vs_plain-graph"] > 0 and "speedup_vs_plain-static" in rows["dflash2"]
        for name, row in rows.items():
            assert row["greedy_exact_match"] == 1.0, (task, name)  # fp32: every method is lossless
            assert row["tokens"] > 0 and row["target_forwards"] > 0
        assert rows["plain"]["tau"] == 1.0
        assert len(rows["dflash2"]["acceptance_by_position"]) == drafters["dflash2"].config.block_size - 1
        for row in rows.values():  # per-prompt spread: the max is one of the prompts, the median between
            assert 0 < row["per_prompt_median_s"] <= row["per_prompt_max_s"] <= row["seconds"]
    # cold start: each method's first call, recorded once (the first task's warm-up), never overwritten
    cold = results["cold_start"]
    assert set(cold) == set(results["tasks"]["humaneval"])
    assert all(row["task"] == "humaneval" and row["first_call_s"] > 0 for row in cold.values())
    written = write_reports(results, tmp_path)
    assert {p.name for p in written} == {"results.json", "results.md", "speedup.png", "acceptance.png"}
    report = (tmp_path / "results.md").read_text()
    assert "### cold start" in report and "per-prompt max s" in report
    # how DFlash 2's own loop ran (on a CPU: eager rounds, nothing fused in the background to wait for)
    assert results["round_kind"] == {"humaneval": "eager", "mtbench": "eager"}
    assert results["waited_for_fused_round_s"] == {"humaneval": None, "mtbench": None}
    assert "dflash2-static on mtbench: rounds run as eager" in report
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["command"] == "test"


def test_batched_benchmark_reports_each_batch_size():
    from dflash2.benchmarks.bench import markdown_table, run_batched_benchmark

    target = tiny_target("qwen3", seed=5)
    tokenizer = _tiny_tokenizer()
    drafter = tiny_drafter(target, seed=5).attach(target)
    results = run_batched_benchmark(target, tokenizer, drafter, batch_sizes=(1, 3), max_new_tokens=6, progress=False)
    assert set(results["batches"]) == {"1", "3"}
    for row in results["batches"].values():
        assert row["plain"]["tokens"] > 0 and row["dflash2"]["tokens"] > 0
    assert "| 3 |" in markdown_table({"batched": results})


def test_a_failing_method_is_left_out_and_named_while_the_others_run(monkeypatch, tmp_path):
    import dflash2.benchmarks.bench as bench

    target = tiny_target("llama", seed=6)
    drafters = {"dflash2": tiny_drafter(target, seed=6).attach(target)}
    original = bench.method_kwargs

    def broken_prompt_lookup(name, drafters):
        return {"prompt_lookup_num_tokens": "not a number"} if name == "prompt-lookup" else original(name, drafters)

    monkeypatch.setattr(bench, "method_kwargs", broken_prompt_lookup)
    results = bench.run_benchmark(target, _tiny_tokenizer(), drafters, tasks=("humaneval",), num_prompts=1,
                                  max_new_tokens=6, progress=False)
    assert set(results["tasks"]["humaneval"]) == {"plain", "hf-dflash", "dflash2"}
    assert "prompt-lookup" in results["failed"]
    assert "Left out: prompt-lookup failed" in bench.markdown_table(results)
    bench.write_reports(results, tmp_path)


def test_speed_reports_each_prompt_category_from_its_own_prompts():
    from dflash2.benchmarks.speed import by_category

    runs = {"dflash2": [(1.0, 40, 10), (2.0, 60, 30), (1.0, 10, 5)], "plain-graph": [(2.0, 40, None), (2.0, 60, None),
                                                                                     (4.0, 10, None)]}
    entry = {m: {"per_prompt": [{"s": s, "tokens": t, "target_forwards": f} for s, t, f in rows]}
             for m, rows in runs.items()}
    table = by_category(entry, ["math", "writing", "math"])
    assert list(table) == ["math", "writing"]
    math = table["math"]  # prompts 0 and 2: 50 tokens in 2 s (ours), in 6 s (plain-graph); 15 target forwards
    assert (math["prompts"], math["dflash2"], math["plain-graph"], math["tau"]) == (2, 25.0, 8.33, 3.333)
    assert math["speedup_vs_plain-graph"] == round(25.0 / 8.33, 3)
    assert (table["writing"]["tau"], table["writing"]["speedup_vs_plain-graph"]) == (2.0, 1.0)


def test_speed_reports_the_tree_beside_the_path_per_category():
    from dflash2.benchmarks.speed import by_category, tree_over_path

    runs = {"dflash2-path": [(1.0, 40, 20), (2.0, 60, 30)], "dflash2-tree": [(1.0, 44, 16), (1.5, 60, 20)],
            "plain-graph": [(2.0, 40, None), (3.0, 60, None)]}
    entry = {m: {"per_prompt": [{"s": s, "tokens": t, "target_forwards": f} for s, t, f in rows]}
             for m, rows in runs.items()}
    table = by_category(entry, ["code", "chat"])
    code, chat = table["code"], table["chat"]
    assert (code["tau_dflash2-path"], code["tau_dflash2-tree"]) == (2.0, 2.75)
    assert code["tree_over_path_tau"] == round(2.75 / 2.0, 3) and code["tree_over_path_tokens_per_s"] == 1.1
    assert chat["dflash2-tree_speedup_vs_plain-graph"] == round(40.0 / 20.0, 3)
    whole = {"dflash2-path": {"tau": 2.0, "tokens_per_s": 100.0}, "dflash2-tree": {"tau": 2.5, "tokens_per_s": 90.0}}
    assert tree_over_path(whole) == {"tree_over_path_tau": 1.25, "tree_over_path_tokens_per_s": 0.9}

def test_acceptance_tau_by_category_and_its_table():
    """τ of a category is its prompts' tokens over their forwards (not a mean of per-prompt τ); the table has a row per
    category, the mean of a task's categories, the task's τ over all its prompts, the mean over every task's categories,
    and a column per run."""
    from dflash2.benchmarks.acceptance import by_category, category_table

    rows = [{"tokens": 30, "target_forwards": 10}, {"tokens": 10, "target_forwards": 10},
            {"tokens": 40, "target_forwards": 10}]
    table = by_category(rows, ["writing", "writing", "math"])
    assert table == {"writing": {"prompts": 2, "tau": 2.0}, "math": {"prompts": 1, "tau": 4.0}}
    run = {"drafter": "d", "temperature": 0.0, "tasks": {
        "mtbench": {"prompts": 3, "skip": 0, "tau": 2.667, "by_category": table},
        "math": {"prompts": 1, "skip": 0, "tau": 1.5, "by_category": {"math word problems": {"prompts": 1, "tau": 1.5}}}}}
    other = {**run, "drafter": "e", "temperature": 1.0, "top_k": 0, "tasks": {"math": run["tasks"]["math"]}}
    lines = category_table([run, other]).splitlines()
    assert lines[0] == "| τ | d, T 0 | e, T 1 |"
    assert "| writing | 2.00 |  |" in lines and "| mtbench: mean of its 2 categories | 3.00 |  |" in lines
    assert "| math word problems | 1.50 | 1.50 |" in lines and "| mtbench: all 3 prompts from 0 | 2.67 |  |" in lines
    assert lines[-1] == "| every task: mean of its 3 categories | 2.50 |  |"  # (2 + 4 + 1.5) / 3; e has one task
    trees = [{**other, "tree_nodes": 16}, {**other, "tree_nodes": 0}]  # reports that record their rounds
    assert category_table(trees).splitlines()[0] == "| τ | e, T 1, tree 16 | e, T 1, path |"
    # means are rounded once, when printed: these average 2.0348 (rounded to 2.035 first it printed 2.04)
    taus = [1.728, 1.734, 1.734, 2.38, 2.344, 1.947, 1.86, 1.726, 2.634, 2.261]
    many = {"drafter": "d", "temperature": 1.0, "tasks": {
        "mtbench": {"prompts": 8, "skip": 0, "tau": 2.0,
                    "by_category": {str(i): {"prompts": 1, "tau": t} for i, t in enumerate(taus[:8])}},
        "humaneval": {"prompts": 1, "skip": 100, "tau": taus[8],
                      "by_category": {"code": {"prompts": 1, "tau": taus[8]}}},
        "math": {"prompts": 1, "skip": 0, "tau": taus[9], "by_category": {"math": {"prompts": 1, "tau": taus[9]}}}}}
    assert category_table([many]).splitlines()[-1] == "| every task: mean of its 10 categories | 2.03 |"


def test_acceptance_passes_tree_nodes_to_generate(monkeypatch):
    """--tree-nodes reaches generate and the report; without it each drafter's config decides."""
    import argparse
    import types

    import torch

    from dflash2.benchmarks import acceptance

    seen = []
    config = types.SimpleNamespace(tree_nodes=16)
    stats = types.SimpleNamespace(completion_tokens=8, target_forwards=4, acceptance_length=2.0)
    drafter = types.SimpleNamespace(config=config, device=torch.device("cpu"), last_stats=stats)
    target = types.SimpleNamespace(dtype=torch.float32, generate=lambda ids, **kwargs: seen.append(kwargs["tree_nodes"]))
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=False: (target, tokenizer, drafter))
    monkeypatch.setattr("dflash2.tasks.task_prompts", lambda task, n, skip=0: ["a", "b"])
    monkeypatch.setattr("dflash2.tasks.task_categories", lambda task, n, skip=0: ["x", "x"])
    monkeypatch.setattr("dflash2.tasks.prompt_ids", lambda tokenizer, prompt, limit: [1, 2, 3])
    for asked, expected in ((None, 16), (0, 0), (32, 32)):
        seen.clear()
        args = argparse.Namespace(drafter="d", max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                                  no_fusion=True, tree_nodes=asked, prompt_file=None, num_prompts=None)
        report = acceptance.measure(args, ["mtbench"], [0])
        assert seen == [expected, expected] and report["tree_nodes"] == expected


def test_sampling_options_have_no_top_k_cut_unless_asked():
    """--temperature / --top-p / --top-k become generate's settings in one place: greedy at 0, else sampling with no
    top-k cut unless --top-k names one (transformers' default top-k of 50 would otherwise narrow what "T = 1" samples
    from); a negative --top-k is refused by the parser."""
    import argparse

    import pytest

    from dflash2.model_args import add_model_arguments, sampling_kwargs

    assert sampling_kwargs(0.0, 0.9) == {"do_sample": False}
    assert sampling_kwargs(1.0) == {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert sampling_kwargs(0.7, 0.9) == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--temperature", "1", "--top-k", "50"])
    assert sampling_kwargs(args.temperature, args.top_p, args.top_k)["top_k"] == 50
    assert parser.parse_args([]).top_k == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--top-k", "-1"])


def test_acceptance_samples_with_no_top_k_cut_and_reports_it(monkeypatch):
    import argparse
    import types

    import torch

    from dflash2.benchmarks import acceptance

    seen = []
    stats = types.SimpleNamespace(completion_tokens=8, target_forwards=4, acceptance_length=2.0)
    drafter = types.SimpleNamespace(config=types.SimpleNamespace(tree_nodes=32), device=torch.device("cpu"),
                                    last_stats=stats)
    target = types.SimpleNamespace(dtype=torch.float32, generate=lambda ids, **kwargs: seen.append(kwargs))
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=False: (target, tokenizer, drafter))
    monkeypatch.setattr("dflash2.tasks.task_prompts", lambda task, n, skip=0: ["a"])
    monkeypatch.setattr("dflash2.tasks.task_categories", lambda task, n, skip=0: ["x"])
    monkeypatch.setattr("dflash2.tasks.prompt_ids", lambda tokenizer, prompt, limit: [1, 2, 3])
    args = argparse.Namespace(drafter="d", max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, seed=0,
                              no_fusion=True, tree_nodes=None, prompt_file=None, num_prompts=None)
    report = acceptance.measure(args, ["mtbench"], [0])
    assert (seen[0]["do_sample"], seen[0]["temperature"], seen[0]["top_k"]) == (True, 1.0, 0)
    assert report["top_k"] == 0
    header = acceptance.category_table([report, {**report, "top_k": 50}]).splitlines()[0]
    assert header == "| τ | d, T 1, tree 32 | d, T 1, top-k 50, tree 32 |"
    old = {k: v for k, v in report.items() if k != "top_k"}  # a report from before top_k was recorded
    assert acceptance.category_table([old]).splitlines()[0] == "| τ | d, T 1, tree 32 |"


def test_acceptance_reads_a_prompt_file_in_a_seeded_shuffle_and_tables_saved_reports(monkeypatch, tmp_path):
    """--task prompts: the file's prompts shuffled by seed 0, then --skip and --num-prompts; --table reads saved
    reports of one run and of several."""
    import argparse
    import random
    import types

    import torch

    from dflash2.benchmarks import acceptance
    from dflash2.tasks import write_jsonl

    seen = []
    stats = types.SimpleNamespace(completion_tokens=8, target_forwards=4, acceptance_length=2.0)
    drafter = types.SimpleNamespace(config=types.SimpleNamespace(tree_nodes=0), device=torch.device("cpu"),
                                    last_stats=stats)
    target = types.SimpleNamespace(dtype=torch.float32, generate=lambda ids, **kwargs: None)
    monkeypatch.setattr("dflash2.model_args.load_pair",
                        lambda args, check=False: (target, types.SimpleNamespace(eos_token_id=0), drafter))
    monkeypatch.setattr("dflash2.tasks.prompt_ids", lambda tokenizer, prompt, limit: seen.append(prompt) or [1, 2])
    texts = [f"prompt {i}" for i in range(6)]
    write_jsonl([{"prompt": text} for text in texts], tmp_path / "prompts.jsonl")
    args = argparse.Namespace(drafter="d", max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                              no_fusion=True, tree_nodes=None, prompt_file=tmp_path / "prompts.jsonl", num_prompts=3)
    report = acceptance.measure(args, ["prompts"], [1])
    random.Random(0).shuffle(texts)
    assert seen == texts[1:4]
    assert report["tasks"]["prompts"]["by_category"] == {"prompt file": {"prompts": 3, "tau": 2.0}}
    (tmp_path / "one.json").write_text(json.dumps(report))
    (tmp_path / "two.json").write_text(json.dumps({"runs": [report, {**report, "temperature": 1.0}]}))
    runs = acceptance.main(["--table", str(tmp_path / "one.json"), str(tmp_path / "two.json")])
    assert [run["temperature"] for run in runs] == [0.0, 0.0, 1.0]


def test_speed_times_sampling_when_asked_in_every_method(monkeypatch):
    """--temperature reaches every timed generate call (it was once parsed and ignored) and the plain CUDA-graph
    loop, which samples at the same settings."""
    import types

    import torch

    from dflash2.benchmarks import plain_graph, speed
    from dflash2.generation.sampling import Sampling

    seen = []
    drafter = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=True: (object(), tokenizer, drafter))
    monkeypatch.setattr("dflash2.tasks.task_prompts", lambda task, n, skip=0: ["a", "b"])
    monkeypatch.setattr("dflash2.tasks.task_categories", lambda task, n, skip=0: ["x", "x"])
    monkeypatch.setattr("dflash2.tasks.chat_prompt_ids", lambda tokenizer, prompt: [1, 2, 3])

    def timed(target, ids, device, **kwargs):
        seen.append(kwargs)
        return torch.cat([ids, torch.ones(1, 4, dtype=ids.dtype)], dim=1), 0.01

    monkeypatch.setattr(speed, "timed", timed)
    report = speed.main(["--temperature", "0.8", "--top-p", "0.9", "--methods", "plain", "--quick", "--tasks",
                         "mtbench", "--num-prompts", "2", "--device", "cpu"])
    assert len(seen) == 3  # the cold call, then each prompt once
    assert all((k["do_sample"], k["temperature"], k["top_p"], k["top_k"]) == (True, 0.8, 0.9, 0) for k in seen)
    assert report["settings"]["sampling"]["temperature"] == 0.8

    graph_calls = []

    def timed_graph(target, ids, max_new_tokens, eos, pad, compile=False, sampling=None):
        graph_calls.append(sampling)
        return torch.cat([ids, torch.ones(1, 4, dtype=ids.dtype)], dim=1), 0.01

    monkeypatch.setattr(plain_graph, "timed_plain_graph_generate", timed_graph)
    from helpers import tiny_target

    target = tiny_target("llama", seed=1)  # its generation config resolves the call's setting, as generate's would
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=True: (target, tokenizer, drafter))
    speed.main(["--temperature", "0.8", "--top-p", "0.9", "--methods", "plain-graph", "--quick", "--tasks",
                "mtbench", "--num-prompts", "2", "--device", "cpu"])
    assert graph_calls == [Sampling(True, 0.8, 0, 0.9)] * 3


def test_speed_reports_the_round_its_steady_state_timed(monkeypatch):
    """The default loop switches to its fused round when the background build is in: the report names the round the
    steady state ran (after the switch), not only the one the first call had."""
    import types

    import torch

    from dflash2.benchmarks import speed

    state = {"kind": "graph (eager kernels)", "building": True}

    def wait_for_fusion():
        built, state["building"] = state["building"], False
        if built:
            state["kind"] = "graph (fused ahead of time)"
        return built

    drafter = types.SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, config=types.SimpleNamespace(block_size=16),
        last_stats=types.SimpleNamespace(target_forwards=2), wait_for_fusion=wait_for_fusion,
        round_kind=lambda batch: state["kind"],
        round_runners=lambda batch: [types.SimpleNamespace(kind=state["kind"])])
    tokenizer = types.SimpleNamespace(eos_token_id=0)
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=True: (object(), tokenizer, drafter))
    monkeypatch.setattr("dflash2.tasks.task_prompts", lambda task, n, skip=0: ["a", "b"])
    monkeypatch.setattr("dflash2.tasks.task_categories", lambda task, n, skip=0: ["x", "x"])
    monkeypatch.setattr("dflash2.tasks.chat_prompt_ids", lambda tokenizer, prompt: [1, 2, 3])
    kinds_timed = []

    def timed(target, ids, device, **kwargs):
        kinds_timed.append(state["kind"])
        return torch.cat([ids, torch.ones(1, 4, dtype=ids.dtype)], dim=1), 0.01

    monkeypatch.setattr(speed, "timed", timed)
    report = speed.main(["--methods", "dflash2", "--sections", "steady", "--tasks", "mtbench", "--num-prompts", "2",
                         "--device", "cpu"])
    assert report["round_kind"] == "graph (eager kernels)"  # after the first call, before the build was in
    assert report["steady_round_kind"] == "graph (fused ahead of time)" == kinds_timed[-1]
    assert report["steady"]["mtbench"]["dflash2"]["tau"] == 2.0  # 4 tokens over 2 forwards per prompt


def test_speed_settings_change_runs_each_setting_twice_with_the_same_noise():
    """A new sampling setting's first call against its second: both seeded alike, EOS ignored, per-round times."""
    import types

    import torch

    from dflash2.benchmarks.speed import SAMPLING_SETTINGS, settings_change

    calls = []

    def call(method, ids, **extra):
        calls.append((method, extra, torch.rand(1).item()))  # the noise the call would draw
        stats = types.SimpleNamespace(target_forwards=10, acceptance_length=2.5)
        return None, 0.02 if len(calls) % 2 else 0.01, 25, stats

    drafter = types.SimpleNamespace(round_runners=lambda batch: [types.SimpleNamespace(kind="graph (fused)")])
    report = settings_change(call, {"humaneval": [torch.zeros(1, 7, dtype=torch.long)]}, drafter)
    assert len(calls) == 2 * len(SAMPLING_SETTINGS)
    for first, second in zip(calls[::2], calls[1::2]):
        assert first[1] == second[1] and first[1]["eos_token_id"] is None
        assert first[2] == second[2]  # the same noise
    row = report["calls"][0]
    assert (row["first_ms_per_round"], row["second_ms_per_round"], row["first_over_second"]) == (2.0, 1.0, 2.0)
    assert report["runners_before"] == report["runners_after"] == ["graph (fused)"] and report["prompt_tokens"] == 7


def test_speed_times_the_model_cards_call_and_splits_the_assisted_loops_round(monkeypatch):
    """`dflash2-card` (one prompt, default kwargs) runs beside the own loop, with its ratio in the first pass and the
    steady state; the `assisted` section splits a round of transformers' loop into drafting, verification and rest."""
    import types

    import torch

    from dflash2.benchmarks import speed
    from helpers import tiny_drafter, tiny_target

    target = tiny_target("llama", seed=1)
    drafter = tiny_drafter(target, seed=2).attach(target)
    tokenizer = types.SimpleNamespace(eos_token_id=3)
    monkeypatch.setattr("dflash2.model_args.load_pair", lambda args, check=True: (target, tokenizer, drafter))
    monkeypatch.setattr("dflash2.tasks.task_prompts", lambda task, n, skip=0: ["a", "b"])
    monkeypatch.setattr("dflash2.tasks.task_categories", lambda task, n, skip=0: ["x", "y"])
    monkeypatch.setattr("dflash2.tasks.chat_prompt_ids", lambda tokenizer, prompt: [5, 6, 7, 8 + len(prompt)])
    report = speed.main(["--methods", "dflash2,dflash2-card,dflash2-assisted", "--sections", "cold,steady,assisted",
                         "--tasks", "mtbench", "--num-prompts", "2", "--device", "cpu", "--max-new-tokens", "24",
                         "--first", "dflash2-card"])
    assert report["cold_start"]["order"] == ["dflash2-card", "dflash2", "dflash2-assisted"]
    assert report["first_pass_tokens_per_s"]["dflash2-card_over_own_loop"] > 0
    steady = report["steady"]["mtbench"]
    assert steady["dflash2-card"]["outputs"] == steady["dflash2"]["outputs"] == steady["dflash2-assisted"]["outputs"]
    assert steady["dflash2-card_over_own_loop"] > 0 and steady["dflash2-assisted_over_own_loop"] > 0
    split = report["assisted_round_split"]
    assert split["calls"] == 2 and split["rounds"] > 0 and split["draft_step"] == "eager"
    assert split["draft_ms"] > 0 and split["verify_ms"] > 0 and split["prefill_ms_per_call"] > 0
    assert abs(split["draft_ms"] + split["verify_ms"] + split["rest_ms"] - split["round_ms"]) < 0.01
    assert drafter.last_stats.loop == "transformers"


def test_speed_merges_the_reports_of_its_two_processes(tmp_path):
    """--merge: a `--methods dflash2,plain-graph` report and a `--methods plain` report over the same prompts become
    one, with the speedups and (greedy) the outputs' agreement; no model is loaded."""
    from dflash2.benchmarks import speed

    greedy = {"sampling": {"do_sample": False}}
    ours = {"settings": greedy, "cold_start": {"order": ["dflash2"], "dflash2": {"first_call_s": 1.0}},
            "round_kind": "graph (eager kernels)", "steady_round_kind": "graph (fused ahead of time)",
            "steady": {"mtbench": {"dflash2": {"tokens_per_s": 30.0, "tau": 3.0, "outputs": [[1, 2], [3, 4]]},
                                   "plain-graph": {"tokens_per_s": 15.0, "outputs": [[1, 2], [3, 5]]}}}}
    plain = {"settings": greedy, "cold_start": {"order": ["plain"], "plain": {"first_call_s": 2.0}},
             "steady": {"mtbench": {"plain": {"tokens_per_s": 10.0, "outputs": [[1, 2], [3, 5]]}}}}
    for name, report in (("ours", ours), ("plain", plain)):
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    merged = speed.main(["--merge", str(tmp_path / "ours.json"), str(tmp_path / "plain.json"),
                         "--out", str(tmp_path / "merged.json")])
    assert merged == json.loads((tmp_path / "merged.json").read_text())
    assert merged["cold_start"] == {"order": ["dflash2"], "dflash2": {"first_call_s": 1.0},
                                    "plain": {"first_call_s": 2.0}}
    entry = merged["steady"]["mtbench"]
    assert (entry["speedup"], entry["identical_outputs_bf16"], entry["dflash2"]) == (3.0, "1/2",
                                                                                     {"tokens_per_s": 30.0, "tau": 3.0})
    assert (entry["speedup_vs_plain_graph"], entry["plain_graph_vs_plain"]) == (2.0, 1.5)
    assert entry["plain_graph_identical_to_plain_bf16"] == "2/2"
    assert merged["steady_round_kind"] == "graph (fused ahead of time)"
