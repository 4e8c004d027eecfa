"""Evaluation prompt sets and the benchmark behind `dflash2 bench`."""
