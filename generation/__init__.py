"""DFlash 2 inside transformers' generation: candidate generator, the round core and its loop, dispatch, export.

The files of this package also ship in a drafter folder, as flat remote code beside configuration_dflash2.py and
modeling_dflash2.py: `python -m dflash2.generation.export` writes those flat copies (export.py, `write_code_files`).
"""

from .drafter import DFlash2Drafter, DFlash2SpeculativeLM, load_target, resolve_target_location
from .candidate_generator import DFlash2CandidateGenerator
from .loop import own_loop_generate
from .export import export_drafter
from .dispatch import attach, attached_drafter, detach
from .stats import DFlash2Stats

__all__ = ["DFlash2CandidateGenerator", "DFlash2Drafter", "DFlash2SpeculativeLM", "DFlash2Stats", "attach",
           "attached_drafter", "detach", "export_drafter", "load_target", "own_loop_generate", "resolve_target_location"]
