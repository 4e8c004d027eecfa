"""The lab: H200 run scripts, profiling probes and one-off checks, run from a checkout (`python -m dflash2.lab.<name>`).

Not part of the installed package (the wheel does not ship this folder) and imported by nothing in it; these modules
use dflash2's public API and the benchmark module like any user script.
"""
