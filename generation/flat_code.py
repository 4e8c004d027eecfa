"""Refresh (or check) the flat code files of drafter folders: `python -m dflash2.generation.flat_code [FOLDER...]`.

A drafter folder carries remote code derived from the package's sources (export.py, `flat_code_files`). With no
folder, the shipped drafter's; `--check` writes nothing and exits 1 when a folder's copies differ from the sources.
"""

import argparse
import sys
from pathlib import Path

from .export import FLAT_CODE_COMMAND, PACKAGE_ROOT, flat_code_files, write_code_files

SHIPPED_DRAFTER = PACKAGE_ROOT / "drafters" / "SmolLM2-135M-Instruct-DFlash2"


def drifted_files(folder) -> list[str]:
    """The code files of `folder` that are missing or differ from what `write_code_files` writes."""
    folder = Path(folder)
    return [name for name, text in flat_code_files().items()
            if not (folder / name).is_file() or (folder / name).read_text() != text]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash2.generation.flat_code", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", default=[SHIPPED_DRAFTER],
                        help="drafter folders (default: the shipped one)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a folder's copies drifted")
    args = parser.parse_args(argv)
    drifted = {str(folder): drifted_files(folder) for folder in args.folders}
    if args.check:
        for folder, names in drifted.items():
            if names:
                print(f"{folder}: {', '.join(names)} differ from the sources; run {FLAT_CODE_COMMAND}")
        return 1 if any(drifted.values()) else 0
    for folder in args.folders:
        write_code_files(folder)
        print(f"{folder}: {len(drifted[str(folder)])} code files refreshed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
