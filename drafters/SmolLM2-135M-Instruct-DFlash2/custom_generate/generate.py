# Generated from generation/custom_generate/generate.py by `python -m dflash2.generation.flat_code`; do not edit.
"""`target.generate(ids, custom_generate=<drafter folder>, trust_remote_code=True)`: speculate with that drafter.

transformers imports this file from the drafter folder and calls `generate(model=target, **generate_arguments)`.
The drafter is loaded from the same folder once per (folder, device, dtype) and attached to the target.
"""

import inspect
import os

_DRAFTERS = {}


def _custom_generate_location():
    # transformers does not hand the folder to this function; its `generate` frame holds it as `custom_generate`
    for frame_info in inspect.stack()[1:]:
        location = frame_info.frame.f_locals.get("custom_generate")
        if isinstance(location, (str, os.PathLike)):
            return str(location)
    return None


def _load_drafter(location, model):
    from transformers import AutoModel

    key = (os.path.abspath(location) if os.path.isdir(location) else location, str(model.device), model.dtype)
    if key not in _DRAFTERS:
        drafter = AutoModel.from_pretrained(location, trust_remote_code=True, dtype=model.dtype)
        _DRAFTERS[key] = drafter.to(model.get_output_embeddings().weight.device)
    return _DRAFTERS[key]


def generate(model, *args, drafter=None, **kwargs):
    """Generate with `model` as the target and the DFlash 2 drafter of this folder (or `drafter=`, a folder or model)."""
    if drafter is None or isinstance(drafter, (str, os.PathLike)):
        location = drafter or _custom_generate_location()
        if location is None:
            raise ValueError("Cannot tell which drafter folder to use; pass `drafter=<folder>` to generate().")
        drafter = _load_drafter(str(location), model)
    kwargs.pop("assistant_model", None)
    drafter.attach(model)
    return model.generate(*args, assistant_model=drafter, **kwargs)
