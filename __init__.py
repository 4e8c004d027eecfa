"""dflash2: the Hugging Face-native runtime for DFlash 2 block drafters.

    from dflash2 import DFlash2Drafter, attach, load_target

Layers, each importing only the ones before it: configuration_dflash2 -> modeling_dflash2 -> generation -> tasks ->
training, benchmarks -> serving -> cli. Names are loaded on first use, so `dflash2 --help` does not import torch.
"""

import importlib

_EXPORTS = {
    "DFlash2Config": "configuration_dflash2",
    "DFlash2DraftModel": "modeling_dflash2",
    "DFlash2Drafter": "generation",
    "DFlash2SpeculativeLM": "generation",
    "DFlash2Stats": "generation",
    "attach": "generation",
    "detach": "generation",
    "export_drafter": "generation",
    "export_published": "generation.published",
    "load_target": "generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash2' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
