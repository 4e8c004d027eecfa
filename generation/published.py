"""Export a drafter in the published checkpoints' format, the one vLLM and SGLang serve.

The format: `config.json` with `model_type` "qwen3", `architectures` ["DFlash2DraftModel"] (DFlash 2) or
["DFlashDraftModel"] (DFlash 1), the Qwen3 fields at the top level and the DFlash fields in a `dflash_config`
sub-dict; safetensors weights under the published tensor names (ours are the same names); no remote code, no
`auto_map`. `DFlash2Config.from_pretrained` / `DFlash2Drafter.from_pretrained` read such a folder back unchanged.

    python -m dflash2.generation.published <drafter folder or hub id> <out folder> [--dtype bfloat16]

This module is not shipped in drafter folders (it is not in export.SHIPPED_MODULES).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from dflash2.configuration_dflash2 import DFLASH1_ARCHITECTURE, DFLASH2_ARCHITECTURE
from dflash2.generation.export import atomic_folder

PUBLISHED_MODEL_TYPE = "qwen3"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def published_config_dict(config, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Our DFlash2Config as a published-format config dict (the inverse of `convert_published_config`)."""
    if config.mask_token_id is None:
        raise ValueError("The drafter's config has no mask_token_id; serving engines need it. Set config.mask_token_id "
                         "to the token the drafter was trained with as MASK.")
    version = config.dflash_version
    sliding = "sliding_attention" in config.layer_types
    dflash = {"block_size": config.block_size, "mask_token_id": config.mask_token_id,
              "target_layer_ids": list(config.target_layer_ids)}
    if version == 2:
        dflash.update(conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
                      selector_rank=config.selector_rank, selector_top_k=config.selector_top_k)
    dflash["output_multiplier"] = config.output_multiplier
    if config.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = config.final_logit_softcapping
    if config.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = config.input_embedding_scale
    out = {
        "architectures": [DFLASH2_ARCHITECTURE if version == 2 else DFLASH1_ARCHITECTURE],
        "model_type": PUBLISHED_MODEL_TYPE,
        "dflash_config": dflash,
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "max_position_embeddings": config.max_position_embeddings,
        # only read by consumers that ignore layer_types: layers from this index on slide (Qwen3Config's rule)
        "max_window_layers": _first_sliding_layer(config.layer_types),
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": dict(config.rope_parameters),
        "sliding_window": config.sliding_window,
        # Qwen3Config keeps sliding_window only when this is set; the engines read the window through it
        "use_sliding_window": sliding,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "use_cache": False,
        "vocab_size": config.vocab_size,
    }
    if config.is_causal is not None:  # absent: sliding layers causal, full-attention layers not
        out["is_causal"] = config.is_causal
    if config.num_target_layers is not None:
        out["num_target_layers"] = config.num_target_layers
    for extra in ("target_name_or_path", "target_gguf_file", "max_speculative_batch_size"):
        if getattr(config, extra, None) is not None:
            out[extra] = getattr(config, extra)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    import transformers

    out["transformers_version"] = transformers.__version__
    return out


def _first_sliding_layer(layer_types) -> int:
    """The Qwen3 `max_window_layers` that reproduces `layer_types` (full layers, then sliding ones); the layer count
    when no layer slides or the pattern is not of that form (explicit layer_types then decide)."""
    first = next((i for i, kind in enumerate(layer_types) if kind == "sliding_attention"), len(layer_types))
    reproducible = all(kind == "sliding_attention" for kind in layer_types[first:])
    return first if reproducible else len(layer_types)


def serving_warnings(config) -> list[str]:
    """What the served drafter would do differently from ours, as far as the engines' code shows (docs/serving.md)."""
    notes = []
    if config.dflash_version == 1 and (config.output_multiplier != 1.0 or config.final_logit_softcapping is not None
                                       or config.input_embedding_scale != 1.0):
        notes.append("a DFlash 1 drafter with output_multiplier / final_logit_softcapping / input_embedding_scale: "
                     "vLLM's DFlash 1 path applies none of them, so its drafts would differ from ours.")
    if config.target_hidden_size != config.hidden_size:
        notes.append(f"target_hidden_size={config.target_hidden_size} differs from hidden_size={config.hidden_size}: "
                     "SGLang's DFlash drafter sizes its feature projection from hidden_size and will refuse fc.weight.")
    if config.hidden_act != "silu":
        notes.append(f"hidden_act={config.hidden_act!r}: SGLang's DFlash MLP supports silu only.")
    if len(set(config.layer_types)) > 1:
        notes.append("mixed sliding / full-attention layers: vLLM needs its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).")
    return notes


def export_published(drafter, save_directory, dtype: torch.dtype | None = None,
                     max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write `drafter` (a DFlash2DraftModel / DFlash2Drafter) as a published-format folder, atomically.

    dtype: the weights' dtype in the files (default: the drafter's; the published checkpoints are bfloat16).
    Returns the folder. Warns about what vLLM / SGLang would serve differently (`serving_warnings`).
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    dtype = dtype or drafter.dtype
    config = published_config_dict(drafter.config, dtype)
    for note in serving_warnings(drafter.config):
        warnings.warn(f"Published export: {note}", stacklevel=2)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in drafter.state_dict().items()}
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    save_directory = Path(save_directory)
    with atomic_folder(save_directory) as staging:
        for filename, names in split.filename_to_tensors.items():
            save_file({name: state[name] for name in names}, staging / filename, metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return save_directory


def serving_commands(folder, target: str | None = None, block_size: int | None = None) -> dict[str, str]:
    """Launch commands for the exported folder: vLLM (`--speculative-config`) and SGLang (`DFLASH`)."""
    folder = Path(folder)
    if block_size is None:
        config = json.loads((folder / "config.json").read_text())
        block_size = config["dflash_config"]["block_size"]
        named = config.get("target_name_or_path")
        if target is None and named and not named.startswith("pypi:") and not config.get("target_gguf_file"):
            target = named  # a Hub id or folder an engine can load (not a GGUF file inside a Python package)
    target = target or "<target model>"
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": block_size - 1})
    return {
        "vllm": f"vllm serve {target} --speculative-config '{spec}'",
        "sglang": (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {folder}"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash2.generation.published",
                                     description="Export a dflash2 drafter in the published format (vLLM / SGLang).")
    parser.add_argument("drafter", help="drafter folder or Hub id (ours, or already published)")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the written weights (default: bfloat16, like the published checkpoints)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    args = parser.parse_args(argv)
    from dflash2.modeling_dflash2 import DFlash2DraftModel

    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32)
    out = export_published(drafter, args.out, dtype=getattr(torch, args.dtype), max_shard_size=args.max_shard_size)
    print(f"wrote {out}")
    for engine, command in serving_commands(out).items():
        print(f"{engine}: {command}")


if __name__ == "__main__":
    main()
