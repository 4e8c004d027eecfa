"""The expert baseline: plain greedy or sampled decoding of a transformers causal LM as a hand-written CUDA-graph loop.

gpt-fast style, with no `generate` around it: one static cache (transformers' `StaticCache`), the prompt prefilled
once, then one-token steps. A step -- the model's forward, the argmax, the token written into a preallocated output
buffer on the device, the cache's write column advanced by the cache on the device -- is captured once as a CUDA graph
(`generation.graphs.CapturedGraph`: warm-up on a side stream, then the capture) and replayed; with `compile=True` the
step is compiled by inductor first and that is captured. The host reads the device once every `check_every` steps (have
all rows reached EOS?) and once at the end (the tokens); without EOS it reads only at the end. On a CPU (or a model
spread over several devices) the same step runs as plain calls.

EOS. Steps queued between two reads run on after a row's EOS; their tokens are dropped (each row is cut after its first
EOS and right-padded, as `generate` does), so the output and the token count equal plain greedy `generate`'s, while the
time includes the at most `check_every - 1` wasted steps (DFlash 2's loop reads every 4 rounds the same way). A call's
prefill empties the cache (`StaticCache.reset`) and runs one eager forward, timed like every method's prefill.

Sampling (`sampling=Sampling(do_sample=True, ...)`): the step samples from the temperature / top-k / top-p-warped
distribution (`generation.sampling.row_warped_logits`, transformers' warpers; at no top-k or top-p cut only the
temperature divides, as a hand-written loop would) by the Gumbel-max trick: the argmax of the warped logits plus
standard Gumbel noise is an exact sample. The settings are per-row tensors, so one captured step serves every
temperature; the noise is drawn into a fixed buffer before each replay (a few small kernels outside the graph, as DFlash
2's sampled round draws its own), and the first token after the prefill is sampled like `generate`'s.

Buffers. The cache has `capacity` columns, chosen as DFlash 2's own loop chooses its buffers on a GPU
(`generation.loop.capacity_for`): a step attends over every column (like `generate`'s static cache, which is sized to
the request), and one captured graph serves every request of a capacity. Rows of a batch must have the same length (no
padding mask).
"""

from __future__ import annotations

import statistics
import time

import torch

from dflash2.benchmarks.common import wall_timed
from dflash2.generation.loop import capacity_for as own_loop_capacity
from dflash2.generation.sampling import Sampling, first_token, is_any_of, row_warped_logits
from dflash2.modeling_dflash2 import sample_gumbel

CHECK_EVERY = 8  # steps queued between two host reads of the done flags (when there is an EOS)


class PlainGraphLoop:
    """Decoding of `model` for `batch` rows in a static cache of `capacity` columns: greedy, or sampled with `sampling`
    (whose cuts, top-k or top-p or none, are fixed per loop; its temperature and cut values are set per call)."""

    def __init__(self, model, batch: int, capacity: int, eos_token_ids=(), compile: bool = False,
                 capture: bool | None = None, check_every: int = CHECK_EVERY, sampling: Sampling | None = None):
        from transformers import StaticCache

        from dflash2.modeling_dflash2 import cache_keyword

        self.model, self.batch, self.capacity, self.check_every = model, batch, capacity, check_every
        self.device = device = model.get_output_embeddings().weight.device
        # the cache keeps its own write column (a device counter per layer, advanced by each forward)
        self.cache = {cache_keyword(model): StaticCache(config=model.config, max_cache_len=capacity)}
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(batch, 1, **long)  # the last emitted token: the next step's input
        self.length = torch.zeros(1, **long)  # tokens emitted so far: the next one's column in `output`
        self.output = torch.zeros(batch, capacity, **long)
        self.eos = torch.tensor(sorted(set(eos_token_ids)), **long)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.sampled = sampling is not None and sampling.do_sample
        self.cuts = self.sampled and has_cuts(sampling)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.temperature = torch.ones(batch, dtype=torch.float32, device=device)  # [b]
        self.top_k = torch.zeros(batch, **long)  # [b], 0: no cut
        self.top_p = torch.ones(batch, dtype=torch.float64, device=device)  # [b], 1.0: no cut
        self.gumbel = torch.zeros(batch, vocab if self.sampled else 1, device=device)  # [b, V]: the next step's noise
        self.capture = single_cuda_device(model) if capture is None else capture
        self.step_fn = torch.compile(self.step, mode="default", dynamic=False) if compile else self.step
        self.graph = None  # captured at the first call, once a prefill has allocated the cache
        self.kind = ("graph (fused)" if compile else "graph (eager kernels)") if self.capture else (
            "compiled" if compile else "eager")

    @torch.no_grad()
    def step(self) -> None:
        """One token for every row: forward, argmax (or a sample), into `output`; everything stays on the device."""
        logits = self.model(input_ids=self.token, use_cache=True, **self.cache).logits
        token = self.choose(logits[:, -1])
        self.output.index_copy_(1, self.length, token.view(-1, 1))
        self.token.copy_(token.view(-1, 1))
        self.done.logical_or_(is_any_of(token, self.eos))
        self.length.add_(1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token per row from logits [b, V]: the argmax, or a sample (Gumbel-max over the warped logits)."""
        if not self.sampled:
            return logits.argmax(-1)
        if self.cuts:
            warped = row_warped_logits(logits, self.temperature, self.top_k, self.top_p)
        else:
            warped = logits.float() / self.temperature.view(-1, 1)
        return (warped + self.gumbel).argmax(-1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """The prompt [b, P] into the emptied cache (one eager forward) and each row's first token."""
        for cache in self.cache.values():
            cache.reset()
        logits = self.model(input_ids=input_ids.to(self.device), use_cache=True, logits_to_keep=1, **self.cache).logits
        token = first_token(logits[:, -1], self.sampled, self.temperature, self.top_k, self.top_p, generator)
        self.output[:, 0] = token
        self.token.copy_(token.view(-1, 1))
        self.done.copy_(torch.isin(token, self.eos))
        self.length.fill_(1)

    def run_step(self, generator: torch.Generator | None = None) -> None:
        if self.sampled:
            sample_gumbel(self.gumbel.shape, self.device, generator, out=self.gumbel)
        if self.graph is not None:
            self.graph()
        else:
            self.step_fn()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, pad_token_id: int = 0,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """The continuation of `input_ids` [b, P] (no padding): [b, P + new], like `generate` with `sampling` (greedy
        when None; a sampled loop needs the sampling setting it was built for, with any temperature and cut values)."""
        from dflash2.generation.graphs import CapturedGraph

        batch, length = input_ids.shape
        if batch != self.batch or length + max_new_tokens + 2 > self.capacity:  # 2: the capture's warm-up steps
            raise ValueError(f"{batch} rows of {length} + {max_new_tokens} new tokens do not fit this loop "
                             f"({self.batch} rows, {self.capacity} columns); use plain_graph_generate.")
        sampled = sampling is not None and sampling.do_sample
        if sampled != self.sampled or (sampled and has_cuts(sampling) != self.cuts):
            raise ValueError(f"this loop was built for {self.describe()} and cannot decode with {sampling}; use "
                             "plain_graph_generate, which keeps a loop per kind of setting.")
        if sampled:
            self.temperature.fill_(sampling.temperature)
            self.top_k.fill_(sampling.top_k)
            self.top_p.fill_(sampling.top_p)
        if self.capture and self.graph is None:
            self.prefill(input_ids)  # allocates the cache; the warm-up steps' state is redone by the prefill below
            self.graph = CapturedGraph(self.step_fn)
        self.prefill(input_ids, generator)
        check = bool(self.eos.numel())
        emitted, finished = 1, check and bool(self.done.all())
        while emitted < max_new_tokens and not finished:
            steps = min(self.check_every if check else max_new_tokens, max_new_tokens - emitted)
            for _ in range(steps):
                self.run_step(generator)
            emitted += steps
            finished = check and bool(self.done.all())  # the one host read per chunk of steps
        return torch.cat([input_ids, cut_at_eos(self.output[:, :emitted], self.eos, pad_token_id).to(
            input_ids.device)], dim=1)

    def describe(self) -> str:
        return ("sampling with top-k or top-p cuts" if self.cuts else "sampling with a temperature only") if (
            self.sampled) else "greedy decoding"


def call_sampling(model, kwargs: dict) -> Sampling:
    """The sampling setting `model.generate(**kwargs)` would use, resolved as DFlash 2's own loop resolves a call
    (`generation/dispatch.py`): transformers' own preparation of the call's settings over the model's generation config
    over its global defaults (top_k=50 where a sampling call leaves top_k unset)."""
    config, _ = model._prepare_generation_config(None, **kwargs)
    return Sampling.from_generation_config(config)


def has_cuts(sampling: Sampling) -> bool:
    """Whether a sampling setting cuts the distribution (top-k or top-p): a loop is built for one or the other."""
    return bool(sampling.top_k) or sampling.top_p < 1.0


def cut_at_eos(tokens: torch.Tensor, eos: torch.Tensor, pad: int) -> torch.Tensor:
    """Each row's tokens [b, n] up to and including its first EOS, `pad` after it; the columns after the last row's
    EOS dropped (generate's output)."""
    is_eos = torch.isin(tokens, eos.to(tokens.device)).long()
    after = (is_eos.cumsum(-1) - is_eos) > 0
    tokens = tokens.masked_fill(after, pad)
    width = int((~after).sum(-1).max()) if tokens.numel() else 0
    return tokens[:, :width]


def single_cuda_device(model) -> bool:
    devices = {p.device for p in model.parameters()}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def capacity_for(length: int, new_tokens: int) -> int:
    """Cache columns for `length` prompt and `new_tokens` tokens (and warm-up steps): the own loop's CUDA buffers."""
    return own_loop_capacity(length + new_tokens + 2, graphs=True)


def plain_graph_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                         pad_token_id: int | None = None, compile: bool = False, sampling: Sampling | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Decoding of `input_ids` [b, P] (greedy, or sampled with `sampling`) through the loop for this (model, batch,
    capacity, EOS, compile, kind of sampling), built and captured at its first use and kept on the model's instance
    dict (`plain_graph_loops`)."""
    eos = () if eos_token_id is None else tuple(eos_token_id if isinstance(eos_token_id, (list, tuple)) else
                                                [eos_token_id])
    capacity = capacity_for(input_ids.shape[1], max_new_tokens)
    loops = model.__dict__.setdefault("plain_graph_loops", {})
    sampled = sampling is not None and sampling.do_sample
    kind = ("cuts" if has_cuts(sampling) else "temperature") if sampled else "greedy"
    key = (input_ids.shape[0], capacity, tuple(sorted(set(eos))), compile, kind)
    if key not in loops:
        loops[key] = PlainGraphLoop(model, input_ids.shape[0], capacity, eos, compile=compile,
                                    sampling=sampling if sampled else None)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    return loops[key].generate(input_ids, max_new_tokens, pad, sampling if sampled else None, generator)


def timed_plain_graph_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                                pad_token_id: int | None = None, compile: bool = False,
                                sampling: Sampling | None = None):
    """`plain_graph_generate` timed as a user waits for it: (output [b, P + new], wall seconds, the device synchronised
    before and after)."""
    return wall_timed(lambda: plain_graph_generate(model, input_ids, max_new_tokens, eos_token_id, pad_token_id,
                                                   compile, sampling), input_ids.device)


def timed_plain_graph_call(model, input_ids: torch.Tensor, kwargs: dict, compile: bool = False):
    """`timed_plain_graph_generate` as a `generate` call with `kwargs` would run: its max_new_tokens, pad_token_id,
    eos_token_id (the model's when it names none) and sampling setting (`call_sampling`)."""
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    return timed_plain_graph_generate(model, input_ids, kwargs["max_new_tokens"], eos, kwargs["pad_token_id"], compile,
                                      call_sampling(model, kwargs))


def forget_plain_graph_loops(model) -> None:
    """Drop the loops (their caches and graphs) kept on `model`."""
    model.__dict__.pop("plain_graph_loops", None)


# ------------------------------------------------------------------------------------------------ timing forwards
def device_ms(fn, device, replays: int = 50, repeats: int = 3) -> float:
    """Milliseconds per call of `fn`, the median over `repeats` of `replays` back-to-back calls: timed by CUDA events
    on a GPU (device time, no host read in between), by the wall clock on a CPU. One untimed call first."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        else:
            started = time.perf_counter()
            for _ in range(replays):
                fn()
            times.append((time.perf_counter() - started) * 1e3 / replays)
    return statistics.median(times)


@torch.no_grad()
def forward_fn(model, tokens: int, context: int, capacity: int | None = None, compile: bool = False):
    """A function of no arguments: one forward of `tokens` new tokens (and their argmax) after `context` cached ones
    in a static cache of `capacity` columns (default: the plain loop's for context + tokens): 1 token is a plain
    decoding step, 16 a 16-token verify forward; `compile`: fused by inductor first, like the plain loop's
    `compile=True` step. Each call ends by moving the cache's write columns back by `tokens` (one small kernel), so
    every call writes and reads the same columns."""
    from transformers import StaticCache

    from dflash2.modeling_dflash2 import cache_keyword

    device = model.get_output_embeddings().weight.device
    cache = StaticCache(config=model.config, max_cache_len=capacity or capacity_for(context, tokens))
    keyword = {cache_keyword(model): cache}
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    model(input_ids=torch.randint(3, vocab, (1, context), generator=generator).to(device), use_cache=True,
          logits_to_keep=1, **keyword)
    ids = torch.randint(3, vocab, (1, tokens), generator=generator).to(device)
    counters = [layer.cumulative_length for layer in cache.layers]  # transformers' per-layer write column
    chosen = torch.zeros(1, tokens, dtype=torch.long, device=device)

    def forward():
        chosen.copy_(model(input_ids=ids, use_cache=True, **keyword).logits.argmax(-1))
        torch._foreach_sub_(counters, tokens)

    step = torch.compile(forward, mode="default", dynamic=False) if compile else forward

    def call():
        with torch.no_grad():
            step()

    call.chosen = chosen  # the argmax of the last call
    return call
