"""Target sharded over the GPUs with `device_map`, drafter on one: greedy equality (fp32) and timings.

    python -m dflash2.lab.device_map_check [--drafter DIR] [--num-prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def split_layers(config, devices: list) -> dict:
    """Decoder layers in equal consecutive shares over `devices`; embeddings on the first, norm on the last, the LM
    head beside the embeddings when they are tied (accelerate keeps tied weights together)."""
    layers, count = config.num_hidden_layers, len(devices)
    device_map = {f"model.layers.{i}": devices[i * count // layers] for i in range(layers)}
    device_map.update({"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                       "lm_head": devices[0] if getattr(config, "tie_word_embeddings", False) else devices[-1]})
    return device_map


def main(argv=None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash2.benchmarks.bench import synchronize
    from dflash2.tasks import task_prompts
    from dflash2.pairs import DEFAULT_DRAFTER
    from dflash2.generation import resolve_target_location
    from dflash2.tasks import chat_prompt_ids
    from dflash2.modeling_dflash2 import DFlash2DraftModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--num-prompts", type=int, default=4, help="per task")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--devices", nargs="+", default=None,
                        help="where the layers go (default: every GPU); e.g. `cpu cpu` for a dry run")
    args = parser.parse_args(argv)
    devices = args.devices or list(range(torch.cuda.device_count()))
    if len(devices) < 2:
        raise SystemExit(f"needs at least 2 devices, found {devices}")
    first = torch.device(devices[0] if isinstance(devices[0], str) else f"cuda:{devices[0]}")

    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32)
    location = resolve_target_location(drafter.config.target_name_or_path)
    gguf = {"gguf_file": drafter.config.target_gguf_file} if drafter.config.target_gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(location, **gguf)
    config = AutoConfig.from_pretrained(location, **gguf)
    target = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, device_map=split_layers(config, devices),
                                                  **gguf).eval()
    placed = getattr(target, "hf_device_map", None) or {"": str(first)}  # one device: transformers keeps no map
    placement = sorted({str(d) for d in placed.values()})
    drafter.to(first).eval().attach(target)
    prompts = task_prompts("humaneval", args.num_prompts) + task_prompts("mtbench", args.num_prompts)
    report = {"devices": [str(d) for d in devices], "target_devices": placement, "hf_device_map_sample": dict(list(
        placed.items())[:3] + list(placed.items())[-3:]), "prompts": len(prompts),
              "identical": 0, "plain_s": 0.0, "dflash2_s": 0.0, "tokens": 0, "plain_tokens": 0, "forwards": 0}
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=first)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                      pad_token_id=tokenizer.eos_token_id)
        if index == 0:
            target.generate(ids, **{**kwargs, "max_new_tokens": 8})
            target.generate(ids, assistant_model=drafter, **{**kwargs, "max_new_tokens": 8})
        synchronize(first)
        started = time.perf_counter()
        plain = target.generate(ids, **kwargs)
        synchronize(first)
        report["plain_s"] += time.perf_counter() - started
        started = time.perf_counter()
        speculative = target.generate(ids, assistant_model=drafter, **kwargs)
        synchronize(first)
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
