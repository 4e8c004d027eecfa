"""The serving engine on a GPU (no HTTP, so no FastAPI needed): rows admitted one at a time into captured rounds, moved
between batch sizes, each request equal to plain greedy (fp32) and a seeded sampled request the same alone and among
others."""

import threading
from pathlib import Path

import pytest
import torch

from dflash2.generation.sampling import Sampling
from dflash2.serving.engine import Engine, GenerationRequest

SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def answer(engine: Engine, prompt_ids, max_tokens, sampling=Sampling(), seed=None) -> tuple[GenerationRequest,
                                                                                          threading.Event]:
    finished = threading.Event()

    def emit(event):
        if event[0] != "text":
            finished.set()

    request = GenerationRequest(prompt_ids, max_tokens, sampling, seed, emit=emit)
    engine.submit(request)
    return request, finished


@pytest.mark.gpu
def test_engine_on_the_gpu_answers_concurrent_requests_as_plain_greedy_in_captured_rounds():
    from dflash2.generation import DFlash2Drafter, load_target
    from dflash2.tasks import chat_prompt_ids, task_prompts

    torch.backends.cuda.matmul.allow_tf32 = False
    drafter = DFlash2Drafter.from_pretrained(SHIPPED, dtype=torch.float32).cuda()
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    target.cuda().eval()
    drafter.eval().attach(target)
    prompts = task_prompts("humaneval", 4, skip=100) + task_prompts("mtbench", 4, skip=40)
    encoded = [chat_prompt_ids(tokenizer, prompt) for prompt in prompts]
    limits = [48 + 16 * (index % 4) for index in range(len(prompts))]
    plain = []
    for ids, limit in zip(encoded, limits):
        tensor = torch.tensor([ids], device="cuda")
        out = target.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=limit, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
        plain.append(out[0, len(ids):].tolist())
    engine = Engine(target, tokenizer, drafter, rows=4, max_model_len=1024, compile=False)
    assert engine.runner.kind.startswith("graph")
    engine.start()
    try:
        jobs = [answer(engine, ids, limit) for ids, limit in zip(encoded, limits)]
        for request, finished in jobs:
            assert finished.wait(300)
        for (request, _), expected in zip(jobs, plain):
            eos = set(engine.eos)
            cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
            assert request.tokens == expected[:cut]
        assert engine.metrics["row_moves"] > 0
        assert engine.metrics["completion_tokens"] / engine.metrics["target_forwards"] > 1.5
        sampled = Sampling(True, 0.8, 0, 0.95)
        alone, finished = answer(engine, encoded[0], 64, sampled, seed=7)
        assert finished.wait(300)
        jobs = [answer(engine, ids, 64) for ids in encoded[1:4]] + [answer(engine, encoded[0], 64, sampled, seed=7)]
        for request, finished in jobs:
            assert finished.wait(300)
        assert jobs[-1][0].tokens == alone.tokens
    finally:
        engine.shutdown()
