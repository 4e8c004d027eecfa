"""Writing a drafter folder: weights, config with `auto_map`, the flat remote-code files and `custom_generate/`.

Remote code must be a flat set of sibling files. In this package the model files sit at the top level and the
generation files in `generation/`, which import them as `from ..modeling_dflash2 import ...`. A folder's copies are
derived: `flat_code_files` rewrites those imports for the flat folder and puts a header in their first line saying
where each comes from (a folder's own flat files, when the code runs from one, are copied as they are).
`python -m dflash2.generation.flat_code` refreshes the shipped drafter's copies; tests/test_shipped_drafter.py fails
when they drift.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

# The modules a drafter folder ships, in import order (each imports only earlier ones).
SHIPPED_MODULES = ("configuration_dflash2", "modeling_dflash2", "stats", "sampling", "candidate_generator",
                   "transformers_patches", "tree", "round_core", "graphs", "fused_package", "background_build",
                   "assets", "loop", "dispatch", "export", "drafter")
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
AUTO_MAP = {
    "AutoConfig": "configuration_dflash2.DFlash2Config",
    "AutoModel": "drafter.DFlash2Drafter",
    "AutoModelForCausalLM": "drafter.DFlash2SpeculativeLM",
}
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
MODEL_MODULES = ("configuration_dflash2", "modeling_dflash2")  # one level up in the package, siblings in a folder
IN_PACKAGE = __package__ == "dflash2.generation"  # else this code runs from a drafter folder, its files flat already
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
FLAT_CODE_COMMAND = "python -m dflash2.generation.flat_code"
GENERATED_HEADER = "# Generated from {source} by `{command}`; do not edit.\n"


def shipped_source_files() -> dict[str, Path]:
    """Exported file name -> the file it is copied from (the sources here, or the siblings of a loaded folder)."""
    level = {name: ".." if IN_PACKAGE and name in MODEL_MODULES else "." for name in SHIPPED_MODULES}
    files = {f"{name}.py": Path(importlib.import_module(f"{level[name]}{name}", __package__).__file__)
             for name in SHIPPED_MODULES}
    custom = Path(__file__).resolve().parent / CUSTOM_GENERATE_FILE
    if custom.is_file():
        files[CUSTOM_GENERATE_FILE] = custom
    return files


def flat_code(source: Path) -> str:
    """A source file as a drafter folder carries it: `from ..x import` (the package's model files) becomes
    `from .x import` (its flat siblings), under a header naming the source and the command that wrote it."""
    text = source.read_text()
    if not IN_PACKAGE:
        return text
    text = re.sub(r"^(\s*from )\.\.(?=\w)", r"\1.", text, flags=re.MULTILINE)
    relative = source.resolve().relative_to(PACKAGE_ROOT).as_posix()  # resolved both: dflash2 may sit behind a link
    return GENERATED_HEADER.format(source=relative, command=FLAT_CODE_COMMAND) + text


def flat_code_files() -> dict[str, str]:
    """Exported file name -> the text a drafter folder carries (`flat_code` of each shipped source)."""
    return {exported: flat_code(source) for exported, source in shipped_source_files().items()}


def write_code_files(folder) -> None:
    """Write the flat code files (`flat_code_files`) into a drafter folder, replacing older copies or links."""
    for exported, text in flat_code_files().items():
        target = Path(folder) / exported
        target.parent.mkdir(exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_text(text)


@contextlib.contextmanager
def atomic_folder(destination):
    """Yield an empty staging folder; on success it replaces `destination`, on failure it goes.

    The new folder goes in by a rename once complete (when an old one is there, a first rename moves it aside, so
    for an instant neither is there): readers see the old folder or the new one, never a half-written one. Entries
    of the old folder that the new one does not write (a model card, notes, files of the user's) are carried over;
    old weight shards are not, since the new set replaces them.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        yield staging
        if destination.is_dir():
            for entry in destination.iterdir():
                if not (staging / entry.name).exists() and not entry.name.endswith(WEIGHT_SUFFIXES):
                    copy = shutil.copytree if entry.is_dir() and not entry.is_symlink() else shutil.copy2
                    copy(entry, staging / entry.name)
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


def export_drafter(drafter, save_directory, *args, tokenizer=None, push_to_hub: bool = False, **kwargs):
    """Write a self-contained drafter folder atomically; `kwargs` go to `PreTrainedModel.save_pretrained`
    (max_shard_size defaults to 16MB). With `push_to_hub=True` the finished folder is uploaded (repo_id, token,
    private, commit_message as in transformers)."""
    from transformers import PreTrainedModel

    hub = {k: kwargs.pop(k) for k in ("repo_id", "token", "private", "commit_message") if k in kwargs}
    kwargs.setdefault("max_shard_size", "16MB")
    save_directory = Path(save_directory)
    with atomic_folder(save_directory) as staging:
        PreTrainedModel.save_pretrained(drafter, staging, *args, **kwargs)
        config_path = staging / "config.json"
        config = json.loads(config_path.read_text())
        config["auto_map"] = dict(AUTO_MAP)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if CUSTOM_GENERATE_FILE not in shipped_source_files():
            warnings.warn("This copy of the DFlash 2 code has no custom_generate/generate.py (a folder loaded through "
                          "trust_remote_code does not carry it); the export leaves it out.", stacklevel=3)
        write_code_files(staging)
        if tokenizer is not None:
            if not getattr(tokenizer, "chat_template", None):
                warnings.warn("The tokenizer saved with the drafter has no chat template: the pipeline one-liner will "
                              "refuse chat messages. Pass the target's chat tokenizer.", stacklevel=3)
            tokenizer.save_pretrained(staging)
    if push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi(token=hub.get("token"))
        repo_id = hub.get("repo_id") or save_directory.name
        api.create_repo(repo_id, private=hub.get("private"), exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=save_directory,
                          commit_message=hub.get("commit_message") or "Upload DFlash 2 drafter")
    return save_directory


def _make_readable(folder: Path) -> None:
    """mkdtemp and some writers create owner-only entries; a shipped folder is world-readable like a checkout."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
