"""Continuous batching on DFlash 2's own loop: requests take rows of the loop's round runners as rows free up.

A request waits in a bounded queue until a row is free, then is prefilled by the one-row runner (its prefill captured
per prompt bucket on a GPU) and its row copied into a free row of the running set (`RoundCore.copy_row`: the other
rows keep their state; a later turn of a conversation a row still holds encodes only its new tokens there,
`RoundCore.admit`), and the next round decodes it beside the others. Rounds are the runners' own (captured
as CUDA graphs on one GPU, fused once the background build is ready): admission writes into the same fixed buffers,
so no new shape is ever compiled or captured. A row that finishes (EOS, its token limit, a stop string, a client that
left) is frozen on the device at the next host read and taken by the next waiting request. The engine keeps runners
of 1, 2, 4, ... rows and decodes on the smallest that holds the running requests (`Engine.resize`).

Each row keeps its own temperature, top-k, top-p, token limit and random generator. The greedy and the sampled round
are two different rounds of the core; when both kinds of request run at once, the engine runs one of each per step,
each with the other kind's rows frozen (a frozen row's state does not move: `RoundCore.accept`), so a request's
tokens never depend on what runs beside it: greedy requests equal plain greedy decoding, and a seeded sampled request
draws the same noise, round after round, wherever it sits.

The engine runs in one thread of its own; requests talk to it through `submit` and the callbacks they carry.

`speculate=False` (`dflash2 serve --plain`) runs the same rows, buffers and batching without drafting (`PlainCore`:
a round is one target forward per row), the reference the server's speed is measured against.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from ..generation.graphs import RoundRunner
from ..generation.loop import MAX_RUNNERS, capacity_for, round_runner_for, rounds_before_read, uses_graphs
from ..generation.round_core import RoundCore, columns_per_round, prefill_width
from ..generation.sampling import Sampling, eos_token_ids, is_any_of, row_warped_logits
from ..generation.stats import truncate_at_eos

ROUNDS_PER_READ = 4  # rounds queued between two host reads of the rows' tokens
PLAIN_ROUNDS_PER_READ = 16  # the same without speculation (one token a round): about what 4 rounds emit at tau 4
WARM_UP_TOKENS = 64  # the new tokens of the prompt a row set's package is checked on (`Engine.switch_to_package`)
SHRINK_AFTER_READS = 3  # reads in a row with the running requests fitting a smaller row set before they move there
DEFAULT_ROWS = 8
DEFAULT_MAX_MODEL_LEN = 1024  # buffer columns of every row: the shipped packages' (a round attends over all of them)
DEFAULT_MAX_QUEUE = 64


class QueueFull(Exception):
    """No room in the waiting queue (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new request (HTTP 503)."""


@dataclass
class GenerationRequest:
    """One request's prompt and settings, and `emit(event)`, called from the engine's thread with
    ("text", delta), ("finish", finish_reason) or ("error", status, message). The first "text" event may be empty."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    emit: object = None
    cancelled: bool = False  # set by the server when the client leaves; the engine frees the row
    # filled in by the engine
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    target_forwards: int = 0
    generator: torch.Generator | None = None  # the request's own randomness (from `seed`)
    queued_at: float = 0.0
    started_at: float | None = None

    def cancel(self) -> None:
        self.cancelled = True


class PlainCore(RoundCore):
    """A `RoundCore` whose rounds do not speculate: each is one target forward of every row's last token, whose next
    token is the argmax (`round`) or a sample of the row's warped distribution (`sampled_round`: the Gumbel-max trick
    with `bonus_noise`, which `draw_noise` fills). The rows, buffers, admission and host reads are the core's, so the
    server runs the same way without its drafter."""

    @torch.no_grad()
    def round(self) -> None:
        logits, _ = self.verify(self.anchor.view(-1, 1))
        self.emit(logits[:, -1].argmax(-1))

    @torch.no_grad()
    def sampled_round(self) -> None:
        logits, _ = self.verify(self.anchor.view(-1, 1))
        warped = row_warped_logits(logits[:, -1], self.temperature, self.top_k, self.top_p)
        self.emit((warped + self.bonus_noise).argmax(-1))

    def emit(self, token: torch.Tensor) -> None:
        """Each live row's next token [b] into its output, then its state advances; finished rows freeze."""
        live = ~self.done
        slots = self.output_length.view(-1, 1).clamp(max=self.output.shape[1] - 1)
        self.output.scatter_(1, slots, token.view(-1, 1))  # a frozen row writes only past its length
        self.rounds.add_(live.long())
        self.output_length.add_(live.long())
        self.done.logical_or_(live & (is_any_of(token, self.eos) | (self.output_length >= self.max_new_tokens)))
        self.start.add_(live.long())
        self.anchor.copy_(torch.where(live, token, self.anchor))

    def store_context(self, features: torch.Tensor, columns: torch.Tensor) -> None:
        """Nothing drafts: only the first prefill, which builds the buffers (row views slice them), runs the drafter."""
        if self.draft_cache.keys[0] is None:
            super().store_context(features, columns)


def plain_runner(target, drafter, batch: int, needed: int, compile: bool | None, graphs: bool) -> RoundRunner:
    """A runner of a `PlainCore`: captured graphs of its eager kernels where rounds are captured (inductor-fused
    first with `compile=True`), plain calls elsewhere."""
    core = PlainCore(target, drafter, batch, capacity_for(needed, graphs), bucketed_prefill=graphs)
    return RoundRunner(core, "compile" if compile is True else "graph" if graphs else "eager", capture=graphs)


class RowSet:
    """One round runner of `batch` rows and what the engine keeps beside it: the request in each row, each row's
    view (`RoundCore.row_view`), which rows sample, and a spare copy of the done flags."""

    def __init__(self, runner, eos: list[int]):
        self.runner, self.core = runner, runner.core
        self.batch = batch = runner.core.batch
        self.core.set_sampling(Sampling(), eos)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=self.core.device)
        runner.prefill(ids, torch.ones_like(ids), 2)  # builds the caches, which the row views slice
        self.views = [self.core.row_view(row) for row in range(batch)]
        self.sampled_rows = torch.zeros(batch, dtype=torch.bool, device=self.core.device)
        self.saved_done = torch.zeros_like(self.core.done)
        self.slots: list[GenerationRequest | None] = [None] * batch
        self.held: list[list[int] | None] = [None] * batch  # a free row's tokens still in its caches (`park`)
        self.asked = [0] * batch  # and how many of them were its last request's prompt
        for row in range(batch):
            self.park(row)

    def park(self, row: int, held: list[int] | None = None, asked: int = 0) -> None:
        """Freeze row `row`. With `held` (the tokens its caches hold, `RoundCore.held_tokens`, of which the first
        `asked` were its request's prompt), its columns stay, so that a next turn of the same conversation can reuse
        them: the rounds it sits through while free write only at and past its `start` (inside the buffers: every
        request leaves `Engine.reserve` columns free past its end). Without, its columns move to the start of the
        buffers."""
        core = self.core
        core.done[row] = True
        self.slots[row], self.held[row], self.asked[row] = None, held, asked
        if held is None:
            core.start[row] = 0
            core.first_column[row] = 0
            core.context_columns[row] = core.offsets

    def free_row(self, prompt_ids: list[int]) -> tuple[int, int]:
        """A free row for a prompt, and how many of its first tokens that row still holds: the row whose conversation
        the prompt continues (it repeats that row's last prompt whole; its answer may tokenize differently in the
        next turn's text), else an empty row, else any free one. A prompt that shares only a beginning with a row (a
        system prompt) is encoded anew: the captured prefill of a whole prompt costs less than an eager encoding of
        its tail (`Engine.admit`)."""
        free = [row for row, slot in enumerate(self.slots) if slot is None]
        best, keep = None, 0
        for row in free:
            held = self.held[row] or []
            limit = min(len(held), len(prompt_ids) - 1)  # the prompt's last token is always encoded
            common = next((i for i in range(limit) if held[i] != prompt_ids[i]), limit)
            if common > keep and common >= self.asked[row]:
                best, keep = row, common
        if best is None:
            best = next((row for row in free if self.held[row] is None), free[0])
        return best, keep

    def requests(self) -> list[GenerationRequest]:
        return [slot for slot in self.slots if slot is not None]

    @property
    def fused(self) -> bool:
        return "fused" in self.runner.kind


class Engine:
    """The rows, the waiting queue and the thread that runs rounds. `start()` starts the thread; `shutdown()` ends every
    running request with an error event (streams) and every waiting one with a 503, then stops the thread.

    A round costs every row of its runner, busy or free, so the engine keeps one runner per batch size 1, 2, 4, ...
    up to `rows` (same buffers' capacity) and decodes on the smallest that holds the running requests: when they
    outgrow it, or have fitted a smaller one for a few reads with nobody waiting, their rows move there
    (`RoundCore.copy_row`) between two rounds. A new request is prefilled by the one-row runner (captured on a GPU)
    and its row copied into the row set that decodes it."""

    def __init__(self, target, tokenizer, drafter, rows: int = DEFAULT_ROWS, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 max_queue: int = DEFAULT_MAX_QUEUE, compile: bool | str | None = None,
                 rounds_per_read: int = ROUNDS_PER_READ, speculate: bool = True):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.rows, self.max_queue, self.rounds_per_read = rows, max_queue, rounds_per_read
        limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.max_model_len = min(max_model_len, limit) if limit else max_model_len
        self.eos = sorted(set(eos_token_ids(target.generation_config)) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
        config = drafter.config
        self.block_size = config.block_size
        self.emitted_per_round = config.block_size if speculate else 1  # at most, per row
        self.graphs = uses_graphs(target, drafter)
        # Buffers of `max_model_len` columns (rounded up as the own loop rounds capacities): a round attends over all
        # of them. A request needs its prompt's prefill width (left-padded to a bucket where prefills are captured),
        # its answer, and room for a round past its last token (`reserve`): a row that finished mid-read sits through
        # the rounds queued behind it before the host frees it.
        self.reserve = columns_per_round(config.block_size, config.tree_nodes) + config.block_size
        # batch sizes 1, 2, 4, ... and `rows`: at most the runners a drafter keeps (the largest of them)
        sizes = sorted({min(1 << power, rows) for power in range(rows.bit_length() + 1)})[-MAX_RUNNERS:]
        if speculate:
            runners = [round_runner_for(target, drafter, size, self.max_model_len, compile, self.graphs,
                                        config.tree_nodes) for size in sizes]
        else:
            self.rounds_per_read = PLAIN_ROUNDS_PER_READ
            runners = [plain_runner(target, drafter, size, self.max_model_len, compile, self.graphs) for size in sizes]
        self.row_sets = [RowSet(runner, self.eos) for runner in runners]
        self.active = self.row_sets[0]
        self.calm_reads = 0  # reads in a row after which the running requests would fit a smaller row set
        warm_up = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"] or self.eos[:1] or [0]
        self.warm_up_ids = torch.tensor([warm_up], dtype=torch.long, device=self.core.device)
        self.waiting: collections.deque[GenerationRequest] = collections.deque()
        self.condition = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.metrics = collections.Counter()  # requests, prompt_tokens, completion_tokens, target_forwards, ...

    @property
    def runner(self):
        """The runner decoding now."""
        return self.active.runner

    @property
    def core(self):
        return self.active.core

    def resize(self, count: int) -> None:
        """Move the running requests to the row set for `count` rows (`row_set_for`; nothing when it is the one in
        use): each request's row is copied over, in order, and the old rows are freed. The smallest row set that holds
        them switches to its fused package first if one is ready for it."""
        self.switch_to_package(self.row_set_for(count, prefer_fused=False))
        target = self.row_set_for(count)
        if target is self.active:
            return
        old = self.active
        for row, (source_row, request) in enumerate((r, q) for r, q in enumerate(old.slots) if q is not None):
            target.core.copy_row(row, old.core, source_row)
            target.sampled_rows[row] = request.sampling.do_sample
            target.slots[row], target.held[row] = request, None
            old.park(source_row)
            self.metrics["row_moves"] += 1
        self.active = target

    def row_set_for(self, count: int, prefer_fused: bool = True) -> RowSet:
        """The row set that decodes `count` requests: the smallest that holds them, unless its round is not fused yet
        (its package still building) and a larger one's is: a fused round of more rows costs less than an unfused
        round of fewer."""
        holding = [rows for rows in self.row_sets if rows.batch >= count]
        return next((rows for rows in holding if rows.fused), holding[0]) if prefer_fused else holding[0]

    def switch_to_package(self, rows: RowSet) -> bool:
        """A row set without requests whose fused package is on disk and not in use yet switches to it now: a short
        prompt prefilled into its rows (the package is checked against the eager round from there), the switch (on a
        GPU seconds: load, check, capture), then its rows freed. Returns whether there was one to switch to."""
        fusion = rows.runner.fusion
        if fusion is None or rows.requests() or not fusion.pending():
            return False
        ids = self.warm_up_ids.expand(rows.batch, -1)
        rows.core.set_sampling(Sampling(), self.eos)
        rows.runner.prefill(ids, torch.ones_like(ids), WARM_UP_TOKENS)
        fusion.poll(rows.runner)
        for row in range(rows.batch):
            rows.park(row)
        return True

    @property
    def fused(self) -> bool:
        return self.active.fused

    @property
    def fused_row_sets(self) -> int:
        """How many of the row sets run the fused round. One whose package is on disk (shipped, built earlier, or its
        background build done) switches when the engine is idle (smallest first, so at start before any request
        arrives), before requests move into it, or at its own next step."""
        return sum(rows.fused for rows in self.row_sets)

    @property
    def capacity(self) -> int:
        return self.core.capacity

    def limit_problem(self, prompt_length: int, max_tokens: int | None) -> str | None:
        """Why a prompt of `prompt_length` tokens and `max_tokens` new ones cannot be served (None: it can)."""
        if prompt_length < 1:
            return "The prompt is empty."
        room = self.max_tokens_for(prompt_length)
        if room < 1:
            return (f"The prompt has {prompt_length} tokens, which leaves no room for an answer in this server's "
                    f"context of {self.max_model_len} tokens (--max-model-len).")
        if max_tokens is not None and max_tokens > room:
            return (f"max_tokens={max_tokens} does not fit: the prompt has {prompt_length} tokens and the context "
                    f"holds {self.max_model_len} (--max-model-len); ask for at most {room}.")
        return None

    def max_tokens_for(self, prompt_length: int) -> int:
        """The most new tokens a prompt of `prompt_length` tokens may ask for."""
        columns = self.capacity - prefill_width(prompt_length, self.block_size, self.graphs) - self.reserve
        return min(self.max_model_len - prompt_length, columns)

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (its tokens come through `request.emit`). QueueFull when the queue is full, ShuttingDown
        once `shutdown` began."""
        with self.condition:
            if self.stopping:
                raise ShuttingDown("The server is shutting down.")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"The server's queue is full ({self.max_queue} waiting requests); retry later.")
            request.queued_at = time.monotonic()
            self.waiting.append(request)
            self.metrics["requests"] += 1
            self.metrics["prompt_tokens"] += len(request.prompt_ids)
            self.condition.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def running_rows(self) -> int:
        return len(self.active.requests())

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop, name="dflash2-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Begin the shutdown without waiting (safe in a signal handler): the thread fails what is left and ends."""
        self.stopping = True

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop()
        with self.condition:
            self.condition.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ------------------------------------------------------------------------------------------ the loop
    def loop(self) -> None:
        try:
            while not self.stopping:
                self.admit_waiting()
                if not self.active.requests():
                    if not self.waiting and any(self.switch_to_package(rows) for rows in self.row_sets):
                        continue  # one row set switched; look at the queue before the next
                    with self.condition:
                        if not self.waiting and not self.stopping:
                            self.condition.wait(0.5)
                    continue
                self.step()
        except Exception as error:  # the engine is dead: every request gets the error, new ones are refused
            self.stopping = True
            self.fail_all(500, f"The engine failed: {type(error).__name__}: {error}")
            raise
        self.fail_all(503, "The server is shutting down.")

    def fail_all(self, status: int, message: str) -> None:
        with self.condition:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for request in waiting + self.active.requests():
            request.emit(("error", status, message))
        for row in range(self.active.batch):
            self.active.park(row)

    def admit_waiting(self) -> None:
        """Prefill waiting requests into free rows, oldest first (growing the row set as they come)."""
        while True:
            with self.condition:
                if not self.waiting:
                    return
                running = len(self.active.requests())
                if running >= self.rows:
                    return
                request = self.waiting.popleft()
            if request.cancelled:
                continue
            self.resize(running + 1)
            self.admit(*self.active.free_row(request.prompt_ids), request)

    def admit(self, row: int, keep: int, request: GenerationRequest) -> None:
        """Prefill `request` into row `row`, encoding only what follows the `keep` tokens the row still holds when
        they fit where they lie."""
        rows, core = self.active, self.core
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        request.generator = torch.Generator(core.device).manual_seed(seed)
        if keep and int(core.first_column[row]) + len(request.prompt_ids) + request.max_tokens + self.reserve > \
                self.capacity:
            keep = 0
        if not keep:  # the one-row runner's prefill (captured on CUDA), then the row copied where it decodes
            single = self.row_sets[0]  # free unless it is the active set (a larger one runs the other requests)
            single.core.set_sampling(request.sampling, self.eos)
            ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=core.device)
            single.runner.prefill(ids, torch.ones_like(ids), request.max_tokens, request.generator)
            if single is not rows:
                core.copy_row(row, single.core, 0)
                single.park(0)
        elif core.admit(row, request.prompt_ids, request.max_tokens, request.sampling, request.generator, keep):
            self.metrics["prompt_tokens_reused"] += keep
        rows.held[row] = None
        rows.sampled_rows[row] = request.sampling.do_sample
        request.started_at = time.monotonic()
        rows.slots[row] = request
        request.emit(("text", ""))  # the request left the queue: a stream may send its first event

    def step(self) -> None:
        """Queue a few rounds, then read every row's tokens once and deliver them; free the rows that finished and
        move the rest to a smaller row set when they fit one."""
        rows = self.active
        active = rows.requests()
        greedy = any(not request.sampling.do_sample for request in active)
        sampled = any(request.sampling.do_sample for request in active)
        remaining = min(request.max_tokens - max(1, len(request.tokens)) for request in active)  # (the prefill's)
        for _ in range(rounds_before_read(remaining, self.emitted_per_round, self.rounds_per_read)):
            if greedy:
                self.run_round(False, frozen=rows.sampled_rows if sampled else None)
            if sampled:
                self.run_round(True, frozen=~rows.sampled_rows if greedy else None)
        # one host read: every row's flags and counts, and the output columns the rounds may have written since the
        # last read (a row emits at most a block per round)
        core, batch = rows.core, rows.batch
        first = min(len(request.tokens) for request in active)
        last = min(core.output.shape[1], max(len(request.tokens) for request in active) + 1
                   + self.rounds_per_read * self.emitted_per_round)
        values = torch.cat([core.done.long(), core.output_length, core.rounds,
                            core.output[:, first: last].flatten()]).tolist()
        done, lengths, rounds = values[:batch], values[batch: 2 * batch], values[2 * batch: 3 * batch]
        width = last - first
        for row, request in enumerate(rows.slots):
            if request is None:
                continue
            read = values[3 * batch + row * width: 3 * batch + (row + 1) * width]
            output = request.tokens[:first] + read[: max(0, lengths[row] - first)]
            request.target_forwards = 1 + rounds[row]
            finish = self.deliver(request, output, bool(done[row]))
            if finish is not None:
                self.release(row, request, finish)
        running = max(1, len(rows.requests()))
        fits_smaller = not self.waiting and self.row_set_for(running).batch < rows.batch
        self.calm_reads = self.calm_reads + 1 if fits_smaller else 0
        if self.calm_reads >= SHRINK_AFTER_READS:  # not at once: a closed-loop client's next request is on its way
            self.resize(running)
            self.calm_reads = 0
        if self.runner.fusion is not None:
            self.runner.fusion.poll(self.runner)  # switches to the fused round once its package is built

    def run_round(self, do_sample: bool, frozen: torch.Tensor | None) -> None:
        """One round of the greedy or the sampled kind; rows in `frozen` sit it out (their `done` is restored)."""
        rows, core = self.active, self.core
        if do_sample:
            for row, request in enumerate(rows.slots):
                if request is not None and request.sampling.do_sample:
                    rows.views[row].draw_noise(request.generator)
        core.do_sample = do_sample
        if frozen is None:
            self.runner()
            return
        rows.saved_done.copy_(core.done)
        core.done.logical_or_(frozen)
        self.runner()
        core.done.copy_(torch.where(frozen, rows.saved_done, core.done))

    def deliver(self, request: GenerationRequest, output: list[int], done: bool) -> str | None:
        """Hand a request its new text; returns why it finished ("stop", "length", "cancelled") or None."""
        if request.cancelled:
            return "cancelled"
        tokens = truncate_at_eos(output, set(self.eos))[: request.max_tokens]
        hit_eos = bool(tokens) and tokens[-1] in self.eos
        request.tokens = tokens
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        finish = None
        if hit_eos or done or len(tokens) >= request.max_tokens:
            finish = "stop" if hit_eos else "length"
        cut = min((index for index in (text.find(stop) for stop in request.stop) if index >= 0), default=None)
        if cut is not None:
            text, finish = text[:cut], "stop"
        ready = len(text)
        if finish is None:
            if text.endswith("\ufffd"):  # a character split over tokens: wait for its last byte
                ready = len(text.rstrip("\ufffd"))
            held = max((len(stop) - 1 for stop in request.stop), default=0)  # a stop string may be starting
            ready = max(request.sent, ready - held)
        request.text = text
        if ready > request.sent:
            request.emit(("text", text[request.sent: ready]))
            request.sent = ready
        return finish

    def release(self, row: int, request: GenerationRequest, finish: str) -> None:
        """The request is over: count it, tell it, free its row (keeping what its caches hold for a next turn)."""
        rows = self.active
        held = None if finish == "cancelled" else rows.views[row].held_tokens([request.prompt_ids])[0]
        rows.park(row, held, len(request.prompt_ids))
        self.metrics["completion_tokens"] += len(request.tokens)
        self.metrics["target_forwards"] += request.target_forwards
        if finish != "cancelled":
            request.emit(("finish", finish))
