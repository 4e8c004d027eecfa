"""DFlash 2 inside `target.generate(assistant_model=drafter)`: lossless greedy, exact sampling, entry points, errors."""

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from dflash2.generation import DFlash2CandidateGenerator, attached_drafter, detach
from dflash2.generation.candidate_generator import cut_after_eos
from helpers import EOS, VOCAB, check_sampling_is_exact, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def plain_greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.fixture
def oracle(monkeypatch):
    """Make drafts partly right: the first j drafts of each round come from the reference continuation.

    The real drafter still runs (cache bookkeeping, selector); only its tokens are overwritten, so acceptance
    lengths vary from 0 to the whole block and every verification path of the loop is exercised.
    """
    state = {"reference": None, "rng": random.Random(0)}
    original = DFlash2CandidateGenerator.get_candidates

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        reference = state["reference"]
        start, end = input_ids.shape[1], candidates.shape[1]
        if reference is not None and end > start:
            right = state["rng"].randint(0, end - start)
            usable = min(start + right, reference.shape[1])
            candidates = candidates.clone()
            candidates[:, start:usable] = reference[:, start:usable]
            drafts = cut_after_eos(candidates[:, start:], self.eos_token_ids)  # the generator's own invariant
            candidates = candidates[:, : start + drafts.shape[1]]
        return candidates, logits

    monkeypatch.setattr(DFlash2CandidateGenerator, "get_candidates", get_candidates)
    return state


CASES = [(arch, identity, seed) for arch in ("llama", "qwen3") for identity in (False, True) for seed in range(4)]


@pytest.mark.parametrize("arch,identity,seed", CASES)
def test_greedy_equals_plain_greedy(arch, identity, seed, oracle):
    target = tiny_target(arch, seed=seed)
    drafter = tiny_drafter(target, seed=seed + 10, identity=identity, block_size=[4, 5, 8][seed % 3])
    drafter.attach(target)
    rng = random.Random(seed)
    for case in range(5):
        prompt_length = rng.randint(1, 12)
        max_new = rng.choice([1, 2, 7, 13, 22, 31])
        ids = torch.randint(4, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(seed * 100 + case))
        reference = plain_greedy(target, ids, max_new_tokens=max_new)
        oracle["reference"] = reference
        speculative = plain_greedy(target, ids, max_new_tokens=max_new, assistant_model=drafter, loop="transformers")
        assert torch.equal(speculative, reference), (case, prompt_length, max_new)
        stats = drafter.last_stats
        assert stats.completion_tokens == reference.shape[1] - prompt_length
        assert stats.target_forwards <= stats.completion_tokens


def test_the_drafters_buffers_grow_mid_call_and_stay_exact(oracle, monkeypatch):
    """transformers' loop sizes the drafter's buffers for the prompt and 256 new tokens, and doubles them when the
    context outgrows them: a long answer crosses that bound and still equals plain greedy, drafts accepted after it."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    sizes, core_of = [], DFlash2CandidateGenerator.core_of

    def recording_core_of(self, columns):
        core = core_of(self, columns)
        sizes.append(core.capacity)
        return core

    monkeypatch.setattr(DFlash2CandidateGenerator, "core_of", recording_core_of)
    oracle["reference"] = reference = plain_greedy(target, ids, max_new_tokens=400, eos_token_id=None)
    out = plain_greedy(target, ids, max_new_tokens=400, eos_token_id=None, assistant_model=drafter, loop="transformers")
    assert torch.equal(out, reference)
    assert sizes[0] == 9 + 256 + 8 and len(sizes) == 2 and sizes[1] == 9 + 400 + 8  # grew once, to the call's end
    assert drafter.last_stats.accepted_per_position[-1] > 0


def test_oracle_drafts_raise_acceptance(oracle):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=8).attach(target)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    oracle["reference"] = plain_greedy(target, ids, max_new_tokens=40)
    plain_greedy(target, ids, max_new_tokens=40, assistant_model=drafter, loop="transformers")
    stats = drafter.last_stats
    assert stats.acceptance_length > 2.0
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_stops_at_eos_inside_a_block(arch, oracle):
    """Pick a token the target emits mid-continuation as EOS: both paths must stop right after it."""
    for seed in range(50):  # find a target/prompt whose continuation has a fresh token a few steps in
        target = tiny_target(arch, seed=seed)
        ids = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        free_run = plain_greedy(target, ids, max_new_tokens=30, eos_token_id=None)
        new_tokens = free_run[0, 5:].tolist()
        fresh = [t for i, t in enumerate(new_tokens) if i >= 2 and new_tokens.index(t) == i]
        if fresh:
            eos = fresh[0]
            break
    drafter = tiny_drafter(target, block_size=8).attach(target)
    reference = plain_greedy(target, ids, max_new_tokens=30, eos_token_id=eos)
    oracle["reference"] = free_run  # the oracle happily drafts past the EOS
    speculative = plain_greedy(target, ids, max_new_tokens=30, eos_token_id=eos, assistant_model=drafter,
                               loop="transformers")
    assert torch.equal(speculative, reference)
    assert speculative[0, -1].item() == eos


def test_greedy_with_repetition_penalty_is_lossless(oracle):
    target = tiny_target("llama", seed=3)
    drafter = tiny_drafter(target).attach(target)
    ids = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    reference = plain_greedy(target, ids, max_new_tokens=25, repetition_penalty=1.3)
    oracle["reference"] = reference
    speculative = plain_greedy(target, ids, max_new_tokens=25, repetition_penalty=1.3, assistant_model=drafter)
    assert torch.equal(speculative, reference)


def test_a_drafter_loaded_with_another_block_size_drafts_that_block_and_stays_lossless(oracle, tmp_path):
    """`from_pretrained(folder, block_size=4)` (the CLI's --block-size): a block-8 drafter drafts 3 tokens per round in
    every loop, output still equals plain greedy; a block of 1 is refused at load, not at the first round."""
    from dflash2.generation import DFlash2Drafter

    target = tiny_target("llama", seed=5)
    tiny_drafter(target, seed=5, block_size=8).save_pretrained(tmp_path / "drafter")
    drafter = DFlash2Drafter.from_pretrained(tmp_path / "drafter", dtype=torch.float32, block_size=4).attach(target)
    assert drafter.config.block_size == 4
    ids = torch.tensor([[5, 9, 14, 20, 7, 31, 2, 11]])
    plain = plain_greedy(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=24)
    oracle["reference"] = plain
    for extra in ({"loop": "transformers"}, {"cache_implementation": "static"}):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              assistant_model=drafter, **extra)
        assert torch.equal(out, plain), extra
        stats = drafter.last_stats
        assert stats.block_size == 4 and len(stats.accepted_per_position) == 3, extra
        if "loop" in extra:  # the oracle (assisted loop only) makes some drafts right: rounds accepted several tokens
            assert stats.target_forwards < plain.shape[1] - ids.shape[1]
    with pytest.raises(ValueError, match="block_size=1; a block needs the anchor plus at least one mask"):
        DFlash2Drafter.from_pretrained(tmp_path / "drafter", dtype=torch.float32, block_size=1)


def test_dflash1_drafter_greedy_is_lossless():
    target = tiny_target("qwen3", seed=2)
    drafter = tiny_drafter(target, version=1).attach(target)
    ids = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    assert torch.equal(plain_greedy(target, ids, max_new_tokens=20, assistant_model=drafter),
                       plain_greedy(target, ids, max_new_tokens=20))


# ------------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("settings", [dict(temperature=1.0), pytest.param(dict(temperature=0.6), marks=pytest.mark.slow),
                                      pytest.param(dict(temperature=1.0, top_p=0.8), marks=pytest.mark.slow)])
def test_speculative_sampling_reproduces_the_target_distribution(settings):
    check_sampling_is_exact(settings, draws=1500)


# ------------------------------------------------------------------------------------------------ entry points
def test_attach_and_detach():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor([[5, 6, 7]])
    drafter.attach(target)
    target.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=drafter)
    assert drafter.last_stats.target_forwards > 0
    drafter.detach(target)
    assert "generate" not in target.__dict__ and "_get_candidate_generator" not in target.__dict__
    with pytest.raises(RuntimeError, match="drafter.attach\\(target\\)"):
        target.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=drafter)


def test_unattached_drafter_gives_one_clear_error():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(RuntimeError, match="not attached"):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False, assistant_model=drafter)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_beams=2), "not beam search"),
    (dict(num_return_sequences=2, do_sample=True), "one sequence per prompt"),
])
def test_unsupported_requests_are_refused_clearly(kwargs, message):
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[5, 6]]), max_new_tokens=4, assistant_model=drafter, **kwargs)


def test_a_batch_with_cache_implementation_static_runs_the_same_loop():
    """Batches always run DFlash 2's own fixed-buffer loop; asking for a static cache changes nothing."""
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    ids = torch.tensor([[5, 6, 9], [7, 8, 10]])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter)
    static = target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter,
                             cache_implementation="static")
    assert torch.equal(plain, static)
    for row in range(2):
        alone = target.generate(ids[row: row + 1], max_new_tokens=6, do_sample=False)
        assert torch.equal(static[row], alone[0])


def test_mismatched_targets_are_refused_clearly():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="Vocabulary mismatch"):
        drafter.attach(tiny_target(vocab=VOCAB + 4))
    with pytest.raises(ValueError, match="Hidden-size mismatch"):
        drafter.attach(tiny_target(hidden=32))
    with pytest.raises(ValueError, match="has only 3 layers"):
        drafter.attach(tiny_target(layers=3))


def test_builtin_dflash_speculation_runs_our_drafter_losslessly():
    target = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(target, seed=4)
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    reference = plain_greedy(target, ids, max_new_tokens=21)
    builtin = target.generate(ids, max_new_tokens=21, do_sample=False, assistant_model=drafter,
                              speculation_type="dflash")
    assert torch.equal(builtin, reference)


def test_pipeline_with_assistant_model():
    from transformers import PreTrainedTokenizerFast
    tokenizer = _tiny_tokenizer()
    target = tiny_target()
    drafter = tiny_drafter(target).attach(target)
    generator = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    out = generator("a b c", max_new_tokens=6, do_sample=False)
    assert drafter.last_stats.target_forwards > 0
    assert drafter.last_stats.loop == "dflash2"  # what the pipeline passes to generate keeps it on the own loop
    detach(target)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)("a b c", max_new_tokens=6, do_sample=False)
    assert out[0]["generated_text"] == plain[0]["generated_text"]
    assert isinstance(tokenizer, PreTrainedTokenizerFast)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"a": 10, "b": 11, "c": 12})
    for name, index in [("t10", None), ("t11", None), ("t12", None)]:
        vocab.pop(name)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token=f"t{EOS}", pad_token="t0",
                                   unk_token="t2")


def _export_target_and_drafter(tmp_path, oracle_free=True):
    target = tiny_target("llama", seed=6)
    tokenizer = _tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target, seed=6, target_name_or_path=str(tmp_path / "target"))
    with pytest.warns(UserWarning, match="no chat template"):  # the tiny tokenizer has none: exports say so
        drafter.save_pretrained(tmp_path / "drafter", tokenizer=tokenizer)
    return target, tokenizer


def test_custom_generate_loads_the_drafter_folder(tmp_path):
    target, _ = _export_target_and_drafter(tmp_path)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    reference = plain_greedy(target, ids, max_new_tokens=17)
    out = target.generate(ids, max_new_tokens=17, do_sample=False, custom_generate=str(tmp_path / "drafter"),
                          trust_remote_code=True)
    assert torch.equal(out, reference)
    drafter = attached_drafter(target)
    assert drafter.last_stats.target_forwards > 0
    again = target.generate(ids, max_new_tokens=17, do_sample=False, custom_generate=str(tmp_path / "drafter"),
                            trust_remote_code=True)
    assert torch.equal(again, reference) and attached_drafter(target) is drafter  # loaded once, cached


FRESH_PROCESS = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("dflash2", "configuration_dflash2", "modeling_dflash2", "generation",
                                      "training", "benchmarks", "tasks", "cli"):
                raise ImportError("the dflash2 project is not importable in this process: " + name)
    sys.meta_path.insert(0, Block())
    sys.path = [p for p in sys.path if p not in ("", ".") and not p.rstrip("/").endswith("main")]
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
    drafter_dir, target_dir = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[5, 9, 14, 20, 7, 31]])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    reference = target.generate(ids, max_new_tokens=15, do_sample=False)
    # (a) AutoModel + attach
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True)
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    attached_drafter = importlib.import_module(type(drafter).__module__.rsplit(".", 1)[0] + ".dispatch").attached_drafter
    drafter.attach(target)
    out = target.generate(ids, max_new_tokens=15, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, reference), (out, reference)
    assert drafter.last_stats.target_forwards > 0 and drafter.last_stats.loop == "dflash2"
    drafter.release()
    # (a') compile="background": the child that compiles the round imports these flat remote-code files too
    import os, tempfile
    # a fresh folder inside the run's own cache (removed with it)
    os.environ["DFLASH2_CACHE"] = tempfile.mkdtemp(dir=os.environ.get("DFLASH2_CACHE"))
    for attempt in range(2):
        out = target.generate(ids, max_new_tokens=15, do_sample=False, assistant_model=drafter,
                              cache_implementation="static", compile="background")
        assert torch.equal(out, reference), (attempt, out, reference)
        (runner,) = drafter.round_runners()
        if attempt == 0:
            runner.fusion.wait(timeout=600)
            assert runner.fusion.process.returncode == 0, runner.fusion.log.read_text()[-3000:]
    assert runner.kind == "fused ahead of time", runner.kind
    drafter.detach(target)
    # (b) custom_generate
    out = target.generate(ids, max_new_tokens=15, do_sample=False, custom_generate=drafter_dir, trust_remote_code=True)
    assert torch.equal(out, reference)
    # (c) pipeline with assistant_model
    tok = AutoTokenizer.from_pretrained(target_dir)
    fresh_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    drafter.attach(fresh_target)
    text = pipeline("text-generation", model=fresh_target, tokenizer=tok, assistant_model=drafter)(
        "a b c", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    # (d) the model-card one-liner: the drafter folder names its target
    one_liner = pipeline("text-generation", model=drafter_dir, trust_remote_code=True)
    assert attached_drafter(one_liner.model) is not None
    text_d = one_liner("a b c", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text_d == text, (text_d, text)
    assert attached_drafter(one_liner.model).last_stats.target_forwards > 0
    print("FRESH-PROCESS-OK")
""")


@pytest.mark.slow
def test_exported_folder_works_in_a_fresh_process(tmp_path):
    _export_target_and_drafter(tmp_path)
    exported = sorted(p.name for p in (tmp_path / "drafter").iterdir())
    for name in ("config.json", "configuration_dflash2.py", "modeling_dflash2.py", "candidate_generator.py",
                 "round_core.py", "dispatch.py", "drafter.py", "custom_generate"):
        assert name in exported
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(tmp_path / "drafter"), str(tmp_path / "target")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert "FRESH-PROCESS-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-6000:]


def test_target_dispatched_by_device_map_with_offloaded_layers(tmp_path, oracle):
    """A target placed by accelerate (device_map with layers and the LM head offloaded to disk): still lossless.

    On CPU this exercises the hooks `device_map` installs; the multi-GPU run is `benchmarks.scale --parts lossless`.
    """
    from transformers import AutoModelForCausalLM

    tiny_target("llama", seed=2).save_pretrained(tmp_path / "target")
    reference_model = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk"}
    device_map.update({f"model.layers.{i}": ("cpu" if i < 3 else "disk") for i in range(6)})
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32, device_map=device_map,
                                                  offload_folder=str(tmp_path / "offload"))
    assert target.lm_head.weight.device.type == "meta"  # really offloaded
    drafter = tiny_drafter(target, seed=2).attach(target)
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    reference = plain_greedy(reference_model, ids, max_new_tokens=16)
    oracle["reference"] = reference
    assert torch.equal(plain_greedy(target, ids, max_new_tokens=16, assistant_model=drafter), reference)
    assert drafter.last_stats.loop == "transformers"  # chosen by itself: the own loop's buffers need one device
    assert "spread over several devices" in drafter.last_stats.loop_reason
    assert drafter.last_stats.accepted_per_position[0] > 0
