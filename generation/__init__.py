"""DFlash 2 inside transformers' generation: candidate generator, entry points, export."""

from .candidate_generator import DFlash2CandidateGenerator, DFlash2Stats
from .integration import DFlash2SpeculativeLM, attach, detach, export_drafter, load_target

__all__ = ["DFlash2CandidateGenerator", "DFlash2Stats", "DFlash2SpeculativeLM", "attach", "detach", "export_drafter",
           "load_target"]
