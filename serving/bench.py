"""Drive an OpenAI-compatible server on this machine with streamed chat requests: closed-loop clients and a fixed-rate
Poisson mode. Any such server: `dflash2 serve`, `transformers serve` (with or without --continuous-batching or
--compile), vLLM.

    python -m dflash2.serving.bench --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct-DFlash2 \\
        --clients 1 4 8 --requests 64 --max-tokens 256 --out runs/serve/dflash2.json

Closed loop: each of N clients sends its next request when its last one ends, until `--requests` requests have been
sent (or `--max-seconds` passed). Poisson (`--rates R ...`): requests arrive at R per second on average (exponential
gaps, seeded), each on its own connection, `--requests` of them. The prompts are MT-Bench first turns (spread over its
80 questions from question 5 on) and HumanEval tasks (from 100 on), alternating, in the server's chat template;
every answer asks for `--max-tokens` tokens at `--temperature`.

Per setup: aggregate tokens/s (completion tokens of every request / wall time), per-request latency and time to first
token (p50, p95), the errors, and tau from the server's /metrics when it is a dflash2 server. `--plain-graph` also
times the plain CUDA-graph decode loop (`plain_graph.py`, batch 1, greedy) on the same prompts in this process, as the
reference of the call. Only servers on 127.0.0.1 / localhost are driven.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from urllib.parse import urlparse

from dflash2.benchmarks.common import command_line, write_report
from dflash2.model_args import add_model_arguments, positive_int

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def bench_prompts(count: int) -> list[str]:
    """`count` user messages, MT-Bench first turns and HumanEval tasks alternating (repeated when more are asked):
    MT-Bench spread evenly over its 80 questions from question 5 on (every category), HumanEval from task 100 on (the
    sets of docs/benchmarks.md, past the first few)."""
    from dflash2.tasks import task_prompts

    half = -(-count // 2)
    mtbench, humaneval = task_prompts("mtbench", 80), task_prompts("humaneval", 64, skip=100)
    spread = min(half, 75)
    picked = [mtbench[5 + index * 75 // spread] for index in range(spread)]
    mixed = [prompt for pair in zip(picked, humaneval) for prompt in pair]
    return [mixed[index % len(mixed)] for index in range(count)]


def one_request(client, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    """One streamed chat request: its latency, time to first token, completion tokens (the usage chunk's, else the
    content chunks counted) and error."""
    started = time.perf_counter()
    first = None
    chunks = tokens = 0
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=temperature, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                chunks += 1
    except Exception as error:  # reported with the setup's results; the run goes on
        return {"error": f"{type(error).__name__}: {error}"[:300], "latency": time.perf_counter() - started}
    ended = time.perf_counter()
    return {"latency": ended - started, "ttft": (first or ended) - started, "tokens": tokens or chunks,
            "counted": "usage" if tokens else "chunks"}


def closed_loop(client, model: str, prompts: list[str], clients: int, args) -> tuple[list[dict], float]:
    """`clients` threads, each sending its next request when its last ends, until every prompt was sent."""
    results, lock, next_index = [], threading.Lock(), [0]
    deadline = time.perf_counter() + args.max_seconds

    def client_loop():
        while time.perf_counter() < deadline:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= len(prompts):
                return
            result = one_request(client, model, prompts[index], args.max_tokens, args.temperature)
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def poisson(client, model: str, prompts: list[str], rate: float, args) -> tuple[list[dict], float]:
    """Requests arriving at `rate` per second on average (exponential gaps), each in a thread of its own."""
    rng = random.Random(args.seed)
    results, lock, threads = [], threading.Lock(), []
    deadline = time.perf_counter() + args.max_seconds

    def send(prompt):
        result = one_request(client, model, prompt, args.max_tokens, args.temperature)
        with lock:
            results.append(result)

    started = time.perf_counter()
    for prompt in prompts:
        if time.perf_counter() >= deadline:
            break
        thread = threading.Thread(target=send, args=(prompt,))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()) + args.max_tokens)
    return results, time.perf_counter() - started


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summary(results: list[dict], seconds: float) -> dict:
    done = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in done)
    latencies, ttfts = [r["latency"] for r in done], [r["ttft"] for r in done]
    return {"requests": len(done), "errors": len(results) - len(done),
            "error_examples": sorted({r["error"] for r in results if "error" in r})[:3],
            "completion_tokens": tokens, "wall_seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
            "latency_p50": percentile(latencies, 0.5), "latency_p95": percentile(latencies, 0.95),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
            "tokens_counted_from": sorted({r["counted"] for r in done})}


def server_counters(url: str) -> dict:
    """The dflash2 counters of the server's /metrics ({} for a server without them)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except Exception:
        return {}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("dflash2_") and not name.startswith("#"):
            try:
                counters[name] = float(value)
            except ValueError:
                pass
    return counters


def tau_between(before: dict, after: dict) -> float | None:
    tokens = after.get("dflash2_completion_tokens_total", 0) - before.get("dflash2_completion_tokens_total", 0)
    forwards = after.get("dflash2_target_forwards_total", 0) - before.get("dflash2_target_forwards_total", 0)
    return round(tokens / forwards, 3) if forwards else None


def plain_graph_reference(args, prompts: list[str]) -> dict:
    """The plain CUDA-graph decode loop (batch 1, greedy, its step fused by inductor: the expert's baseline) on the
    same prompts, in this process: tokens/s over them."""
    import torch

    from dflash2.benchmarks.plain_graph import capacity_for, timed_plain_graph_generate
    from dflash2.generation.sampling import eos_token_ids
    from dflash2.generation.stats import truncate_at_eos
    from dflash2.model_args import load_pair
    from dflash2.tasks import chat_prompt_ids

    target, tokenizer, _ = load_pair(args)
    device = next(target.parameters()).device
    eos = target.generation_config.eos_token_id
    tokens = seconds = 0.0
    eos_ids = set(eos_token_ids(target.generation_config))
    encoded = [torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device) for prompt in prompts]
    one_per_capacity = {capacity_for(ids.shape[1], args.max_tokens): ids for ids in encoded}
    for ids in one_per_capacity.values():  # every loop compiled and captured outside the timing
        timed_plain_graph_generate(target, ids, args.max_tokens, eos, tokenizer.eos_token_id, compile=True)
    for ids in encoded:
        out, took = timed_plain_graph_generate(target, ids, args.max_tokens, eos, tokenizer.eos_token_id,
                                               compile=True)
        tokens += len(truncate_at_eos(out[0, ids.shape[1]:].tolist(), eos_ids))
        seconds += took
    return {"prompts": len(prompts), "completion_tokens": int(tokens), "wall_seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 2), "device": str(device)}


def check_local(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"serving.bench: error: --url {url} is not on this machine; it drives 127.0.0.1 / localhost "
                         "servers only.")
    return url.rstrip("/").removesuffix("/v1")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dflash2.serving.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (127.0.0.1 / localhost only)")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--clients", type=positive_int, nargs="*", default=[1, 4, 8],
                        help="closed-loop client counts, one setup each")
    parser.add_argument("--rates", type=float, nargs="*", default=[],
                        help="Poisson arrival rates (requests/s), one setup each")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per setup")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="tokens asked per answer")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="no request starts after this per setup")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson gaps")
    parser.add_argument("--label", default=None, help="what the server is, for the report")
    parser.add_argument("--plain-graph", action="store_true",
                        help="also time the plain CUDA-graph loop (batch 1) on the same prompts, in this process")
    parser.add_argument("--out", default=None, help="JSON report path")
    add_model_arguments(parser, max_new_tokens=256)  # --temperature of the requests; the rest for --plain-graph
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    import openai

    args = parse_args(argv)
    url = check_local(args.url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0,
                           timeout=args.max_seconds + 60)
    model = args.model or client.models.list().data[0].id
    prompts = bench_prompts(args.requests)
    one_request(client, model, prompts[0], 8, args.temperature)  # warm-up: the server's first call is not timed
    report = {"command": command_line("dflash2.serving.bench", argv), "url": url, "model": model,
              "label": args.label, "max_tokens": args.max_tokens, "temperature": args.temperature, "setups": []}
    setups = [("closed", clients) for clients in args.clients] + [("poisson", rate) for rate in args.rates]
    for mode, value in setups:
        before = server_counters(url)
        if mode == "closed":
            results, seconds = closed_loop(client, model, prompts, value, args)
        else:
            results, seconds = poisson(client, model, prompts, value, args)
        setup = {"mode": mode, ("clients" if mode == "closed" else "rate"): value, **summary(results, seconds),
                 "tau": tau_between(before, server_counters(url))}
        report["setups"].append(setup)
        print(json.dumps(setup), flush=True)
    if args.plain_graph:
        report["plain_graph"] = plain_graph_reference(args, prompts)
        print(json.dumps({"plain_graph": report["plain_graph"]}), flush=True)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
