"""Modules renamed in 0.2.0 keep their old names for one release: importing one warns, and its names are the new
module's objects."""

import importlib
import sys

import pytest

RENAMED = [  # (old module, new module, a name it holds)
    ("dflash2.pairs", "dflash2.model_args", "load_pair"),
    ("dflash2.problems", "dflash2.word_problems", "word_problems"),
    ("dflash2.generation.auto", "dflash2.generation.drafter", "DFlash2Drafter"),
    ("dflash2.generation.hooks", "dflash2.generation.dispatch", "attach"),
    ("dflash2.generation.decode", "dflash2.generation.loop", "own_loop_generate"),
    ("dflash2.generation.fusion", "dflash2.generation.fused_package", "RoundProgram"),
    ("dflash2.generation.background", "dflash2.generation.background_build", "BackgroundFusion"),
]


@pytest.mark.parametrize("old, new, name", RENAMED, ids=[old for old, *_ in RENAMED])
def test_an_old_module_name_warns_and_forwards(old, new, name):
    sys.modules.pop(old, None)  # imported afresh: the warning comes at import
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        alias = importlib.import_module(old)
    assert getattr(alias, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute"):
        getattr(alias, "no_such_name")
