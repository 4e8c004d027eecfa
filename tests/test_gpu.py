"""GPU only (skipped without CUDA): DFlash 2's own loop replayed as CUDA graphs, against plain greedy, in fp32.

    python -m pytest -q -m gpu tests/test_gpu.py -s

DFLASH2_TEST_DRAFTER picks the drafter for the default-target test (default: the shipped one).
"""

import os
import random
from pathlib import Path

import pytest
import torch

from helpers import VOCAB, background_equals_plain, check_sampling_is_exact, tiny_drafter, tiny_target

pytestmark = pytest.mark.gpu
SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


@pytest.mark.parametrize("compile", [False, True], ids=["eager-graph", "fused-graph"])
def test_graph_loop_equals_plain_greedy_on_tiny_targets(compile):
    for arch in ("llama", "qwen3"):
        target = tiny_target(arch, seed=2).cuda()
        drafter = tiny_drafter(target, seed=3, block_size=8).cuda().attach(target)
        rng = random.Random(arch)
        for case in range(4):
            ids = torch.randint(4, VOCAB, (1, rng.randint(2, 30)), device="cuda")
            max_new = rng.choice([7, 40, 100])
            reference = target.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
            out = target.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                  assistant_model=drafter, cache_implementation="static", compile=compile)
            assert torch.equal(out, reference), (arch, case)
        kind = drafter.round_runners()[0].kind
        assert kind == ("graph (fused)" if compile else "graph (eager kernels)")


def test_background_fusion_switches_to_the_captured_package(tmp_path, monkeypatch):
    """compile="background" on the GPU: unfused graph first, the child's package (compiled for CUDA) loaded, checked
    and captured later; every output equals plain greedy; a fresh set of cores uses the package from its first call."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tiny_target("llama", seed=2).cuda()
    drafter = tiny_drafter(target, seed=3, block_size=8).cuda().attach(target)
    prompts = [torch.randint(4, VOCAB, (1, n), device="cuda") for n in (3, 17, 29, 8)]

    def both(ids):
        return background_equals_plain(target, drafter, ids, 40, eos_token_id=None)

    runner = both(prompts[0])
    assert runner.kind == "graph (eager kernels)"
    runner.fusion.wait(timeout=500)
    assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-3000:]
    assert both(prompts[1]).kind == "graph (fused ahead of time)"
    drafter.release()
    runner = both(prompts[2])
    assert runner.fusion.process is None and runner.kind == "graph (fused ahead of time)"
    both(prompts[3])


@pytest.mark.parametrize("compile", [False, True], ids=["eager-graph", "fused-graph"])
def test_sampled_tree_rounds_on_the_gpu_reproduce_the_target_distribution(compile):
    """The sampled tree round (children sampled from the drafter, speculative sampling at every node) captured on the
    GPU, its kernels eager or fused: the 2nd and 3rd new tokens follow the target's distribution (chi-square)."""
    check_sampling_is_exact(dict(temperature=1.0), draws=1200, device="cuda", cache_implementation="static",
                            tree_nodes=8, compile=compile)


@pytest.fixture(scope="module")
def default_pair_fp32():
    """The real target and the drafter in fp32 on the GPU, 10 HumanEval and 10 MT-Bench prompts past the first ones,
    and plain greedy's output for each (128 new tokens)."""
    from dflash2.generation import DFlash2Drafter, load_target
    from dflash2.tasks import chat_prompt_ids, task_prompts

    pytest.importorskip("gguf")
    drafter_dir = Path(os.environ.get("DFLASH2_TEST_DRAFTER", SHIPPED))
    drafter = DFlash2Drafter.from_pretrained(drafter_dir, dtype=torch.float32).cuda()
    try:
        target, tokenizer = load_target(drafter.config, dtype=torch.float32)
        prompts = task_prompts("humaneval", 10, skip=100) + task_prompts("mtbench", 10, skip=40)
    except (FileNotFoundError, ModuleNotFoundError, OSError) as error:
        pytest.skip(f"default target or evaluation prompts not installed: {error}")
    target.cuda().eval()
    drafter.eval().attach(target)
    greedy = dict(max_new_tokens=128, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    encoded = [torch.tensor([chat_prompt_ids(tokenizer, p)], device="cuda") for p in prompts]
    plain = [target.generate(ids, attention_mask=torch.ones_like(ids), **greedy) for ids in encoded]
    return target, tokenizer, drafter, greedy, encoded, plain


@pytest.mark.parametrize("tree_nodes", [0, 32], ids=["path", "tree-32"])
def test_graph_loop_equals_plain_greedy_on_the_default_target(default_pair_fp32, tree_nodes):
    """The graph loop of eager kernels (batch 1 and batch 4, left-padded) equals plain greedy token for token,
    verifying a path or a tree."""
    target, tokenizer, drafter, greedy, encoded, plain = default_pair_fp32
    greedy = dict(greedy, tree_nodes=tree_nodes)
    graph, taus = [], []
    for ids in encoded:
        graph.append(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                     cache_implementation="static", compile=False, **greedy))
        taus.append(drafter.last_stats.acceptance_length)
    # batch 4, left-padded
    batched_equal = 0
    for begin in range(0, len(encoded), 4):
        group = encoded[begin: begin + 4]
        width = max(ids.shape[1] for ids in group)
        ids = torch.stack([torch.nn.functional.pad(x[0], (width - x.shape[1], 0), value=tokenizer.eos_token_id)
                           for x in group])
        mask = torch.stack([torch.nn.functional.pad(torch.ones_like(x[0]), (width - x.shape[1], 0)) for x in group])
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, compile=False, **greedy)
        for row, x in enumerate(group):
            want = plain[begin + row][0, x.shape[1]:].tolist()
            batched_equal += out[row, width: width + len(want)].tolist() == want
    equal = sum(map(torch.equal, graph, plain))
    print(f"\n[gpu fp32, tree_nodes={tree_nodes}] {len(encoded)} prompts, tau {sum(taus) / len(taus):.2f}; identical "
          "to plain greedy: graph loop "
          f"batch 1 {equal}/{len(encoded)}, batch 4 {batched_equal}/{len(encoded)}")
    assert equal == len(encoded) and batched_equal == len(encoded)


def test_the_model_cards_call_runs_captured_rounds_and_equals_plain_greedy_on_the_default_target(default_pair_fp32):
    """The model card's call (one prompt, default kwargs: no cache_implementation, no compile) takes DFlash 2's own
    loop in captured graph rounds from its first call, and equals plain greedy token for token."""
    target, tokenizer, drafter, greedy, encoded, plain = default_pair_fp32
    outs, loops, kinds = [], set(), set()
    for ids in encoded:
        outs.append(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, **greedy))
        loops.add(drafter.last_stats.loop)
        kinds.update(runner.kind for runner in drafter.round_runners(batch=1))
    equal = sum(map(torch.equal, outs, plain))
    print(f"\n[gpu fp32] the model card's call: loops {sorted(loops)}, rounds {sorted(kinds)}; identical to plain "
          f"greedy {equal}/{len(encoded)}")
    assert loops == {"dflash2"} and equal == len(encoded)
    assert kinds and all(kind.startswith("graph") for kind in kinds)


def test_transformers_loop_replays_the_drafting_step_and_equals_plain_greedy_on_the_default_target(default_pair_fp32,
                                                                                                 monkeypatch):
    """transformers' assisted loop (`loop="transformers"`, the loop of a target spread by device_map): the drafter's
    step is a replayed CUDA graph, our candidate generator reads nothing back from the device after its first round
    (transformers 5.18 and later: 5.17's loop needs the drafts cut at EOS on the host), and the output equals plain
    greedy token for token."""
    import transformers
    from packaging.version import Version

    from dflash2.generation import DFlash2CandidateGenerator

    target, tokenizer, drafter, greedy, encoded, plain = default_pair_fp32
    no_host_read = Version(transformers.__version__).release >= (5, 18)
    get_candidates, checked = DFlash2CandidateGenerator.get_candidates, []

    def get_candidates_without_sync(self, *args, **kwargs):
        if self.step is None or not no_host_read:  # the first round stores the prompt and captures the step
            return get_candidates(self, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
        try:
            return get_candidates(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(True)

    monkeypatch.setattr(DFlash2CandidateGenerator, "get_candidates", get_candidates_without_sync)
    outs, steps = [], set()
    for ids in encoded:
        outs.append(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                    loop="transformers", **greedy))
        steps.add(drafter.last_stats.draft_step)
    equal = sum(map(torch.equal, outs, plain))
    print(f"\n[gpu fp32] transformers' loop: drafting step {sorted(steps)}, rounds checked for host reads "
          f"{len(checked)}; identical to plain greedy {equal}/{len(encoded)}")
    assert steps == {"graph"} and equal == len(encoded)
    assert len(checked) > len(encoded) or not no_host_read


def test_default_loop_fused_ahead_of_time_equals_plain_greedy_on_the_default_target(default_pair_fp32, tmp_path,
                                                                                     monkeypatch):
    """The default (compile=None: fused in the background) after its switch: the round compiled ahead of time by the
    child for this fp32 pair, captured, equals plain greedy token for token on the 20 prompts."""
    target, tokenizer, drafter, greedy, encoded, plain = default_pair_fp32
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    drafter.release()
    target.generate(encoded[0], attention_mask=torch.ones_like(encoded[0]), assistant_model=drafter,
                    cache_implementation="static", **greedy)  # the first call starts the child
    runner = next(r for r in drafter.round_runners() if r.fusion is not None)
    runner.fusion.wait(timeout=400)
    assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-3000:]
    fused, kinds = [], set()
    for ids in encoded:
        fused.append(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                     cache_implementation="static", **greedy))
        kinds.add(runner.kind)
    equal = sum(map(torch.equal, fused, plain))
    print(f"\n[gpu fp32] fused ahead of time ({sorted(kinds)}): identical to plain greedy {equal}/{len(encoded)}")
    assert kinds == {"graph (fused ahead of time)"} and equal == len(encoded)


def test_batch_8_reaches_its_fused_round_and_each_row_equals_plain_greedy(default_pair_fp32, tmp_path, monkeypatch):
    """Batch 8, left-padded, tree of 32: HumanEval 120-127 and MT-Bench 50-57 (the batches whose package bf16 once
    refused) each run the fused round built in the background for their bucket, and every row equals plain greedy of
    that row alone, in fp32."""
    from dflash2.tasks import chat_prompt_ids, left_padded, task_prompts

    target, tokenizer, drafter, greedy, _, _ = default_pair_fp32
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    drafter.release()
    batches = []
    for task, skip in (("humaneval", 120), ("mtbench", 50)):  # both builds start before either is waited for
        prompts = [chat_prompt_ids(tokenizer, text) for text in task_prompts(task, 8, skip=skip)]
        ids, mask = (t.cuda() for t in left_padded(prompts, tokenizer.eos_token_id))
        target.generate(ids, attention_mask=mask, assistant_model=drafter, cache_implementation="static", **greedy)
        batches.append((prompts, ids, mask, drafter.round_runners(batch=8)[-1]))  # the runner this call ran
    kinds, equal, rows = set(), 0, 0
    for prompts, ids, mask, runner in batches:
        runner.fusion.wait(timeout=400)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, cache_implementation="static",
                              **greedy)
        kinds.add(runner.kind)
        for row, prompt in enumerate(prompts):
            alone = torch.tensor([prompt], device="cuda")
            want = target.generate(alone, attention_mask=torch.ones_like(alone), **greedy)[0, len(prompt):].tolist()
            equal += out[row, ids.shape[1]: ids.shape[1] + len(want)].tolist() == want
            rows += 1
    print(f"\n[gpu fp32] batch 8, tree of 32: rounds {sorted(kinds)}; rows identical to plain greedy {equal}/{rows}")
    assert kinds == {"graph (fused ahead of time)"} and equal == rows
