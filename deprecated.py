"""Old module names kept for one release: 0.2.0 renamed them (CHANGELOG.md) and 0.3.0 removes these aliases.

An alias module warns when it is imported and looks every name up in the modules that now hold it:
`__getattr__ = moved(__name__, "dflash2.new_name")`.
"""

import importlib
import warnings


def moved(old: str, *new: str):
    """A module `__getattr__` for the alias `old`: a DeprecationWarning now, then each name from the first of `new`
    that has it."""
    warnings.warn(f"{old} is deprecated: it is now {' and '.join(new)} (dflash2 0.2.0); the old name goes in 0.3.0.",
                  DeprecationWarning, stacklevel=3)
    modules = [importlib.import_module(name) for name in new]

    def __getattr__(name):
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} (now {', '.join(new)}) has no attribute {name!r}")

    return __getattr__
