"""GPU only (skipped without CUDA): the compiled static loop (CUDA graphs) against the eager loops, in fp32.

    python -m pytest -q -m gpu tests/test_gpu.py -s

DFLASH2_TEST_DRAFTER picks the drafter for the default-target test (default: the shipped one).
"""

import os
import random
from pathlib import Path

import pytest
import torch

from generation.fast_path import Sampling, StaticDFlash2Decoder
from helpers import VOCAB, tiny_drafter, tiny_target

pytestmark = pytest.mark.gpu
SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def test_compiled_static_loop_equals_eager_and_plain_on_tiny_targets():
    for arch in ("llama", "qwen3"):
        target = tiny_target(arch, seed=2).cuda()
        drafter = tiny_drafter(target, seed=3, block_size=8).cuda().attach(target)
        eager = StaticDFlash2Decoder(target, drafter, capacity=256, compile=False)
        compiled = StaticDFlash2Decoder(target, drafter, capacity=256, compile=True)
        rng = random.Random(arch)
        for case in range(4):
            ids = torch.randint(4, VOCAB, (1, rng.randint(2, 30)), device="cuda")
            max_new = rng.choice([7, 40, 100])
            reference = target.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
            assert torch.equal(eager.generate(ids, max_new, Sampling()), reference), (arch, case)
            assert torch.equal(compiled.generate(ids, max_new, Sampling()), reference), (arch, case)


def test_compiled_static_loop_equals_eager_on_the_default_target():
    """The real target in fp32: plain greedy, the eager assisted loop, the eager static loop and the compiled one."""
    from generation.integration import chat_prompt_ids, load_target
    from modeling_dflash2 import DFlash2DraftModel

    pytest.importorskip("gguf")
    drafter_dir = Path(os.environ.get("DFLASH2_TEST_DRAFTER", SHIPPED))
    drafter = DFlash2DraftModel.from_pretrained(drafter_dir, dtype=torch.float32).cuda()
    try:
        target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    except (FileNotFoundError, ModuleNotFoundError, OSError) as error:
        pytest.skip(f"default target not installed: {error}")
    target.cuda().eval()
    drafter.eval().attach(target)
    try:
        from benchmarks.tasks import task_prompts

        prompts = task_prompts("humaneval", 3) + task_prompts("mtbench", 3)
    except FileNotFoundError:
        prompts = ["Write a Python function that reverses a list.", "Explain what a hash map is.",
                   "List three prime numbers and say why they are prime."]
    greedy = dict(max_new_tokens=96, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    encoded = [torch.tensor([chat_prompt_ids(tokenizer, p)], device="cuda") for p in prompts]
    # explicit masks: the template's end-of-turn token is the pad token, which transformers 5.17 masks out of an
    # unmasked prompt (the static loop refuses such masks and attends to every prompt token)
    plain = [target.generate(ids, attention_mask=torch.ones_like(ids), **greedy) for ids in encoded]
    assisted = [target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, **greedy)
                for ids in encoded]
    static_eager = [target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                    cache_implementation="static", compile=False, **greedy) for ids in encoded]
    static_compiled, taus = [], []
    for ids in encoded:
        static_compiled.append(target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                               cache_implementation="static", compile=True, **greedy))
        taus.append(drafter.last_stats.acceptance_length)
    print(f"\n[gpu fp32] prompts {len(prompts)}, tau of the compiled loop {sum(taus) / len(taus):.2f}; identical to "
          f"plain greedy: assisted {sum(map(torch.equal, assisted, plain))}, static eager "
          f"{sum(map(torch.equal, static_eager, plain))}, static compiled {sum(map(torch.equal, static_compiled, plain))}"
          f"; compiled == eager static: {sum(map(torch.equal, static_compiled, static_eager))}")
    assert all(map(torch.equal, static_compiled, static_eager))
    assert all(map(torch.equal, static_eager, plain))
    assert all(map(torch.equal, assisted, plain))
