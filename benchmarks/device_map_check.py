"""Target sharded over the GPUs with `device_map`, drafter on one: greedy equality (fp32) and timings.

    python -m benchmarks.device_map_check [--drafter DIR] [--num-prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None):
    from transformers import AutoModelForCausalLM

    from benchmarks.tasks import task_prompts
    from dflash2_cli import DEFAULT_DRAFTER
    from generation.integration import chat_prompt_ids, load_target, resolve_target_location
    from modeling_dflash2 import DFlash2DraftModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--num-prompts", type=int, default=4, help="per task")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {gpus}")

    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32)
    _, tokenizer = load_target(drafter.config, dtype=torch.float32)
    location = resolve_target_location(drafter.config.target_name_or_path)
    # split the layers evenly: cap each GPU at a share of the fp32 weights
    probe = AutoModelForCausalLM.from_pretrained(location, gguf_file=drafter.config.target_gguf_file,
                                                 dtype=torch.float32)
    share = sum(p.numel() * 4 for p in probe.parameters()) // gpus
    del probe
    max_memory = {i: int(share * 1.15) for i in range(gpus)}
    target = AutoModelForCausalLM.from_pretrained(location, gguf_file=drafter.config.target_gguf_file,
                                                  dtype=torch.float32, device_map="auto", max_memory=max_memory).eval()
    placement = sorted({str(d) for d in target.hf_device_map.values()})
    drafter.to("cuda:0").eval().attach(target)
    prompts = task_prompts("humaneval", args.num_prompts) + task_prompts("mtbench", args.num_prompts)
    report = {"gpus": gpus, "target_devices": placement, "hf_device_map_sample": dict(list(
        target.hf_device_map.items())[:3] + list(target.hf_device_map.items())[-3:]), "prompts": len(prompts),
              "identical": 0, "plain_s": 0.0, "dflash2_s": 0.0, "tokens": 0, "plain_tokens": 0, "forwards": 0}
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device="cuda:0")
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        if index == 0:
            target.generate(ids, **{**kwargs, "max_new_tokens": 8})
            target.generate(ids, assistant_model=drafter, **{**kwargs, "max_new_tokens": 8})
        torch.cuda.synchronize()
        started = time.perf_counter()
        plain = target.generate(ids, **kwargs)
        torch.cuda.synchronize()
        report["plain_s"] += time.perf_counter() - started
        started = time.perf_counter()
        speculative = target.generate(ids, assistant_model=drafter, **kwargs)
        torch.cuda.synchronize()
        report["dflash2_s"] += time.perf_counter() - started
        report["identical"] += int(torch.equal(plain.cpu(), speculative.cpu()))
        report["tokens"] += speculative.shape[1] - ids.shape[1]
        report["plain_tokens"] += plain.shape[1] - ids.shape[1]
        report["forwards"] += drafter.last_stats.target_forwards
    report["tau"] = report["tokens"] / report["forwards"]
    report["plain_tok_s"] = report["plain_tokens"] / report["plain_s"]
    report["dflash2_tok_s"] = report["tokens"] / report["dflash2_s"]
    report["speedup"] = report["dflash2_tok_s"] / report["plain_tok_s"]
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
