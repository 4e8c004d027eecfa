"""compile="background": the rounds (greedy and sampled) compiled ahead of time (`aot_compile`) in a child process,
loaded into the caller, run on the caller's own weights, buffers, state and sampling settings (their inputs: the
package holds no weights and serves every setting), checked, then used; a second process finds the package.

Inductor on a CPU compiles C++: these tests need a C++ compiler (the CI machine and the GPU image have one)."""

import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dflash2.generation import background_build, fused_package
from dflash2.generation.graphs import RoundRunner
from dflash2.generation.round_core import ROUND_STATE, RoundCore, round_state
from dflash2.generation.sampling import Sampling
from helpers import VOCAB, background_equals_plain, tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="inductor on a CPU needs a C++ compiler")


# per-row settings of a batch of three: greedy; then three sampled rows, each warped otherwise (the last with a
# temperature only); then the same three again with the EOS set changed
GREEDY = [Sampling()] * 3
SAMPLED = [Sampling(True, 0.8, 0, 0.9), Sampling(True, 1.3, 5, 1.0), Sampling(True, 0.6, 0, 1.0)]


def prefilled_core(max_new_tokens: int) -> RoundCore:
    """A batch-1 round core of a tiny Llama and its drafter (block 4), prefilled with a 7-token prompt."""
    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
    core = RoundCore(target, drafter, 1, 64)
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    core.prefill(ids, torch.ones_like(ids), max_new_tokens)
    return core


@pytest.mark.parametrize("tree_nodes", [0, 6], ids=["path", "tree"])
def test_capture_and_fusion_read_the_one_declared_round_state(tree_nodes):
    """The round's state is `ROUND_STATE`: the runner that captures, the fused program's signature and the child's
    spec all take exactly it, in its order; an undeclared buffer, or a round that replaces one, is refused."""
    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
    core = RoundCore(target, drafter, 2, 64, tree_nodes=tree_nodes)
    ids = torch.randint(4, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    core.prefill(ids, torch.ones_like(ids), 12)
    runner = RoundRunner(core, "eager", capture=False)
    for _ in range(2):
        runner()
    assert list(round_state(core)) == list(ROUND_STATE) == list(runner.state)
    program = fused_package.RoundProgram(core)
    assert program.state_names()[:len(ROUND_STATE)] == list(ROUND_STATE)
    assert [name for name, *_ in fused_package.spec_of(core)["state"]] == list(ROUND_STATE)
    runner.check_state_in_place()

    core.scratch = torch.zeros(2)  # a new buffer nobody declared
    for reader in (lambda: RoundRunner(core, "eager", capture=False), lambda: fused_package.RoundProgram(core),
                   lambda: fused_package.spec_of(core)):
        with pytest.raises(RuntimeError, match="ROUND_STATE"):
            reader()
    del core.scratch
    core.anchor = core.anchor.clone()  # a round that replaced a buffer instead of writing into it
    with pytest.raises(RuntimeError, match="anchor"):
        runner.check_state_in_place()


@pytest.mark.slow
@pytest.mark.parametrize("bucketed", [True, False], ids=["bucketed-prefill", "unbucketed"])
def test_package_runs_the_rounds_on_the_callers_own_tensors(tmp_path, bucketed):
    """Built from the configs alone (uninitialised weights) and once, the package runs both rounds over our weights,
    buffers and settings: for greedy rows and for sampled rows with other settings per row and another EOS set, five
    fused rounds leave exactly the tokens, lengths and counters five eager rounds leave, and close floats (sampled
    rounds: the same noise drawn into the core's buffers before each). The target ties its LM head to its embeddings,
    as SmolLM2 does: one weight input, in the child as in the caller. With a bucketed prefill (as the graph runner on
    CUDA has it) the core's prompt buffers are wider: the child builds them as wide."""
    target = tiny_target("llama", seed=2, tied=True)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
    core = RoundCore(target, drafter, 3, 64, bucketed_prefill=bucketed)
    ids = torch.randint(4, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    core.prefill(ids, torch.ones_like(ids), 40)  # the caches exist: the package can be checked over them
    path = tmp_path / "fused.round"
    fused_package.build_package(fused_package.spec_of(core), path)
    assert path.stat().st_size < 2 ** 20 * 8  # no weights inside
    fused = fused_package.load_fused_rounds(core, path)
    assert fused is not None and set(fused) == {False, True}
    tensors = dict(enumerate(fused_package.RoundProgram(core).state()))
    for settings, eos in ((GREEDY, (2,)), (SAMPLED, (2,)), (SAMPLED, (7, 11))):
        core.set_sampling(settings, eos)
        core.prefill(ids, torch.ones_like(ids), 40, generator=torch.Generator().manual_seed(1))
        eager_round = core.sampled_round if core.do_sample else core.round
        with fused_package.preserved(core):
            for round_index in range(5):
                core.draw_noise(torch.Generator().manual_seed(round_index))
                eager_round()
            eager = {name: t.clone() for name, t in tensors.items()}
        for round_index in range(5):
            core.draw_noise(torch.Generator().manual_seed(round_index))
            fused[core.do_sample]()
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                assert torch.allclose(tensor, eager[name], atol=1e-4, rtol=1e-4), (settings, name)
            else:
                assert torch.equal(tensor, eager[name]), (settings, name)
        assert int(core.rounds.max()) == 5 and int(core.output_length.max()) > 5


def test_the_child_refuses_a_spec_whose_state_it_cannot_build(tmp_path):
    """State tensors the child's core lacks (or shapes it builds otherwise) would fail the compiled round's guards in
    the caller: the child says so before compiling anything, and publishes nothing."""
    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
    core = RoundCore(target, drafter, 1, 64, bucketed_prefill=True)
    ids = torch.randint(4, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    core.prefill(ids, torch.ones_like(ids), 40)
    spec = fused_package.spec_of(core)
    spec["bucketed_prefill"] = False  # as a spec from before the flag was carried
    with pytest.raises(RuntimeError, match="other state tensors"):
        fused_package.build_package(spec, tmp_path / "fused.round")
    assert list(tmp_path.iterdir()) == []


def test_the_child_builds_at_the_callers_thread_count(tmp_path):
    """torch's thread count is part of a compiled round's guards: the child compiles at the caller's count (it sets it
    before anything else), and packages built at other counts have other keys."""
    core = prefilled_core(20)
    spec = fused_package.spec_of(core)
    assert spec["threads"] == torch.get_num_threads()
    other = {**spec, "threads": spec["threads"] + 1}
    assert fused_package.package_key(other) != fused_package.package_key(spec)
    other["bucketed_prefill"] = not spec["bucketed_prefill"]  # refused before any compile (see the test above)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="other state tensors"):
            fused_package.build_package(other, tmp_path / "fused.round")
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_caller_at_another_thread_count_than_the_childs_default_uses_its_package(tmp_path, monkeypatch):
    """The child's default is one thread (OMP_NUM_THREADS=1, as the tests set); a caller running two threads (as
    `dflash2 precompile --threads 2` does) still gets a package that its guards accept: fused, no fallback warning."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target = tiny_target("llama", seed=2)
        drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
        ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
        runner = background_equals_plain(target, drafter, ids, 16)
        runner.fusion.wait(timeout=600)
        assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-2000:]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning
            runner = background_equals_plain(target, drafter, ids, 16)
        assert runner.kind == "fused ahead of time"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_package_that_disagrees_is_refused(tmp_path, monkeypatch):
    core = prefilled_core(20)
    path = tmp_path / "fused.round"
    fused_package.build_package(fused_package.spec_of(core), path)
    for name in fused_package.ROUND_ENTRIES.values():  # one eager round now differs from what was compiled: noticed
        with monkeypatch.context() as patch:
            real_round = getattr(RoundCore, name)
            patch.setattr(RoundCore, name, lambda self, real=real_round: (real(self), self.output_length.add_(1)))
            with pytest.warns(UserWarning, match="disagreed with the eager round"):
                assert fused_package.load_fused_rounds(core, path) is None
    assert fused_package.load_fused_rounds(core, path) is not None


def test_background_fusion_through_generate_and_in_a_second_process(tmp_path, monkeypatch):
    """First call: unfused rounds at once, a child builds the package. Once it is there the next call checks and
    switches to it; outputs equal plain greedy throughout. Sampling with a new setting and another EOS set then runs
    on the same runner, fused, with no new child or package. A fresh set of cores (a second process) finds the package
    and uses it from its first call, a sampled one, with no child."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(target, seed=5, block_size=4).attach(target)
    prompts = [torch.randint(4, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14, 6)]

    def both(ids):
        return background_equals_plain(target, drafter, ids, 24)

    runner = both(prompts[0])
    assert runner.kind == "eager" and runner.fusion.state == "building"
    runner.fusion.wait(timeout=600)
    assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-2000:]
    assert drafter.wait_for_fusion()  # built, not yet switched to: the next call switches (a benchmark re-warms)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        runner = both(prompts[1])
    assert runner.kind == "fused ahead of time" and runner.fusion.state == "used"
    assert not drafter.wait_for_fusion()
    both(prompts[2])
    sampled = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[5, 6],
                   assistant_model=drafter, cache_implementation="static", compile="background")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.generate(prompts[2], **sampled)
    assert drafter.round_runners() == [runner] and runner.kind == "fused ahead of time"
    assert runner.core.do_sample and runner.core.eos_token_ids == [5, 6]
    both(prompts[1])  # greedy again on the same runner

    drafter.release()  # as in a new process: no cores, the package on disk
    target.generate(prompts[3], **sampled)
    (runner,) = drafter.round_runners()
    assert runner.fusion.process is None and runner.kind == "fused ahead of time"
    assert both(prompts[3]) is runner
    assert len(list(tmp_path.rglob("*.round"))) == 1

    # a CPU's default (compile left out): the package on disk for the shape, else the unfused round and no child
    drafter.release()
    default = dict(max_new_tokens=24, do_sample=False, assistant_model=drafter, cache_implementation="static")
    assert torch.equal(target.generate(prompts[3], **default), target.generate(prompts[3], max_new_tokens=24,
                                                                               do_sample=False))
    (runner,) = drafter.round_runners()
    assert runner.fusion.process is None and runner.kind == "fused ahead of time"
    longer = dict(default, max_new_tokens=300)  # more buffer columns: a shape with no package
    assert torch.equal(target.generate(prompts[3], **longer), target.generate(prompts[3], max_new_tokens=300,
                                                                              do_sample=False))
    runner = drafter.round_runners()[-1]
    assert runner.fusion.process is None and runner.kind == "eager" and runner.fusion.state == "absent"
    assert len(list(tmp_path.rglob("*.round"))) == 1


@pytest.mark.slow
def test_the_child_finishes_after_its_caller_has_exited(tmp_path, monkeypatch):
    """A script that makes one call and exits before the child is done: the child still builds and publishes the round
    (and removes its scratch folder), and the next process uses it from its first call."""
    import subprocess
    import sys
    import time

    script = tmp_path / "once.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from helpers import VOCAB, tiny_drafter, tiny_target\n"
        "target = tiny_target('llama', seed=8)\n"
        "drafter = tiny_drafter(target, seed=9, block_size=4).attach(target)\n"
        "ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(7))\n"
        "target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,\n"
        "                cache_implementation='static', compile='background')\n"
        "(runner,) = drafter.round_runners()\n"
        "print(runner.fusion.state)\n")
    cache = tmp_path / "cache"
    env = {**os.environ, "DFLASH2_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "building", done.stderr[-2000:]
    folder = cache / "fused-rounds"
    deadline = time.monotonic() + 600
    while not list(folder.glob("*.round")) and time.monotonic() < deadline:
        time.sleep(1)
    assert len(list(folder.glob("*.round"))) == 1, [p.read_text()[-2000:] for p in folder.glob("*.log")]
    deadline = time.monotonic() + 60  # the child's last step after publishing: its scratch folder
    while [p for p in folder.iterdir() if p.name.startswith(".")] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]

    monkeypatch.setenv("DFLASH2_CACHE", str(cache))
    target = tiny_target("llama", seed=8)
    drafter = tiny_drafter(target, seed=9, block_size=4).attach(target)
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(7))
    runner = background_equals_plain(target, drafter, ids, 12)
    assert runner.fusion.process is None and runner.kind == "fused ahead of time"


def tiny_pair(seed: int):
    target = tiny_target("llama", seed=seed)
    return target, tiny_drafter(target, seed=seed + 1, block_size=4).attach(target)


def prompt(n: int):
    return torch.randint(4, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))


def failed_first_build(tmp_path, monkeypatch, hook: str, seed: int, tokens: int):
    """A pair whose first call's child runs `hook` first (a sitecustomize on the path the child inherits) and fails;
    returns the pair once the child has ended."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(hook)
    monkeypatch.syspath_prepend(str(tmp_path / "hook"))  # FusionJob hands the caller's sys.path to the child
    target, drafter = tiny_pair(seed)
    runner = background_equals_plain(target, drafter, prompt(6), tokens)
    runner.fusion.wait(timeout=600)
    assert runner.fusion.process.returncode != 0
    return target, drafter


@pytest.mark.slow
def test_a_child_that_crashes_on_its_package_costs_the_caller_nothing(tmp_path, monkeypatch):
    """On a CUDA image (torch 2.11) loading an AOTInductor package crashed the loading process. The child loads and
    checks its round before publishing it: here that load is made to crash (a segmentation fault). The caller warns
    once, stays unfused, publishes nothing, and every output still equals plain greedy. A crash is no deterministic
    failure: nothing is remembered, and a later process (a fresh set of runners) tries again."""
    target, drafter = failed_first_build(tmp_path, monkeypatch, "import os, signal\nimport torch.compiler\n"
                                         "torch.compiler.load_compiled_function = lambda *a, **k: os.kill(os.getpid(), "
                                         "signal.SIGSEGV)\n", seed=6, tokens=20)
    with pytest.warns(UserWarning, match="building the fused round failed .* the next process tries again"):
        runner = background_equals_plain(target, drafter, prompt(11), 20)
    assert runner.fusion.state == "unfused" and runner.kind == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        background_equals_plain(target, drafter, prompt(8), 20)
    assert not list(tmp_path.rglob("*.round")) and not list(tmp_path.rglob("*.failed"))
    drafter.release()
    runner = background_equals_plain(target, drafter, prompt(6), 20)
    assert runner.fusion.state == "building"
    runner.fusion.process.kill()
    runner.fusion.wait()


def test_a_deterministic_build_failure_is_remembered_for_the_same_versions(tmp_path, monkeypatch):
    """A build that fails in the build itself (here: the compiler raises) is remembered in a note: a later process
    warns once and starts no child, until `dflash2 cache clear` removes the note."""
    target, drafter = failed_first_build(tmp_path, monkeypatch, "import torch\ndef refuse(*a, **k):\n    raise "
                                         "RuntimeError('no compiler')\ntorch.compile = refuse\n", seed=12, tokens=16)
    with pytest.warns(UserWarning, match="no compiler.*cache clear"):
        background_equals_plain(target, drafter, prompt(7), 16)
    assert len(list(tmp_path.rglob("*.failed"))) == 1
    drafter.release()
    with pytest.warns(UserWarning, match="an earlier build of this round failed"):
        runner = background_equals_plain(target, drafter, prompt(6), 16)
    assert runner.fusion.process is None and runner.fusion.state == "unfused"
    from dflash2.cli import main

    main(["cache", "clear"])
    assert not list(tmp_path.rglob("*.failed"))


def test_an_unwritable_cache_leaves_the_unfused_round_answering(tmp_path, monkeypatch):
    """DFLASH2_CACHE names a file: no package can be written. Every call answers (equal to plain greedy), with one
    warning naming the fault."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DFLASH2_CACHE", str(blocker))
    target, drafter = tiny_pair(14)
    with pytest.warns(UserWarning, match="decoding with the unfused round: the build could not start"):
        runner = background_equals_plain(target, drafter, prompt(5), 16)
    assert runner.fusion.state == "unfused" and runner.fusion.process is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        background_equals_plain(target, drafter, prompt(9), 16)


def test_no_child_starts_without_room_for_its_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    monkeypatch.setattr(background_build, "free_memory", lambda device: 0)
    target, drafter = tiny_pair(16)
    with pytest.warns(UserWarning, match="no room for the build beside the model .* GiB free"):
        runner = background_equals_plain(target, drafter, prompt(5), 16)
    assert runner.fusion.process is None and not list(tmp_path.rglob("*.log"))


@pytest.mark.slow
def test_a_killed_child_is_retried_and_a_damaged_package_is_rebuilt(tmp_path, monkeypatch):
    """A child killed mid-build (as by an out-of-memory killer) leaves no note: the caller warns once and a later
    process builds the round. A package damaged on disk is refused by the next process, which builds it again in the
    background and then uses it. Every output equals plain greedy."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target, drafter = tiny_pair(18)
    runner = background_equals_plain(target, drafter, prompt(7), 20)
    runner.fusion.process.kill()
    runner.fusion.wait()
    with pytest.warns(UserWarning, match="building the fused round failed .* the next process tries again"):
        background_equals_plain(target, drafter, prompt(8), 20)
    assert not list(tmp_path.rglob("*.failed")) and not list(tmp_path.rglob("*.round"))
    drafter.release()  # as in a later process
    runner = background_equals_plain(target, drafter, prompt(7), 20)
    assert runner.fusion.state == "building"
    runner.fusion.wait(timeout=600)
    assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-2000:]
    assert background_equals_plain(target, drafter, prompt(9), 20).kind == "fused ahead of time"
    (package,) = tmp_path.rglob("*.round")
    package.write_bytes(b"damaged" * 100)
    drafter.release()
    with pytest.warns(UserWarning, match="could not be used .* building it again in the background"):
        runner = background_equals_plain(target, drafter, prompt(7), 20)
    runner.fusion.wait(timeout=600)
    assert background_equals_plain(target, drafter, prompt(10), 20).kind == "fused ahead of time"


@pytest.mark.slow
def test_two_processes_starting_together_build_once(tmp_path):
    """Two processes with the same shapes start at once: one child builds, the other waits on the lock and uses its
    package; both end fused, their outputs equal to plain greedy."""
    import subprocess
    import sys

    script = tmp_path / "both.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from helpers import VOCAB, background_equals_plain, tiny_drafter, tiny_target\n"
        "target = tiny_target('llama', seed=20)\n"
        "drafter = tiny_drafter(target, seed=21, block_size=4).attach(target)\n"
        "ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(7))\n"
        "background_equals_plain(target, drafter, ids, 12)\n"
        "drafter.wait_for_fusion(timeout=600)\n"
        "print(background_equals_plain(target, drafter, ids, 12).kind)\n")
    env = {**os.environ, "DFLASH2_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    runs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [run.communicate(timeout=900) for run in runs]
    for run, (out, err) in zip(runs, results):
        assert run.returncode == 0 and out.strip() == "fused ahead of time", err[-2000:]
    logs = [log.read_text() for log in (tmp_path / "cache").rglob("*.log")]  # one per process that started a child
    assert sum("\nbuilt " in "\n" + log for log in logs) == 1, logs
    assert all("\nbuilt " in "\n" + log or "another process built" in log for log in logs), logs


@pytest.mark.slow
def test_background_fusion_of_a_batched_round(tmp_path, monkeypatch):
    """Left-padded rows of different lengths: the package of the batch bucket's round takes over, and each row still
    equals plain greedy of that row alone."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tiny_target("llama", seed=7)
    drafter = tiny_drafter(target, seed=8, block_size=4).attach(target)
    rows = [[5, 9, 14], [7, 8, 9, 10, 11, 12, 13], [21, 22, 23, 24, 25]]
    alone = [target.generate(torch.tensor([r]), max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(r):]
             for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for attempt in range(2):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0, assistant_model=drafter, compile="background")
        for row, reference in enumerate(alone):
            assert torch.equal(out[row, width:], reference), (attempt, row)
        (runner,) = drafter.round_runners()
        if attempt == 0:
            assert runner.core.batch == 4  # the bucket: rows beyond the batch are empty
            runner.fusion.wait(timeout=600)
    assert runner.kind == "fused ahead of time" and runner.fusion.state == "used"


@pytest.mark.slow
def test_background_fusion_with_a_sliding_window_drafter(tmp_path, monkeypatch):
    """The published DFlash 2 drafters mix sliding-window and full layers: their round compiles ahead of time too."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tiny_target("qwen3", seed=9)
    drafter = tiny_drafter(target, seed=10, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=5, block_size=4).attach(target)
    prompts = [torch.randint(4, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 4)]
    for attempt, ids in enumerate(prompts):
        reference = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
        out = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, assistant_model=drafter,
                              cache_implementation="static", compile="background")
        assert torch.equal(out, reference), attempt
        (runner,) = drafter.round_runners()
        if attempt == 0:
            runner.fusion.wait(timeout=600)
    assert runner.kind == "fused ahead of time"


@pytest.mark.slow
def test_background_fusion_of_a_tree_round(tmp_path, monkeypatch):
    """A round that verifies a tree compiles ahead of time like the path round: the package of the tree's core takes
    over, and greedy output still equals plain greedy."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target = tiny_target("llama", seed=11, vocab=16)
    drafter = tiny_drafter(target, seed=12, block_size=4, selector_top_k=8).attach(target)
    prompts = [torch.randint(4, 16, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 5)]
    for attempt, ids in enumerate(prompts):
        reference = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, assistant_model=drafter,
                              cache_implementation="static", compile="background", tree_nodes=9)
        assert torch.equal(out, reference), attempt
        (runner,) = drafter.round_runners()
        if attempt == 0:
            runner.fusion.wait(timeout=600)
    assert runner.kind == "fused ahead of time" and runner.core.tree_nodes == 9


def test_compile_takes_only_the_documented_values():
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="compile='later'"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=4, assistant_model=drafter,
                        cache_implementation="static", compile="later")


def test_the_check_allows_half_precision_rounding_and_one_near_tie_but_not_a_wrong_round():
    """`agreement` compares one round eager and fused: integer state exactly, floating state by relative error (tight
    in fp32, looser in half precision). A round that flips a token once (a near tie) is followed by another check;
    one that differs every round is refused, naming what differed. The core's state is as before either way."""
    assert fused_package.differs("x", torch.ones(8) * (1 + 1e-2), torch.ones(8)) is not None  # fp32: 1e-2 is too far
    half = torch.ones(8, dtype=torch.bfloat16)
    assert fused_package.differs("x", half * 1.01, half) is None
    assert fused_package.differs("x", -half, half) is not None
    assert "1 values differ" in fused_package.differs("t", torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]))

    core = prefilled_core(40)
    program = fused_package.RoundProgram(core)
    before = [t.clone() for t in program.state()]
    calls = []

    def flips(times):
        def fused():
            core.round()
            calls.append(1)
            if len(calls) <= times:
                core.anchor.add_(1)
        return fused

    assert fused_package.agreement(core, program, flips(1)) == [] and len(calls) == 2
    calls.clear()
    differences = fused_package.agreement(core, program, flips(10))
    assert len(calls) == fused_package.CHECK_ROUNDS and differences == ["anchor: 1 values differ"]
    assert all(torch.equal(a, b) for a, b in zip(before, program.state()))


def test_the_check_leaves_out_what_rejected_drafts_wrote():
    """A rejected draft leaves its token past the row's output, its features past `start` and its keys/values in cache
    columns from `start` on, all overwritten before anything reads them. A fused round that differs there alone (as
    rejected drafts flip on near ties between other kernels in half precision) agrees with the eager round; one that
    differs in a cache column before `start`, or in the emitted output, does not."""
    core = prefilled_core(40)
    program = fused_package.RoundProgram(core)
    junk_rows = []

    def differs_in_rejected_drafts():
        core.round()
        start, length = int(core.start[0]), int(core.output_length[0])
        rejected = core.context_columns[0] >= start
        junk_rows.append(int(rejected.sum()))
        core.output[0, length:] += 1
        core.features[0, rejected] += 1
        for cache in (core.target_cache, core.draft_cache):
            for buffer in (*cache.keys, *cache.values):
                buffer[:, :, start:] += 1

    def differs_in(where):
        def fused():
            core.round()
            start, length = int(core.start[0]), int(core.output_length[0])
            if where == "cache":
                core.target_cache.values[1][:, :, start - 1] += 1
            else:
                core.output[0, length - 1] += 1
        return fused

    assert fused_package.agreement(core, program, differs_in_rejected_drafts) == []
    assert junk_rows[0] > 0  # the round rejected drafts: their rows were changed
    found = fused_package.agreement(core, program, differs_in("cache"))
    assert found[0].startswith("target_cache.values[1]: relative error")
    assert fused_package.agreement(core, program, differs_in("output"))[0].startswith("row 0: the fused round emitted")


def padded_batch(dtype=torch.bfloat16, tree_nodes: int = 9):
    """A round core of four left-padded rows and a tree, prefilled; its target's LM head untied."""
    target = tiny_target("llama", seed=21).to(dtype)
    drafter = tiny_drafter(target, seed=22, block_size=4).to(dtype).attach(target)
    core = RoundCore(target, drafter, 4, 64, tree_nodes=tree_nodes)
    lengths = [3, 9, 6, 12]
    ids = torch.zeros(4, 12, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 12 - n:] = torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(row))
    core.prefill(ids, (ids > 0).long(), 40)
    return core


def near_tie(core, rounds: int = fused_package.CHECK_ROUNDS):
    """Tokens (chosen, tied, other): `chosen` is emitted in each of the core's next `rounds` eager rounds, `tied` and
    `other` in none; `tied`'s LM-head row becomes 0.995 of `chosen`'s, so wherever `chosen` is the target's argmax,
    `tied` is the runner-up by 0.5 % of its logit (a near tie)."""
    emitted = []
    with fused_package.preserved(core):
        for _ in range(rounds):
            begin = core.output_length.tolist()
            core.round()
            emitted.append({token for row, start in enumerate(begin)
                            for token in core.output[row, start: int(core.output_length[row])].tolist()})
    chosen = min(set.intersection(*emitted))
    tied, other = sorted(set(range(4, VOCAB)) - set.union(*emitted))[:2]
    with torch.no_grad():
        core.target.lm_head.weight[tied] = core.target.lm_head.weight[chosen] * 0.995
    return chosen, tied, other


def with_rival(core, chosen: int, rival: int, scale: float):
    """A "fused" round: the eager round of a target whose LM head gives `rival` `scale` times `chosen`'s row."""
    head = core.target.lm_head.weight

    def fused():
        saved = head[rival].clone()
        with torch.no_grad():
            head[rival] = head[chosen] * scale
        core.round()
        with torch.no_grad():
            head[rival] = saved
    return fused


def test_the_check_accepts_a_row_parted_by_a_near_tie_in_bf16_and_refuses_a_real_difference(monkeypatch):
    """The rejection of batch 8's package (bf16, a tree, left-padded rows): in every check round a row's fused tokens
    parted from the eager round's, which the check refused although the logits there were a near tie. Here the
    fused round takes the runner-up of a near tie wherever the eager round emits one token, in each of the three
    check rounds: the check compares the other rows in full and the parted rows up to where they parted, and
    accepts. A fused token far below the eager one (what wrong weights, positions or masks give) is refused, naming
    the row, the tokens and the margin; in fp32 no row may part."""
    core = padded_batch()
    program = fused_package.RoundProgram(core)
    chosen, tied, other = near_tie(core)
    parted_rows = []
    real_parting = fused_package.parting

    def counting(*args):
        parted, unexplained = real_parting(*args)
        parted_rows.append(parted["rows"].tolist())
        return parted, unexplained

    monkeypatch.setattr(fused_package, "parting", counting)
    assert fused_package.agreement(core, program, with_rival(core, chosen, tied, 1.01)) == []
    assert any(parted_rows[0]) and not all(parted_rows[0])  # a row parted (the old check refused); another agreed
    differences = fused_package.agreement(core, program, with_rival(core, chosen, other, 2.0))
    assert differences and differences[0].startswith("row ") and "(no near tie)" in differences[0], differences

    fp32 = padded_batch(torch.float32)
    chosen, tied, _ = near_tie(fp32)
    assert "the fused round emitted" in fused_package.agreement(fp32, fused_package.RoundProgram(fp32),
                                                         with_rival(fp32, chosen, tied, 1.01))[0]


def test_the_check_refuses_a_drafter_on_other_weights():
    """A fused round drafting with other drafter weights emits only the target's tokens (each is the target's
    choice), in other numbers per row: the rows part without a token in dispute. The drafter context it wrote this
    round, before where any row parted, still differs: refused."""
    core = padded_batch()
    program = fused_package.RoundProgram(core)
    weight = core.drafter.fc.weight

    def other_drafter():
        saved = weight.clone()
        with torch.no_grad():
            weight.mul_(-1)
        core.round()
        with torch.no_grad():
            weight.copy_(saved)

    differences = fused_package.agreement(core, program, other_drafter)
    assert differences and all(d.startswith("draft_cache.") for d in differences), differences


@pytest.mark.parametrize("graphs,compile,fusion", [(True, None, "build"), (False, None, "found"), (True, False, None),
                                                   (False, "background", "build"), (True, True, None)])
def test_the_default_fuses_in_the_background_where_rounds_are_captured(monkeypatch, graphs, compile, fusion):
    """compile=None (the default) means "background" on one CUDA device (rounds captured: `graphs`); elsewhere a
    package already on disk, with no build; an explicit choice is kept. (The runner and the fusion are stand-ins:
    this checks the choice alone.)"""
    from dflash2.generation import loop

    monkeypatch.setattr(loop, "RoundRunner", lambda core, mode, capture: type("Runner", (), dict(
        core=core, mode=mode, fusion=None))())
    monkeypatch.setattr(loop, "BackgroundFusion", lambda runner, build: "build" if build else "found")
    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target, seed=3, block_size=4).attach(target)
    runner = loop.round_runner_for(target, drafter, 1, 40, compile, graphs)
    assert runner.fusion == fusion
    assert runner.mode == ("compile" if compile is True else ("graph" if graphs else "eager"))


# ------------------------------------------------------------------------------------------------ shipped packages
def shipped_pair(tmp_path, seed: int):
    """A tiny pair whose drafter was loaded from a folder of its own (as the shipped drafter is), and the core of its
    first call (made with compile=False: the same shapes as compile="background"'s)."""
    target, drafter = tiny_pair(seed)
    drafter.name_or_path = str(tmp_path / "drafter")
    (tmp_path / "drafter").mkdir()
    target.generate(prompt(6), max_new_tokens=16, do_sample=False, assistant_model=drafter,
                    cache_implementation="static", compile=False)
    (runner,) = drafter.round_runners()
    return target, drafter, runner.core


def test_a_shipped_package_is_found_only_where_every_key_matches(tmp_path, monkeypatch):
    """`dflash2 precompile --artifacts` names a package by its portable key; a drafter folder's fused-rounds/ holding
    it is found for a core of the same shapes, configs, code and versions, and ignored when any of them differs:
    torch's or Python's version, the batch, the buffers' capacity, the drafter's config."""
    target, drafter, core = shipped_pair(tmp_path, 24)
    built = tmp_path / "built.round"
    built.write_bytes(b"a package")
    shipped = fused_package.export_package(core, built, tmp_path / "drafter" / fused_package.SHIPPED_FOLDER)
    assert fused_package.shipped_package(core) == shipped and shipped.read_bytes() == b"a package"
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.1")
        assert fused_package.shipped_package(core) is None
    with monkeypatch.context() as patch:
        patch.setattr(fused_package.platform, "python_version", lambda: "3.0.0")
        assert fused_package.shipped_package(core) is None
    for batch, capacity in ((2, core.capacity), (1, core.capacity * 2)):
        assert fused_package.shipped_package(RoundCore(target, drafter, batch, capacity)) is None
    with monkeypatch.context() as patch:
        patch.setattr(drafter.config, "tree_width", drafter.config.tree_width + 1)
        assert fused_package.shipped_package(core) is None
    assert fused_package.shipped_package(core) == shipped


def test_a_damaged_shipped_package_falls_back_with_one_warning(tmp_path, monkeypatch):
    """A shipped package that will not load is refused once, with one warning; the call answers with the unfused
    round (equal to plain greedy), a build starts in the background, and the shipped file is left as it was."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    target, drafter, core = shipped_pair(tmp_path, 26)
    damaged = tmp_path / "damaged.round"
    damaged.write_bytes(b"damaged" * 100)
    shipped = fused_package.export_package(core, damaged, tmp_path / "drafter" / fused_package.SHIPPED_FOLDER)
    drafter.release()
    with pytest.warns(UserWarning, match="could not be used .* building it again in the background"):
        runner = background_equals_plain(target, drafter, prompt(6), 16)
    assert runner.kind == "eager" and runner.fusion.state == "building"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        background_equals_plain(target, drafter, prompt(9), 16)
    runner.fusion.process.kill()
    runner.fusion.wait()
    assert shipped.read_bytes() == b"damaged" * 100


@pytest.mark.slow
def test_a_shipped_package_runs_from_the_first_call_of_a_fresh_cache(tmp_path, monkeypatch):
    """A package built once and exported into the drafter's folder: a process with an empty cache finds it, checks it
    and runs it from its first call, with no child; outputs equal plain greedy."""
    target, drafter, core = shipped_pair(tmp_path, 28)
    built = tmp_path / "built.round"
    fused_package.build_package(fused_package.spec_of(core), built)
    fused_package.export_package(core, built, tmp_path / "drafter" / fused_package.SHIPPED_FOLDER)
    drafter.release()
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "empty-cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner = background_equals_plain(target, drafter, prompt(6), 16)
    assert runner.fusion.process is None and runner.kind == "fused ahead of time"
    # the model card's way (AutoModel, trust_remote_code) finds the same shipped package in a fresh cache
    remote, _ = remote_copy(drafter, target, tmp_path / "drafter")
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "another-empty-cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner = background_equals_plain(target, remote, prompt(6), 16)
    assert runner.fusion.process is None and runner.kind == "fused ahead of time"


def test_shipped_packages_were_built_from_this_code(tmp_path):
    """An export writes `<key>.code` beside each package: the `code_digest` of the round's modules. Every package
    shipped in the drafter folder's or dflash2's fused-rounds/ must carry this checkout's digest: a package of other
    code is never found (its key differs), so an edit of the round's modules needs the packages exported again on a
    GPU (`python -m dflash2.benchmarks.first_minute --export`, docs/benchmarks.md)."""
    import dflash2

    target, drafter, core = shipped_pair(tmp_path, 36)
    built = tmp_path / "built.round"
    built.write_bytes(b"a package")
    exported = fused_package.export_package(core, built, tmp_path / "drafter" / fused_package.SHIPPED_FOLDER)
    digest = fused_package.code_digest(fused_package.spec_of(core))  # the shipped drafter runs the same modules
    assert exported.with_suffix(".code").read_text().strip() == digest
    folders = [Path(dflash2.__file__).parent / name / fused_package.SHIPPED_FOLDER
               for name in ("drafters/SmolLM2-135M-Instruct-DFlash2", ".")]
    codes = {path.name: path.with_suffix(".code") for folder in folders for path in folder.glob("*.round")}
    stale = [name for name, code in codes.items() if not code.is_file() or code.read_text().strip() != digest]
    assert not stale, f"shipped packages built from other code (export them again on a GPU): {stale}"


def remote_copy(drafter, target, folder):
    """`drafter` (detached from `target`) saved into `folder` and loaded back as the model card loads it (AutoModel,
    trust_remote_code: the folder's flat copies of the code), attached to `target`; and that copy's own
    `fused_package` module."""
    from transformers import AutoModel

    drafter.detach(target).save_pretrained(folder)
    remote = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).attach(target)
    assert type(remote).__module__.startswith("transformers_modules")
    return remote, sys.modules[type(remote).__module__.rsplit(".", 1)[0] + ".fused_package"]


def test_a_package_has_one_key_whether_dflash2_or_a_drafter_folder_runs_the_round(tmp_path):
    """The same round through dflash2's package and through a drafter folder's flat copies (module names, a
    generated header, imports with one dot, `auto_map` in the config) has one key, local and portable; another
    drafter config does not."""
    target, drafter = tiny_pair(34)
    keys = []
    for module in (fused_package, None):
        if module is None:
            drafter, module = remote_copy(drafter, target, tmp_path / "drafter")
        target.generate(prompt(6), max_new_tokens=16, do_sample=False, assistant_model=drafter,
                        cache_implementation="static", compile=False)
        (runner,) = drafter.round_runners()
        spec = module.spec_of(runner.core)
        keys.append((module.package_key(spec), module.package_key(spec, portable=True)))
    assert keys[0] == keys[1]
    spec["drafter_config"].tree_width += 1
    assert module.package_key(spec) != keys[1][0]


def test_a_shipped_cuda_package_serves_any_thread_count(monkeypatch):
    """CUDA kernels take no CPU threads: the portable key of a CUDA package leaves torch's thread count out (the round
    runs at its build's count, `loaded_round`), while a CPU package's key keeps it (inductor's C++ kernels are built
    for it) and the local key always does."""
    core = prefilled_core(20)
    spec = fused_package.spec_of(core)
    other = {**spec, "threads": spec["threads"] + 3}
    assert fused_package.package_key(other, portable=True) != fused_package.package_key(spec, portable=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    on_cuda = {**spec, "device": "cuda"}
    moved = {**on_cuda, "threads": spec["threads"] + 3}
    assert fused_package.package_key(moved, portable=True) == fused_package.package_key(on_cuda, portable=True)
    assert fused_package.package_key(moved, portable=True) != fused_package.package_key(spec, portable=True)


@pytest.mark.slow
def test_a_package_runs_at_its_builds_thread_count(tmp_path):
    """A package built at one thread and loaded by a process at two (as a shipped CUDA package may be) passes its
    guards and its check: its rounds run at one thread, and the caller's count is back after each."""
    core = prefilled_core(20)
    path = tmp_path / "fused.round"
    threads = torch.get_num_threads()
    try:
        fused_package.build_package({**fused_package.spec_of(core), "threads": 1}, path)
        torch.set_num_threads(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fused = fused_package.load_fused_rounds(core, path)
        assert fused is not None and torch.get_num_threads() == 2
        fused[False]()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_fused_tree_round_of_left_padded_rows_equals_the_eager_round_in_fp32(tmp_path):
    """Whether the fused tree round mishandles padded rows (the rejected batch 8 was left-padded): in fp32, four
    left-padded rows of different lengths with a tree, six fused rounds leave every row's tokens, lengths, counters and
    columns equal to six eager rounds', and its features and caches within fp32 rounding."""
    core = padded_batch(torch.float32)
    path = tmp_path / "fused.round"
    fused_package.build_package(fused_package.spec_of(core), path)
    fused = fused_package.load_fused_rounds(core, path)
    assert fused is not None
    tensors = dict(zip(fused_package.RoundProgram(core).state_names(), fused_package.RoundProgram(core).state()))
    with fused_package.preserved(core):
        for _ in range(6):
            core.round()
        eager = {name: tensor.clone() for name, tensor in tensors.items()}
    for _ in range(6):
        fused[False]()
    assert int(core.rounds.min()) == 6 and len(set(core.first_column.tolist())) == 4
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert torch.allclose(tensor, eager[name], atol=1e-4, rtol=1e-4), name
        else:
            assert torch.equal(tensor, eager[name]), name
