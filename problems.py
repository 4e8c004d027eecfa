"""Deprecated alias of `dflash2.word_problems` (renamed in 0.2.0; removed in 0.3.0)."""

from .deprecated import moved

__getattr__ = moved(__name__, "dflash2.word_problems")
