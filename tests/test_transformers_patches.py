"""Patches of transformers live in generation/transformers_patches.py alone, each listed there; detach undoes them."""

import ast
from pathlib import Path

import torch

from dflash2.generation import transformers_patches
from dflash2.modeling_dflash2 import CACHE_NAME
from helpers import VOCAB, tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]
PATCHED_NAMES = {"generate", "_get_candidate_generator", "prepare_inputs_for_generation", "update_candidate_strategy"}


def assigned_attributes(path: Path) -> set[str]:
    """Attribute names assigned on any object (`x.name = ...`, `setattr(x, "name", ...)`) in a file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) > 1:
            if isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return names


def test_no_other_module_assigns_a_method_of_transformers():
    runtime = sorted((ROOT / "generation").glob("*.py")) + [ROOT / "modeling_dflash2.py"]
    assert assigned_attributes(ROOT / "generation" / "transformers_patches.py") >= PATCHED_NAMES  # the scan sees them
    found = {path.name: assigned_attributes(path) & PATCHED_NAMES for path in runtime
             if path.name != "transformers_patches.py"}
    assert not {name: hits for name, hits in found.items() if hits}, found
    doc = transformers_patches.__doc__
    assert all(name in doc for name in PATCHED_NAMES) and "detach" in doc


def test_detach_undoes_every_patch():
    target = tiny_target("llama", seed=0)
    drafter = tiny_drafter(target, seed=1)
    own_generate = target.generate  # an instance attribute the target had before attach is restored
    target.generate = own_generate
    before = dict(target.__dict__)
    drafter.attach(target)
    assert target.__dict__["generate"] is not own_generate and "_get_candidate_generator" in target.__dict__
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    assisted = dict(do_sample=False, assistant_model=drafter, repetition_penalty=1.05)  # transformers' loop
    first = target.generate(ids, max_new_tokens=4, return_dict_in_generate=True, **assisted)
    later = torch.cat([first.sequences, ids[:, :3]], dim=1)  # a later turn: patch 3 runs for one call
    target.generate(later, max_new_tokens=3, **{CACHE_NAME: getattr(first, CACHE_NAME)}, **assisted)
    assert "prepare_inputs_for_generation" not in target.__dict__
    drafter.detach(target)
    assert target.__dict__.keys() == before.keys() and target.generate is own_generate
    assert "_get_candidate_generator" not in target.__dict__
