"""DFlash 2 inside transformers' generation: candidate generator, the round core and its loop, hooks, export.

The files of this package ship in a drafter folder, where remote code must be flat: there they sit beside
configuration_dflash2.py and modeling_dflash2.py and import them as `from .modeling_dflash2 import ...`. Here those two
files live one level up, so this package registers them under its own name: the same import line works in both places.
"""

import sys

from .. import configuration_dflash2, modeling_dflash2

sys.modules.setdefault(f"{__name__}.configuration_dflash2", configuration_dflash2)
sys.modules.setdefault(f"{__name__}.modeling_dflash2", modeling_dflash2)

from .auto import DFlash2Drafter, DFlash2SpeculativeLM, load_target, resolve_target_location  # noqa: E402
from .candidate_generator import DFlash2CandidateGenerator  # noqa: E402
from .decode import own_loop_generate  # noqa: E402
from .export import export_drafter  # noqa: E402
from .hooks import attach, attached_drafter, detach  # noqa: E402
from .stats import DFlash2Stats  # noqa: E402

__all__ = ["DFlash2CandidateGenerator", "DFlash2Drafter", "DFlash2SpeculativeLM", "DFlash2Stats", "attach",
           "attached_drafter", "detach", "export_drafter", "load_target", "own_loop_generate", "resolve_target_location"]
