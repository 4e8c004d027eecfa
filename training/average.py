"""Average the weights of two drafters of one config: weight x SECOND + (1 - weight) x FIRST, tensor by tensor.

    python -m dflash2.training.average FIRST SECOND --weight 0.5 --out DIR

A drafter trained further from FIRST starts from FIRST's weights, and the two usually lie close enough that their
average is a working drafter too (a "model soup"): it can keep part of what the further training gained while giving
back part of what it lost (a run that gains on chat and loses on code, say). The average is a candidate like any
other: measure it (`python -m dflash2.benchmarks.acceptance --drafter FIRST --drafter DIR ...`). DIR is written
atomically (`export_drafter`) with SECOND's config and tokenizer, in `--dtype`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dflash2.model_args import share

# config fields two drafters may differ in and still average: bookkeeping of the files, not the model
IGNORED_CONFIG_FIELDS = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures", "auto_map"}


def average_drafters(first, second, weight: float):
    """The drafter SECOND (a folder or Hub id) with every weight replaced by weight x SECOND + (1 - weight) x FIRST,
    in fp32. One clear error when the two configs or weight sets differ."""
    from dflash2.generation import DFlash2Drafter

    a = DFlash2Drafter.from_pretrained(first, dtype=torch.float32)
    b = DFlash2Drafter.from_pretrained(second, dtype=torch.float32)
    config_a, config_b = a.config.to_dict(), b.config.to_dict()
    differing = sorted(k for k in set(config_a) | set(config_b)
                       if k not in IGNORED_CONFIG_FIELDS and config_a.get(k) != config_b.get(k))
    if differing:
        raise ValueError(f"{first} and {second} differ in {differing}: only drafters of one config average. Average "
                         "a drafter with one trained further from it (--init-from), not drafters of other shapes.")
    state_a, state_b = a.state_dict(), b.state_dict()
    if state_a.keys() != state_b.keys():
        raise ValueError(f"{first} and {second} hold different weights "
                         f"({sorted(set(state_a) ^ set(state_b))[:4]} ...): only drafters of one config average.")
    with torch.no_grad():
        for name, tensor in state_b.items():  # the state dict's tensors are b's own parameters and buffers
            if tensor.is_floating_point():
                tensor.mul_(weight).add_(state_a[name], alpha=1.0 - weight)
            elif not torch.equal(tensor, state_a[name]):
                raise ValueError(f"{name} differs between {first} and {second} and cannot be averaged.")
    return b


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dflash2.training.average", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", help="drafter folder (or Hub id): the starting point")
    parser.add_argument("second", help="drafter folder (or Hub id) of the same config, e.g. FIRST trained further")
    parser.add_argument("--weight", type=share, default=0.5, help="SECOND's share, 0 to 1 (default 0.5)")
    parser.add_argument("--out", required=True, help="folder to write the averaged drafter to")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the written weights (default bfloat16, as training exports them)")
    return parser.parse_args(argv)


def main(argv=None):
    from transformers import AutoTokenizer

    from dflash2.generation import export_drafter

    args = parse_args(argv)
    drafter = average_drafters(args.first, args.second, args.weight)
    second = Path(args.second)
    has_tokenizer = not second.is_dir() or (second / "tokenizer_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(args.second, trust_remote_code=False) if has_tokenizer else None
    export_drafter(drafter.to(getattr(torch, args.dtype)), args.out, tokenizer=tokenizer)
    print(args.out)


if __name__ == "__main__":
    main()
