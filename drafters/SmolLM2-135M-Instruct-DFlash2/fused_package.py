# Generated from generation/fused_package.py by `python -m dflash2.generation.flat_code`; do not edit.
"""Fused rounds without waiting (`compile="background"`, the default on one CUDA device): the rounds compiled ahead of
time in a child process.

The first call of a shape decodes at once with the rounds it has (CUDA graphs of eager kernels, or eager rounds on a
CPU) and starts a child process that builds the same round core from the configs (weights of no value: only shapes,
dtypes and code matter), compiles both its rounds, greedy and sampled, with `torch.compile(...).aot_compile` (dynamo
and inductor, ahead of time) and saves them to disk in one package. The weights are inputs of those rounds like their
state, and so are the sampling settings and EOS ids (tensors of the core): the saved rounds hold no weights and serve
every setting. A later call that finds the package loads it (`torch.compiler.load_compiled_function`: no tracing, no
compile), passes the rounds the caller's own weights, buffers and state, checks each against its eager round from
the same state, and from then on runs them (captured as CUDA graphs on a GPU). A second process with the same shapes
finds it and runs fused rounds from its first call, whatever its requests' settings.

Why a child process: tracing (`torch.export`, `torch.compile`) patches `torch.nn.Module.__call__` process-wide while
it runs, so tracing in a thread of the caller's process would also trace whatever the caller runs meanwhile; and the
compile takes the interpreter for tens of seconds.

A package is relocatable: `aot_compile` bundles inductor's generated code and triton's compiled kernels (cubins)
with the traced program, and loading writes them into the loading machine's own inductor and triton caches (no
absolute path of the building machine is read back). So packages built once (`dflash2 precompile --artifacts`) can
ship in a drafter folder's or in dflash2's `fused-rounds/`, named by a portable key (GPU name and capability, torch,
triton, CUDA runtime, Python, transformers, the code, the configs and shapes; `shipped_package`): a machine whose
keys all match copies it into its cache and checks it like one it built; any other finds nothing and builds.

This file holds what is compiled and how it is checked: a round as a program over the caller's tensors
(`RoundProgram`), the package, its keys and its build (`spec_of`, `package_key`, `build_package`), shipped packages
(`shipped_package`, `export_package`), and the check of loaded rounds (`open_fused_rounds`, `agreement`: row by row,
a row parted by a near tie in half precision allowed, `round_comparison`). `background_build.py` runs the child and
decides, in the caller, when to switch or to stay unfused.

Why not AOTInductor: its C++ loader crashed the loading process on a CUDA image (torch 2.11), with and without
weights in the package; `aot_compile` keeps inductor's Python runtime, the one `compile=True` runs on.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import torch

from .export import flat_code
from .round_core import RoundCore, round_state
from .sampling import Sampling
from .tree import DraftTree

PACKAGE_FORMAT = 6  # bump when what a package holds changes
# A package is a zip of the compiled rounds, one entry each: do_sample -> entry name (and the core's method)
ROUND_ENTRIES = {False: "round", True: "sampled_round"}
THREADS_ENTRY = "threads"  # and torch's thread count at the build (a guard of the compiled rounds)


def round_weights(target, drafter) -> dict:
    """Name -> tensor of every parameter and buffer of target and drafter, each tensor once (tied weights under their
    first name), in module order: the weight inputs of a compiled round."""
    pair = torch.nn.ModuleDict({"target": target, "drafter": drafter})
    return {**dict(pair.named_parameters()), **dict(pair.named_buffers())}


def weights_signature(target, drafter) -> list:
    """(name, shape, dtype) of each weight input: caller and child must agree on it, in this order."""
    return [(name, list(t.shape), str(t.dtype)) for name, t in round_weights(target, drafter).items()]


def state_signature(core: RoundCore) -> list:
    """(name, shape, dtype) of each tensor of the core's declared state (`round_state`; the caches are sized by the
    prefill, from the capacity alone)."""
    return [(name, list(t.shape), str(t.dtype)) for name, t in round_state(core).items()]


def first_differences(ours: list, theirs: list) -> list:
    return [f"{a} vs {b}" for a, b in zip(ours, theirs) if a != b][:3] or [f"{len(ours)} vs {len(theirs)} inputs"]


class _Round(torch.nn.Module):
    """Target and drafter as submodules (so `functional_call` can swap their weights); `forward(*state)` binds the core
    to `state` and runs one round."""

    def __init__(self, program: "RoundProgram"):
        super().__init__()
        self.target, self.drafter = program.core.target, program.core.drafter
        self.bind, self.core = program.bind, program.core  # a method and a plain object: no submodules
        self.round_name = program.round_name

    def forward(self, *state) -> torch.Tensor:
        self.bind(state)
        getattr(RoundCore, self.round_name).__wrapped__(self.core)  # without its no_grad decorator (compiled under one)
        return self.core.output_length + 0


class RoundProgram(torch.nn.Module):
    """A round of a `RoundCore` (greedy, or `sampled`) as a module with no weights of its own: every input is a tensor
    of the caller, first each weight and buffer of target and drafter (tied ones once), then every tensor of the core
    (sampling settings and EOS ids included) and of its caches, which the round mutates in place. The compiled
    package therefore holds no constants: it runs on whatever weights and settings it is given, with nothing to copy
    or fold when it is loaded. (As buffers, the state would count as constants, which the compiler may fold with the
    values it saw; as constants, the weights would be copied into the package.)"""

    def __init__(self, core: RoundCore, sampled: bool = False):
        super().__init__()
        self.core = core  # a plain object, not a module
        self.round_name = ROUND_ENTRIES[sampled]
        self._state = list(round_state(core))
        self._caches = (core.target_cache, core.draft_cache)
        if any(k is None for cache in self._caches for k in cache.keys):
            raise ValueError("RoundProgram needs the core's caches allocated: prefill once first.")
        self._weight_names = list(round_weights(core.target, core.drafter))
        # set past nn.Module's __setattr__: as a submodule it would give the program the weights as parameters
        object.__setattr__(self, "round_module", _Round(self))

    def weights(self) -> tuple:
        """Every weight and buffer of target and drafter (each tensor once), in the order `forward` takes them."""
        named = round_weights(self.core.target, self.core.drafter)
        return tuple(named[name] for name in self._weight_names)

    def state(self) -> tuple:
        """The core's tensors in the order `forward` takes them after the weights: its state, then each cache's keys
        and values (what a round mutates)."""
        core = self.core
        return (*(getattr(core, name) for name in self._state),
                *(t for cache in self._caches for t in (*cache.keys, *cache.values)))

    def state_names(self) -> list[str]:
        """A name for each tensor of `state()`, in its order."""
        caches = zip(("target", "draft"), self._caches)
        return [*self._state, *(f"{side}_cache.{kind}[{layer}]" for side, cache in caches
                                for kind in ("keys", "values") for layer in range(len(cache.keys)))]

    def inputs(self) -> tuple:
        return (*self.weights(), *self.state())

    def eager(self) -> None:
        """The same round, run by the core itself (eager kernels)."""
        getattr(self.core, self.round_name)()

    def bind(self, tensors) -> None:
        """Point the core at `tensors` (under tracing: the traced stand-ins of its own)."""
        core, tensors = self.core, list(tensors)
        for name in self._state:
            setattr(core, name, tensors.pop(0))
        for cache in self._caches:
            n = len(cache.keys)
            cache.keys, cache.values, tensors = tensors[:n], tensors[n: 2 * n], tensors[2 * n:]

    def forward(self, *tensors) -> torch.Tensor:
        n = len(self._weight_names)
        weights = dict(zip(self._weight_names, tensors[:n]))
        return torch.func.functional_call(self.round_module, weights, tuple(tensors[n:]))


# ------------------------------------------------------------------------------------------------ the package
def cache_root() -> Path:
    """dflash2's cache folder: `DFLASH2_CACHE`, else ~/.cache/dflash2 (or under `XDG_CACHE_HOME`). What it holds can be
    deleted at any time; it is rebuilt when needed."""
    return Path(os.environ.get("DFLASH2_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash2"))


def cache_dir() -> Path:
    return cache_root() / "fused-rounds"


def spec_of(core: RoundCore) -> dict:
    """What the child needs to build the same core (and what the package's key is made of)."""
    target, drafter = core.target, core.drafter
    return {
        "format": PACKAGE_FORMAT,
        "target_class": f"{type(target).__module__}:{type(target).__qualname__}",
        "target_config": target.config,
        "attn_implementation": getattr(target.config, "_attn_implementation", None),
        "drafter_class": f"{type(drafter).__module__}:{type(drafter).__qualname__}",
        "drafter_config": drafter.config,
        "dtype": {"target": str(target.dtype), "drafter": str(drafter.dtype)},
        "device": str(core.device),
        "batch": core.batch, "capacity": core.capacity, "bucketed_prefill": core.bucketed_prefill,
        "tree_nodes": core.tree_nodes,
        "threads": torch.get_num_threads(),  # a guard of the compiled round: built and run at the same count
        "weights": weights_signature(target, drafter), "state": state_signature(core),
        "fusion_module": __name__,
        "code_modules": sorted({type(drafter).__module__, type(drafter.config).__module__, Sampling.__module__,
                                type(drafter).__mro__[1].__module__}),
    }


def package_key(spec: dict, portable: bool = False) -> str:
    """Changes with anything that changes the compiled rounds: shapes, configs, dtypes, device, code (`code_digest`),
    versions; not the sampling settings or EOS ids (tensors the rounds read), module names or a saved config's metadata.
    `portable`: the key of a shipped package (`shipped_package`), which leaves out the CUDA driver: the kernels are
    triton's cubins for the GPU's architecture, which any driver that runs this CUDA runtime loads."""
    import transformers

    device = torch.device(spec["device"])
    hardware = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) if (
        device.type == "cuda") else "cpu"
    left_out = ["target_config", "drafter_config", "fusion_module", "code_modules", "drafter_class"]
    if portable and device.type == "cuda":  # CUDA kernels take no CPU threads: the round runs at its build's count
        left_out.append("threads")  # (`loaded_round`), whatever this machine's
    described = json.dumps({k: v for k, v in spec.items() if k not in left_out}, sort_keys=True, default=str)
    drafter_config = {k: v for k, v in json.loads(spec["drafter_config"].to_json_string()).items()
                      if k not in ("auto_map", "architectures", "dtype", "transformers_version", "_name_or_path")}
    parts = [described, spec["target_config"].to_json_string(), json.dumps(drafter_config, sort_keys=True),
             str(hardware), *toolchain_versions(device, driver=not portable), transformers.__version__,
             code_digest(spec)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def code_digest(spec: dict) -> str:
    """The source of every module the round runs through, ours and the drafter's, by file name and as a drafter folder
    carries it (`flat_code`): one digest whether dflash2's package or a folder's flat copies run the round."""
    code, file_name = hashlib.sha256(), lambda module: module.rsplit(".", 1)[-1]
    for name in sorted({RoundCore.__module__, DraftTree.__module__, __name__, *spec["code_modules"]}, key=file_name):
        code.update(file_name(name).encode() + flat_code(Path(inspect.getsourcefile(sys.modules[name]))).encode())
    return code.hexdigest()


def toolchain_versions(device: torch.device, driver: bool = True) -> list[str]:
    """What inductor's code depends on beside torch: Python (a package holds bytecode), triton's version and, on
    CUDA, the CUDA runtime and (`driver`) the driver."""
    try:
        import triton

        versions = [torch.__version__, f"triton {triton.__version__}", f"python {platform.python_version()}"]
    except ImportError:
        versions = [torch.__version__, "no triton", f"python {platform.python_version()}"]
    if device.type == "cuda":
        versions.append(f"cuda {torch.version.cuda}")
        if driver:
            versions.append(f"driver {getattr(torch._C, '_cuda_getDriverVersion', lambda: 'unknown')()}")
    return versions


# ------------------------------------------------------------------------------------------------ shipped packages
SHIPPED_FOLDER = "fused-rounds"  # in a drafter folder or in dflash2's installed package: `<portable key>.round` files


def shipped_folders(drafter) -> list[Path]:
    """Where packages built elsewhere for the same GPU and toolchain may lie (`dflash2 precompile --artifacts`): the
    drafter's own folder, then dflash2's package folder."""
    folders = []
    name = getattr(drafter, "name_or_path", None)
    if name and Path(name).is_dir():
        folders.append(Path(name) / SHIPPED_FOLDER)
    package = sys.modules.get(__name__.rsplit(".", 2)[0]) if __name__.count(".") >= 2 else None
    if package is not None and getattr(package, "__file__", None):
        folders.append(Path(package.__file__).parent / SHIPPED_FOLDER)
    return folders


def shipped_package(core: RoundCore) -> Path | None:
    """The shipped package of `core`'s round: one whose portable key (`package_key`) matches this GPU, toolchain,
    code, configs and shapes; None when there is none. It is checked like any package before it is used."""
    name = f"{package_key(spec_of(core), portable=True)}.round"
    return next((folder / name for folder in shipped_folders(core.drafter) if (folder / name).is_file()), None)


def export_package(core: RoundCore, package: Path, folder: Path) -> Path:
    """Copy `core`'s built `package` into `folder` under its portable key (atomically): what `shipped_package` finds
    on another machine with the same GPU and toolchain. Beside it, `<key>.code` holds its `code_digest`."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = spec_of(core)
    destination = folder / f"{package_key(spec, portable=True)}.round"
    copy_atomically(package, destination)
    destination.with_suffix(".code").write_text(code_digest(spec) + "\n")
    return destination


def copy_atomically(source: Path, destination: Path) -> None:
    """`source` copied to `destination`, which appears whole or not at all."""
    with tempfile.NamedTemporaryFile(dir=destination.parent, prefix=f".{destination.name}.", delete=False) as f:
        partial = Path(f.name)
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, destination)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def build_package(spec: dict, path: Path, scratch: Path | None = None) -> None:
    """In the child: the core from the configs (uninitialised weights), one prefill to allocate its caches, both rounds
    compiled ahead of time with their weights as inputs, loaded and checked against the eager rounds; written
    atomically to `path` (built in `scratch`, a folder on the same file system: a new temporary one by default)."""
    import importlib

    def load_class(qualified: str):
        module, name = qualified.split(":")
        return getattr(importlib.import_module(module), name)

    torch.set_num_threads(spec["threads"])  # the caller's count, not this process's default
    dtypes = {side: getattr(torch, name.split(".")[-1]) for side, name in spec["dtype"].items()}
    device = torch.device(spec["device"])
    target_config = spec["target_config"]
    if spec["attn_implementation"]:
        target_config._attn_implementation = spec["attn_implementation"]
    with torch.device("meta"):
        target = load_class(spec["target_class"])._from_config(target_config, dtype=dtypes["target"])
        drafter = load_class(spec["drafter_class"])._from_config(spec["drafter_config"], dtype=dtypes["drafter"])
    target, drafter = target.to_empty(device=device).eval(), drafter.to_empty(device=device).eval()
    target.tie_weights()  # to_empty gives every parameter its own storage; the caller's tied ones are one input
    with torch.no_grad():  # values are irrelevant to the compiled code; only keep them finite (the check compares)
        for module in (target, drafter):
            for tensor in (*module.parameters(), *module.buffers()):
                tensor.zero_()
    drafter.attach(target)
    if weights_signature(target, drafter) != spec["weights"]:
        raise RuntimeError("the core built from the configs has other weights than the caller's ("
                           f"{first_differences(weights_signature(target, drafter), spec['weights'])}); its compiled "
                           "round would not take the caller's weights")
    core = RoundCore(target, drafter, spec["batch"], spec["capacity"], bucketed_prefill=spec["bucketed_prefill"],
                     tree_nodes=spec["tree_nodes"])
    ids = torch.zeros(spec["batch"], core.block_size, dtype=torch.long)
    core.prefill(ids, torch.ones_like(ids), 1)
    if state_signature(core) != spec["state"]:  # the guards of the compiled round would refuse the caller's state
        raise RuntimeError("the core built from the spec has other state tensors than the caller's ("
                           f"{first_differences(state_signature(core), spec['state'])}); not built")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch or path.parent) as folder:
        partial = Path(folder) / path.name
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as package:  # code and cubins shrink
            package.writestr(THREADS_ENTRY, str(spec["threads"]))
            for sampled, entry in ROUND_ENTRIES.items():
                saved = Path(folder) / entry
                started = time.perf_counter()
                compile_round(RoundProgram(core, sampled)).save_compiled_function(str(saved))
                package.write(saved, entry)
                print(f"{entry}: compiled in {time.perf_counter() - started:.1f} s, {saved.stat().st_size / 1e6:.1f} "
                      "MB", flush=True)  # the build's log says where its time goes
        # loaded and checked here first: a round that cannot be loaded (a loader that crashes the loading process) or
        # disagrees ends this child, never the caller, and is never published
        started = time.perf_counter()
        if load_fused_rounds(core, partial) is None:
            raise RuntimeError("the package built here failed its own check; not published")
        print(f"loaded and checked in {time.perf_counter() - started:.1f} s; package {partial.stat().st_size / 1e6:.1f} "
              "MB", flush=True)
        os.replace(partial, path)


def compile_round(program: RoundProgram):
    """`program`'s round compiled ahead of time (`aot_compile`), its core's tensors bound back after the trace."""
    real = program.state()
    # guards: only tensor metadata and global state (grad mode), which the caller's inputs match by construction; the
    # checks of the package compare rounds, not guards
    keep = getattr(torch.compiler, "keep_portable_guards_unsafe", torch.compiler.skip_all_guards_unsafe)
    gate = getattr(torch._dynamo.config, "enable_aot_compile", None)  # needed where the API is still gated
    with torch.no_grad(), torch._dynamo.config.patch(**({"enable_aot_compile": True} if gate is not None else {})):
        compiled = torch.compile(program.forward, fullgraph=True, options={"guard_filter_fn": keep}).aot_compile(
            (program.inputs(), {}))
    program.bind(real)
    return compiled


def open_fused_rounds(core: RoundCore, path: Path):
    """({do_sample: the saved round over `core`'s own weights, buffers and state}, None), or (None, why they cannot be
    used): the package fails to load or run, or a round disagrees with its eager round (`agreement`; the sampled one
    with every warping active, `sampled_agreement`)."""
    programs = {sampled: RoundProgram(core, sampled) for sampled in ROUND_ENTRIES}
    try:
        with zipfile.ZipFile(path) as package:
            threads = int(package.read(THREADS_ENTRY))
            fused = {sampled: loaded_round(program, package.open(ROUND_ENTRIES[sampled]), threads)
                     for sampled, program in programs.items()}
        differences = agreement(core, programs[False], fused[False])
        if not differences:
            differences = sampled_agreement(core, programs[True], fused[True])
    except Exception as error:  # noqa: BLE001 - any failure leaves the unfused round in place
        return None, f"the fused rounds in {path} could not be used ({type(error).__name__}: {error})"
    if differences:
        return None, (f"a fused round in {path} disagreed with the eager round on each of {CHECK_ROUNDS} rounds "
                      f"(last: {'; '.join(differences)})")
    return fused, None


def loaded_round(program: RoundProgram, file, threads: int | None = None):
    """The compiled round saved in `file`, as a call over `program`'s core's own tensors, run at torch's thread count
    `threads` (the build's, a guard of the round; a shipped CUDA package's may be another than this machine's, and a
    captured round calls it only while its graph is captured)."""
    compiled = torch.compiler.load_compiled_function(file)
    inputs = program.inputs()

    def fused() -> None:
        with torch.no_grad(), thread_count(threads):  # as it was compiled (guards)
            compiled(program, *inputs)

    return fused


@contextlib.contextmanager
def thread_count(threads: int | None):
    """torch's thread count set to `threads` (None: as it is) inside, and back after."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_fused_rounds(core: RoundCore, path: Path):
    """`open_fused_rounds`'s rounds, or None with a warning saying why."""
    fused, why = open_fused_rounds(core, path)
    if why is not None:
        warnings.warn(f"DFlash 2: {why}; decoding with the unfused round.", stacklevel=2)
    return fused


class preserved:
    """Every tensor of a core (state and caches) as it was on entry, again on exit."""

    def __init__(self, core: RoundCore):
        self.buffers = dict(enumerate(RoundProgram(core).state()))

    def __enter__(self):
        self.before = {name: tensor.clone() for name, tensor in self.buffers.items()}
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for name, tensor in self.buffers.items():
                tensor.copy_(self.before[name])


CHECK_ROUNDS = 3
# the settings the sampled round is checked with, whatever the request's: every warping active (top-k below the
# vocabulary of any model), with noise from a fixed seed
CHECK_SAMPLING = Sampling(True, temperature=0.7, top_k=20, top_p=0.9)
# relative error (norm of the difference over the norm of the eager tensor) allowed in floating state: other kernels
# round otherwise, and in half precision that shows after thirty layers (about 1e-2 in the caches); a package that
# runs on the wrong weights or state is off by order one
FLOAT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 5e-2
# In half precision, the margin of the eager round's token over the fused round's token at the first token where a
# row's rounds part, relative to the largest logit there, up to which the two are a near tie that other kernels'
# rounding can flip: the relative error the state may have (logits move with the hidden states, about 1e-2 after
# thirty layers, on both tokens). A fused round on wrong weights, positions or masks parts with margins of order one,
# and its keys and values on the tokens before differ as much.
NEAR_TIE = HALF_TOLERANCE
# What a round writes, per row: compared for the rows whose rounds agree (`round_differences`)
ROUND_OUTPUTS = ("accepted_per_position", "anchor", "context_columns", "done", "features", "output", "output_length",
                 "rounds", "start")


@torch.no_grad()
def agreement(core: RoundCore, program: RoundProgram, fused, rounds: int = CHECK_ROUNDS) -> list[str]:
    """Runs `program`'s round eager and `fused` from the same state (`round_differences`); [] when they agree, else
    what differed. A round that does not agree (every row parted on near ties, as a batch of one row can) is followed
    by another from the eager round's state, up to `rounds` in all; the core's state is restored after."""
    with preserved(core):
        for _ in range(rounds):
            differences = round_differences(core, program, fused)
            if not differences:
                return []
            program.eager()  # the next check starts where the eager round left off
    return differences


@torch.no_grad()
def round_differences(core: RoundCore, program: RoundProgram, fused) -> list[str]:
    """One round eager and one `fused` from the core's current state (restored after), compared row by row: what
    differed, [] when they agree (`round_comparison`)."""
    return round_comparison(core, program, fused)["differences"]


@torch.no_grad()
def round_comparison(core: RoundCore, program: RoundProgram, fused) -> dict:
    """One round eager and one `fused` from the core's current state (restored after), compared row by row:
    {"parted": where rows parted (`parting`), "differences": what differed, [] when they agree}.

    A row whose rounds emit the same tokens agrees when its integer state is equal and its floating state within
    `FLOAT_TOLERANCE`, over what later rounds read (`RoundCore.live_entries`: a rejected draft's entries, which flip
    on near ties between kernels in half precision, are left out). A row whose rounds part (`parting`) is allowed
    only in half precision and only where rounding explains it; its state is then compared up to where they part.
    At least one row must agree in full (else the next round is checked: `agreement`)."""
    names = program.state_names()
    buffers = dict(zip(names, program.state()))
    start, length = core.start.clone(), core.output_length.clone()
    with preserved(core):
        with recorded_verification(core) as verified:
            program.eager()
        eager = {name: tensor.clone() for name, tensor in buffers.items()}
    with preserved(core):
        fused()
        parted, unexplained = parting(core, program.round_name != "round", start, length, eager, buffers, verified)
        agreeing = ~parted["rows"]
        if unexplained or not agreeing.any():
            return {"parted": parted, "differences": unexplained or [
                f"every row parted from the eager round (row 0 after {int(parted['tokens'][0])} tokens)"]}
        live = core.live_entries(start=torch.where(agreeing, eager["start"], start + 1 + parted["depth"]),
                                 length=torch.where(agreeing, eager["output_length"], length + parted["tokens"]),
                                 context_columns=eager["context_columns"])
        return {"parted": parted, "differences": [difference for name in names if (difference := differs(
            name, buffers[name], eager[name], compared_entries(name, live, agreeing))) is not None]}


@torch.no_grad()
def sampled_agreement(core: RoundCore, program: RoundProgram, fused) -> list[str]:
    """`agreement` of the sampled round under `CHECK_SAMPLING` on every row and seeded noise (settings and noise are
    core tensors: restored after, with the rest of the state)."""
    with preserved(core):
        core.temperature.fill_(CHECK_SAMPLING.temperature)
        core.top_k.fill_(CHECK_SAMPLING.top_k)
        core.top_p.fill_(CHECK_SAMPLING.top_p)
        core.draw_noise(torch.Generator(core.device).manual_seed(0))
        return agreement(core, program, fused)


def parting(core: RoundCore, sampled: bool, start, length, eager: dict, fused: dict, verified: dict):
    """Where each row's fused round (the `sampled` one, or greedy) parts from its eager round, both from `start` and
    `length`: ({"rows": which rows emitted other tokens or another number of them, "tokens": how many leading tokens
    they share, "depth": the depth of the deepest node both accepted paths share}, [why a parting is no rounding]).

    Every token a greedy round emits is the target's argmax after the accepted path before it, so where two rounds'
    tokens first differ, the eager round's logits there must be a near tie between the two (`NEAR_TIE`); a wrong
    round parts with a margin of order one. Rounds that share their tokens and emit another number of them drafted
    other trees (near ties among the drafter's candidates): the target still chose every token. The sampled round
    draws its tokens from the same noise by other kernels; its own steps read no padding and no position (the model
    forwards they share with the greedy round are checked there), so its partings are rounding too, and its state is
    still compared up to them. In fp32 no row may part."""
    batch = core.batch
    rows = torch.zeros(batch, dtype=torch.bool)
    tokens, depth, unexplained = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long), []
    half = core.target_dtype not in FLOAT_TOLERANCE
    for row in range(batch):
        begin = int(length[row])
        ours = eager["output"][row, begin: int(eager["output_length"][row])].tolist()
        theirs = fused["output"][row, begin: int(fused["output_length"][row])].tolist()
        shared = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        tokens[row], depth[row] = shared, min(shared, len(ours) - 1, len(theirs) - 1)
        if ours == theirs:
            continue
        rows[row] = True
        if not half or not ours or not theirs:  # a live row emits in both rounds; a frozen one in neither
            unexplained.append(f"row {row}: the fused round emitted {theirs}, the eager round {ours}")
        elif shared < min(len(ours), len(theirs)) and not sampled:
            logits = verified["logits"][row, int(verified["path"][row, shared])].float()
            margin = float(logits[ours[shared]] - logits[theirs[shared]])
            tolerance = NEAR_TIE * float(logits.abs().max())
            if margin > tolerance:
                unexplained.append(f"row {row}: token {shared} of the round is {theirs[shared]} fused, {ours[shared]} "
                                   f"eager, whose logits part by {margin:.3g} > {tolerance:.3g} (no near tie)")
    return {"rows": rows.to(core.device), "tokens": tokens.to(core.device), "depth": depth.to(core.device)}, unexplained


@contextlib.contextmanager
def recorded_verification(core: RoundCore):
    """While an eager round of `core` runs: the target's logits at each node it verified ("logits" [b, N, V]) and the
    nodes of the accepted path by depth ("path" [b, B]; a path round's block is its path)."""
    seen = {"path": core.offsets.expand(core.batch, -1)}

    def recording(method):
        def verify(*args):
            logits, features = method(*args)
            seen["logits"] = logits
            return logits, features
        return verify

    def keep_path(path):
        seen["path"] = path
        RoundCore.keep_path(core, path)

    core.verify, core.verify_tree, core.keep_path = recording(core.verify), recording(core.verify_tree), keep_path
    try:
        yield seen
    finally:
        for name in ("verify", "verify_tree", "keep_path"):
            vars(core).pop(name, None)


def compared_entries(name: str, live: dict, agreeing: torch.Tensor) -> torch.Tensor | None:
    """The mask of `live` (`RoundCore.live_entries`) for the state tensor `name`; a round's own per-row outputs only
    for the `agreeing` rows (output and features up to where a row parted); None where all of it is compared."""
    if name in live:
        return live[name]
    if name.startswith(("target_cache.", "draft_cache.")):
        return live["cache_columns"][:, None, :, None]  # [b, 1, capacity, 1] over [b, kv heads, capacity, head dim]
    if name in ROUND_OUTPUTS:
        return agreeing
    return None


def differs(name: str, fused: torch.Tensor, eager: torch.Tensor, mask: torch.Tensor | None = None) -> str | None:
    """What differs between `fused` and `eager` (where `mask` is True, when given), or None."""
    if mask is not None:  # a mask of leading dimensions covers the ones after
        mask = mask.to(eager.device).reshape(*mask.shape, *[1] * (eager.dim() - mask.dim())).expand_as(eager)
        fused, eager = fused[mask], eager[mask]
    if not eager.is_floating_point():
        return None if torch.equal(fused, eager) else f"{name}: {int((fused != eager).sum())} values differ"
    tolerance = FLOAT_TOLERANCE.get(eager.dtype, HALF_TOLERANCE)
    error = float((fused.double() - eager.double()).norm() / eager.double().norm().clamp_min(1e-30))
    return None if error <= tolerance else f"{name}: relative error {error:.2e} > {tolerance:.0e}"
