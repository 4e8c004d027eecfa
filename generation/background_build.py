"""The fused rounds' build in the background (`compile="background"`): the child process that builds the package
(`fused_package.py`: what is compiled and how it is checked; one package holds the greedy and the sampled round, which
serve every sampling setting), and the caller's side, which switches to the package once it is there or stays unfused.

Faults never fail a call: whatever goes wrong (no writable cache, a killed or out-of-memory child, a full disk, a
package that will not load) leaves the unfused round running and says so in one warning. A later process tries again,
except after a build that failed deterministically (an error in the build itself), which is remembered for the same
key (shapes, code and versions) in a `<key>.failed` note. One child at a time builds a key across processes (a lock
file); the others wait for it and use its package. A child is started only when the device has room for a second set
of weights (`has_room_for_build`). `compile=False` skips all of this; `dflash2 precompile` builds ahead of time and
`dflash2 cache` lists or clears what was built.

Parts: the child (`FusionJob` starts it, `child_main` is its entry, `build_lock` keeps it alone on its key); the room
check (`has_room_for_build`); the caller's side (`BackgroundFusion`: start, poll, switch or fall back).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from .fused_package import (build_package, cache_dir, copy_atomically, open_fused_rounds, package_key, preserved,
                     round_weights, shipped_package, spec_of)
from .round_core import RoundCore, round_state


# ------------------------------------------------------------------------------------------------ the child
# A build that fails deterministically (an error in the build itself: the same code and versions fail the same way)
# ends with this status and is remembered; any other end (killed, out of memory, a full disk, an import that failed)
# is transient and retried by a later process.
DETERMINISTIC_FAILURE = 3
TRANSIENT_ERRORS = (OSError, MemoryError, torch.cuda.OutOfMemoryError)


class FusionJob:
    """The child process building one package, its log `<key>.<pid>.log` beside the package (one per caller, so two
    callers never write one log); `ready()` polls it without waiting."""

    def __init__(self, spec: dict, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # the child's spec file and scratch folder are ours to remove: a child that crashes cannot clean up
        self.scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=path.parent))
        try:
            spec_file = self.scratch / "spec.pickle"
            spec_file.write_bytes(pickle.dumps(spec))
            self.log = path.with_name(f"{path.stem}.{os.getpid()}.log")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", f"import importlib, sys; importlib.import_module({__name__!r})"
                     ".child_main(sys.argv[1], sys.argv[2])", str(spec_file), str(path)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def ready(self) -> bool:
        if self.process.poll() is None:
            return False
        shutil.rmtree(self.scratch, ignore_errors=True)
        return True

    def wait(self, timeout: float | None = None) -> None:
        self.process.wait(timeout)
        self.ready()

    def failure(self) -> str | None:
        """None while running or after a published package; else the exit status and the log's last lines."""
        if not self.ready() or (self.process.returncode == 0 and self.path.exists()):
            return None
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:] if self.log.exists() else []
        return f"exit {self.process.returncode}: " + " | ".join(tail)

    def deterministic(self) -> bool:
        return self.ready() and self.process.returncode == DETERMINISTIC_FAILURE


@contextlib.contextmanager
def build_lock(path: Path):
    """Held while one process builds `path`: an exclusive lock on `<key>.lock` (released by the system when its
    holder dies, so a killed child never blocks the next build). Another child of the same key waits here."""
    import fcntl

    with open(path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def child_main(spec_file: str, path: str) -> None:
    """The child's entry: the spec from `spec_file`; its folder is the scratch space. The caller removes it when it
    sees the child end; the child removes it too, since it finishes its build even when the caller has exited first
    (the next process then finds the round). Exits with `DETERMINISTIC_FAILURE` when the build itself fails."""
    scratch, path = Path(spec_file).parent, Path(path)
    try:
        with open(spec_file, "rb") as f:
            spec = pickle.load(f)
        with build_lock(path):
            if path.exists():
                print(f"another process built {path.name} meanwhile; nothing to do", flush=True)
                return
            print(f"building {path.name}", flush=True)
            build_package(spec, path, scratch)
            print(f"built {path.name}", flush=True)
    except TRANSIENT_ERRORS:
        traceback.print_exc()
        sys.exit(1)
    except Exception:  # noqa: BLE001 - the build's own error: the same versions would fail again
        traceback.print_exc()
        sys.exit(DETERMINISTIC_FAILURE)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ in the caller
BUILD_HEADROOM = 1 << 30  # bytes a child needs beyond a copy of the weights and state (code, compile workspaces)


def has_room_for_build(core: RoundCore) -> str | None:
    """None when the device has room for the child's copy of the weights and of the core's own tensors beside
    everything already there; else why not. (The child builds the round on tensors of its own, whose values do not
    matter; its caches, allocated later, are left to `BUILD_HEADROOM`.)"""
    tensors = [*round_weights(core.target, core.drafter).values(), *round_state(core).values()]
    needed = BUILD_HEADROOM + sum(t.numel() * t.element_size() for t in tensors)
    free = free_memory(core.device)
    if free is None or free >= needed:
        return None
    return f"{needed / 2 ** 30:.1f} GiB needed beside the model, {free / 2 ** 30:.1f} GiB free on {core.device}"


def free_memory(device: torch.device) -> int | None:
    """Free bytes on `device` (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # what the kernel can hand out without swapping, page cache included (Linux)
        with open("/proc/meminfo") as f:
            available = next(line for line in f if line.startswith("MemAvailable:"))
        return int(available.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


class BackgroundFusion:
    """One runner's fused rounds (one package: greedy and sampled): on disk already, or a child process building it.
    `poll` (after a prefill, so the caches exist and the check runs on a real prompt) switches the runner over once
    the package is there, or leaves it unfused with one warning.

    `state`: "building" (a child is at work), "ready" (the package is there), "used" (the runner runs it), or
    "unfused" (it will not be used: `reason` says why). `process` is the child (None when none was started) and `log`
    its log; `wait()` waits for it. `build=False`: use a package on disk (built earlier, by another process or
    shipped), start no child (a CPU's default: a child's compile would take the cores the caller decodes on); "absent"
    while there is none."""

    def __init__(self, runner, build: bool = True):
        self.core, self.process, self.log, self.job, self.reason = runner.core, None, None, None, None
        self.warned = False
        try:
            self.path = cache_dir() / f"{package_key(spec_of(self.core))}.round"
            self.note = self.path.with_suffix(".failed")
            shipped = None if self.path.exists() else shipped_package(self.core)
            if shipped is not None:  # built elsewhere for this GPU and toolchain: checked here like a local one
                self.path.parent.mkdir(parents=True, exist_ok=True)
                copy_atomically(shipped, self.path)
            if self.path.exists():
                self.state = "ready"
            elif self.note.exists():
                first_line = self.note.read_text(errors="replace").strip().splitlines()[:1] or ["no reason kept"]
                self.fall_back(f"an earlier build of this round failed with the same code and versions "
                               f"({first_line[0]}); `dflash2 cache clear` (or deleting {self.note}) lets the next "
                               "process try again")
            elif build:
                self.start()
            else:
                self.state = "absent"  # quietly: nothing was asked to be built; a package may appear later
        except Exception as error:  # noqa: BLE001 - no build is worth failing a call
            self.fall_back(f"the build could not start ({type(error).__name__}: {error})")

    def start(self) -> None:
        no_room = has_room_for_build(self.core)
        if no_room is not None:
            return self.fall_back(f"no room for the build beside the model ({no_room}); `dflash2 precompile` builds it "
                                  "ahead of time")
        self.job = FusionJob(spec_of(self.core), self.path)
        self.process, self.log, self.state = self.job.process, self.job.log, "building"

    def fall_back(self, reason: str) -> None:
        self.state, self.reason = "unfused", reason

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the child. True when the runner's next call switches to a package: one being built (waited for)
        or one finished or found since its last call."""
        if self.state == "building" and not self.job.ready():
            self.job.wait(timeout)
        return self.state in ("building", "ready")

    def pending(self) -> bool:
        """A package is on disk (built, found or shipped) that the runner has not switched to: its next `poll` will."""
        return self.job.ready() if self.state == "building" else (
            self.state == "ready" or (self.state == "absent" and self.path.exists()))

    def poll(self, runner) -> None:
        try:
            self.advance(runner)
        except Exception as error:  # noqa: BLE001 - whatever happens here, the unfused round still serves
            self.fall_back(f"{type(error).__name__}: {error}")
        if self.reason is not None and not self.warned:
            self.warned = True
            warnings.warn(f"DFlash 2: decoding with the unfused round: {self.reason}. compile=False skips fusion.",
                          stacklevel=4)

    def advance(self, runner) -> None:
        if self.state == "absent" and self.path.exists():
            self.state = "ready"
        if self.state == "building":
            if not self.job.ready():
                return
            failure = self.job.failure()
            if failure is not None:
                if self.job.deterministic():
                    write_atomically(self.note, f"{failure}\nlog: {self.log}\n")
                    return self.fall_back(f"building the fused round failed ({failure}; log: {self.log}); later "
                                          "processes will not try again until `dflash2 cache clear`")
                return self.fall_back(f"building the fused round failed ({failure}; log: {self.log}); the next "
                                      "process tries again")
            self.state = "ready"
        if self.state != "ready":
            return
        fused, why = open_fused_rounds(runner.core, self.path)
        if fused is not None:
            self.state = "used"
            with preserved(runner.core):  # a capture's warm-up runs advance the state
                runner.use_fused(fused)
        elif self.job is None:  # found on disk and unusable (damaged, say): built again, for this process and the next
            self.path.unlink(missing_ok=True)
            self.start()
            if self.state == "building":
                self.reason = f"{why}; building it again in the background"
        else:
            self.fall_back(why)


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path`, which appears whole or not at all (an unwritable folder only loses the note)."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass
