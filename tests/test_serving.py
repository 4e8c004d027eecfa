"""`dflash2 serve`: a real uvicorn server on 127.0.0.1 (a free port) driven by the official `openai` client.

Greedy answers (streamed or not) equal plain greedy `generate` on the same chat template; concurrent requests each get
their solo answer; a seeded sampled request is the same alone and among others; /metrics counts tokens and target
forwards (tau > 1.3 with the shipped pair); every bad request gets its 4xx and the server keeps answering; a client that
leaves mid-stream frees its row; SIGTERM ends streams with an error event, waiting requests with a 503, and the
process with status 0. The logic runs on a tiny random target (with the real tokenizer); tau on the shipped pair.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package brings: httpx2 in its newer releases, httpx before
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from dflash2.generation import DFlash2Drafter, load_target  # noqa: E402
from dflash2.serving.app import create_app  # noqa: E402
from dflash2.serving.engine import Engine  # noqa: E402
from dflash2.tasks import conversation_ids  # noqa: E402
from helpers import tiny_drafter, tiny_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "SmolLM2-135M-Instruct-DFlash2"
KEY = "test-key"
MODEL = "tiny"
PROMPTS = ["Name a colour.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French.",
           "List three fruits.", "Why is the sky blue?", "Count to five.", "What is Python?"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RunningServer:
    """uvicorn serving an engine from a thread of this process, on 127.0.0.1."""

    def __init__(self, engine: Engine, name: str, api_key: str | None = None):
        import uvicorn

        self.engine, self.port = engine, free_port()
        app = create_app(engine, name, api_key=api_key)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        engine.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for_health(self.url)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0, timeout=120)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def wait_for_health(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"no server answered {url}/health within {seconds} s")


@pytest.fixture(scope="module")
def shipped():
    drafter = DFlash2Drafter.from_pretrained(SHIPPED, dtype=torch.float32)
    target, tokenizer = load_target(drafter.config, dtype=torch.float32)
    drafter.attach(target)
    return target, tokenizer, drafter


def tiny_pair(tokenizer):
    """A tiny random target over the real tokenizer's vocabulary (its EOS the tokenizer's), and a tiny drafter."""
    target = tiny_target(vocab=len(tokenizer))
    target.config.max_position_embeddings = 1024
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    drafter = tiny_drafter(target)
    drafter.attach(target)
    return target, drafter


@pytest.fixture(scope="module")
def tokenizer():
    """The shipped pair's tokenizer and chat template, from the drafter folder (no target loaded)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny server of 4 rows (so 8 clients queue) with an API key."""
    target, drafter = tiny_pair(tokenizer)
    server = RunningServer(Engine(target, tokenizer, drafter, rows=4, max_model_len=512), MODEL, api_key=KEY)
    yield server, target, tokenizer
    server.close()


def plain_greedy(target, tokenizer, messages, max_tokens) -> str:
    ids = torch.tensor([conversation_ids(tokenizer, messages)])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat(client, prompt, max_tokens, model=MODEL, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, **kwargs)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


# ---------------------------------------------------------------------------------------------- the shipped pair
def test_shipped_pair_greedy_streamed_and_whole_equal_plain_greedy_with_tau_above_1_3(shipped):
    target, tokenizer, drafter = shipped
    server = RunningServer(Engine(target, tokenizer, drafter, rows=1, max_model_len=512), "smol")
    try:
        whole_prompt, streamed_prompt = PROMPTS[1], PROMPTS[5]
        expected = plain_greedy(target, tokenizer, [{"role": "user", "content": whole_prompt}], 32)
        whole = chat(server.client, whole_prompt, 32, model="smol", temperature=0)
        assert whole.choices[0].message.content == expected
        prompt_ids = conversation_ids(tokenizer, [{"role": "user", "content": whole_prompt}])
        assert whole.usage.prompt_tokens == len(prompt_ids) and 0 < whole.usage.completion_tokens <= 32
        expected = plain_greedy(target, tokenizer, [{"role": "user", "content": streamed_prompt}], 32)
        stream = chat(server.client, streamed_prompt, 32, model="smol", temperature=0, stream=True,
                      stream_options={"include_usage": True})
        assert streamed_text(stream) == (expected, "length")
        tokens = metric(server.url, "dflash2_completion_tokens_total")
        forwards = metric(server.url, "dflash2_target_forwards_total")
        assert tokens > 0 and tokens / forwards > 1.3, (tokens, forwards)
        assert metric(server.url, "dflash2_requests_total") == 2
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- continuous batching
def test_eight_concurrent_clients_each_get_their_solo_greedy_answer(tiny):
    server, target, tokenizer = tiny
    limits = [4 + 2 * i for i in range(len(PROMPTS))]
    expected = [plain_greedy(target, tokenizer, [{"role": "user", "content": p}], n) for p, n in zip(PROMPTS, limits)]
    answers = [None] * len(PROMPTS)

    def ask(index):
        reply = chat(server.client, PROMPTS[index], limits[index], temperature=0)
        choice = reply.choices[0]
        answers[index] = (choice.message.content, reply.usage.completion_tokens, choice.finish_reason)

    moves = metric(server.url, "dflash2_row_moves_total")
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [answer[0] for answer in answers] == expected
    assert metric(server.url, "dflash2_row_moves_total") > moves  # rows moved between batch sizes meanwhile
    assert [answer[1] for answer in answers] == limits  # a random target rarely says EOS: each stops at its limit
    assert {answer[2] for answer in answers} == {"length"}


def test_seeded_sampled_request_is_the_same_alone_and_among_seven_others(tiny):
    server, target, tokenizer = tiny
    settings = dict(temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 50})
    alone = chat(server.client, "Tell me a story.", 16, **settings).choices[0].message.content
    other = chat(server.client, "Tell me a story.", 16, **{**settings, "seed": 99}).choices[0].message.content
    assert alone != other  # the seed matters
    answers = {}

    def ask(index):
        if index == 3:
            answers[index] = chat(server.client, "Tell me a story.", 16, **settings).choices[0].message.content
        elif index % 2:  # greedy and sampled requests beside it
            answers[index] = chat(server.client, PROMPTS[index], 10 + index, temperature=0).choices[0].message.content
        else:
            answers[index] = chat(server.client, PROMPTS[index], 10 + index, temperature=1.0,
                                  seed=index).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert answers[3] == alone
    assert answers[1] == plain_greedy(target, tokenizer, [{"role": "user", "content": PROMPTS[1]}], 11)


def test_the_server_without_speculation_answers_as_plain_greedy_one_forward_per_token(tokenizer):
    """`dflash2 serve --plain` (`speculate=False`): the same rows and batching, one target forward per token. Six
    concurrent greedy clients get their plain greedy answers, a seeded sampled request is the same alone and beside
    them, and tau is exactly 1."""
    target, drafter = tiny_pair(tokenizer)
    server = RunningServer(Engine(target, tokenizer, drafter, rows=4, max_model_len=512, speculate=False), MODEL)
    try:
        settings = dict(temperature=0.9, top_p=0.95, seed=7)
        alone = chat(server.client, "Tell me a story.", 12, **settings).choices[0].message.content
        limits = [5 + 3 * i for i in range(6)]
        expected = [plain_greedy(target, tokenizer, [{"role": "user", "content": p}], n)
                    for p, n in zip(PROMPTS, limits)]
        answers = {}

        def ask(index):
            if index == len(limits):
                answers[index] = chat(server.client, "Tell me a story.", 12, **settings).choices[0].message.content
            else:
                answers[index] = chat(server.client, PROMPTS[index], limits[index],
                                      temperature=0).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(limits) + 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [answers[i] for i in range(len(limits))] == expected
        assert answers[len(limits)] == alone
        assert metric(server.url, "dflash2_completion_tokens_total") == metric(server.url,
                                                                              "dflash2_target_forwards_total")
    finally:
        server.close()


def test_rounds_queued_before_a_read_stop_at_the_nearest_token_limit(tokenizer):
    """Before each host read the engine queues only the rounds the nearest token limit can use (the own loop's rule,
    `rounds_before_read`): a lone request runs no round past its last token, with and without speculation."""
    from dflash2.serving.engine import GenerationRequest

    target, drafter = tiny_pair(tokenizer)
    for speculate, max_tokens in ((True, 1), (True, 4), (True, 9), (False, 6)):
        engine = Engine(target, tokenizer, drafter, rows=1, max_model_len=512, speculate=speculate)
        rounds, run_round = [], engine.run_round
        engine.run_round = lambda *args, **kwargs: (rounds.append(1), run_round(*args, **kwargs))
        done = threading.Event()
        request = GenerationRequest(prompt_ids=conversation_ids(tokenizer, [{"role": "user", "content": PROMPTS[0]}]),
                                    max_tokens=max_tokens, emit=lambda event: event[0] == "finish" and done.set())
        engine.start()
        try:
            engine.submit(request)
            assert done.wait(60)
        finally:
            engine.shutdown()
        assert len(request.tokens) == max_tokens or request.tokens[-1] in engine.eos
        assert len(rounds) == request.target_forwards - 1  # every round queued was one the request took part in


def test_a_later_turn_reuses_the_rows_cache_and_equals_plain_greedy_on_the_whole_conversation(tiny):
    server, target, tokenizer = tiny
    conversation = [{"role": "user", "content": "Describe the sea."}]
    for turn, follow_up in enumerate(["Shorter, please.", "Now as a list.", "Thanks."]):
        expected = plain_greedy(target, tokenizer, conversation, 12)
        reused = metric(server.url, "dflash2_prompt_tokens_reused_total")
        reply = server.client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == expected
        if turn:  # the row of the turn before still held the conversation up to its answer
            assert metric(server.url, "dflash2_prompt_tokens_reused_total") - reused >= len(
                conversation_ids(tokenizer, conversation[:1]))
        conversation += [{"role": "assistant", "content": expected}, {"role": "user", "content": follow_up}]


def test_a_new_conversation_sharing_only_the_system_prompt_with_a_free_row_is_prefilled_whole(tokenizer):
    """A free row's held tokens are reused only for a prompt that repeats that row's last prompt whole (a next turn);
    one that shares only the chat template's system prompt is prefilled anew (on a GPU: the one-row runner's captured
    prefill rather than an eager encoding of its tail), and both answers equal plain greedy."""
    from dflash2.serving.engine import GenerationRequest

    target, drafter = tiny_pair(tokenizer)
    engine = Engine(target, tokenizer, drafter, rows=1, max_model_len=512)
    engine.start()
    try:
        for prompt in PROMPTS[:2]:
            messages = [{"role": "user", "content": prompt}]
            ids = conversation_ids(tokenizer, messages)
            done = threading.Event()
            request = GenerationRequest(prompt_ids=ids, max_tokens=10, emit=lambda e: e[0] != "text" and done.set())
            engine.submit(request)
            assert done.wait(60)
            assert tokenizer.decode(request.tokens, skip_special_tokens=True) == plain_greedy(
                target, tokenizer, messages, 10)
        first, second = (conversation_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[:2])
        assert first[:8] == second[:8]  # the template's system prompt: a shared beginning the row still held
        assert engine.metrics["prompt_tokens_reused"] == 0
    finally:
        engine.shutdown()


def test_row_sets_switch_to_their_fused_packages_while_idle_and_a_fused_set_is_preferred(tokenizer, tmp_path,
                                                                                         monkeypatch):
    """Packages ready on disk: the row sets switch to them with no request (the idle engine, smallest first), and
    answers equal plain greedy. While the smallest set that holds the requests is unfused and a larger one is fused,
    the requests decode on the larger; moving there switches the smaller first when its package is ready."""
    from dflash2.serving.engine import GenerationRequest

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    target, drafter = tiny_pair(tokenizer)
    engine = Engine(target, tokenizer, drafter, rows=2, max_model_len=256, compile="background")
    for rows in engine.row_sets:  # a child builds each row set's package
        assert rows.runner.fusion.state == "building"
        rows.runner.fusion.wait(600)
        assert rows.runner.fusion.process.returncode == 0, rows.runner.fusion.log.read_text()[-2000:]
    single, double = engine.row_sets
    assert engine.switch_to_package(double) and double.fused and not single.fused
    assert engine.row_set_for(1) is double  # the fused set of two rows rather than the unfused one of one
    engine.resize(1)  # the one-row set's package is ready: it switches before the requests would move
    assert single.fused and engine.active is single and engine.fused_row_sets == 2

    drafter.release()  # as in a new process: no runners, the packages on disk
    engine = Engine(target, tokenizer, drafter, rows=2, max_model_len=256, compile="background")
    assert engine.fused_row_sets == 0 and all(rows.runner.fusion.process is None for rows in engine.row_sets)
    engine.start()
    try:
        deadline = time.monotonic() + 120
        while engine.fused_row_sets < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.fused_row_sets == 2 and engine.metrics["requests"] == 0
        jobs = []
        for prompt, limit in zip(PROMPTS[:2], (9, 14)):
            done = threading.Event()
            request = GenerationRequest(prompt_ids=conversation_ids(tokenizer, [{"role": "user", "content": prompt}]),
                                        max_tokens=limit, emit=lambda e, done=done: e[0] != "text" and done.set())
            engine.submit(request)
            jobs.append((request, done, prompt, limit))
        for request, done, prompt, limit in jobs:
            assert done.wait(120)
            assert tokenizer.decode(request.tokens, skip_special_tokens=True) == plain_greedy(
                target, tokenizer, [{"role": "user", "content": prompt}], limit)
    finally:
        engine.shutdown()


def test_rows_move_to_a_smaller_row_set_only_after_three_calm_reads(tokenizer):
    """When the running requests come to fit a smaller row set and nobody waits, they move there after three host
    reads in a row (a closed-loop client's next request is often on its way), not at the first."""
    from dflash2.serving.engine import GenerationRequest

    target, drafter = tiny_pair(tokenizer)
    engine = Engine(target, tokenizer, drafter, rows=2, max_model_len=512, rounds_per_read=1)
    seen, step = [], engine.step
    engine.step = lambda: (step(), seen.append((engine.active.batch, len(engine.active.requests()))))
    jobs = []
    for prompt, limit in zip(PROMPTS[:2], (60, 2)):
        done = threading.Event()
        jobs.append((GenerationRequest(prompt_ids=conversation_ids(tokenizer, [{"role": "user", "content": prompt}]),
                                       max_tokens=limit, emit=lambda e, done=done: e[0] != "text" and done.set()), done))
    for request, _ in jobs:
        engine.submit(request)
    engine.start()
    try:
        assert all(done.wait(120) for _, done in jobs)
    finally:
        engine.shutdown()
    # (active batch, running requests) after each step; the step of the move records the one-row set already
    moved = next(index for index, (batch, _) in enumerate(seen) if batch == 1)
    alone = [index for index, (batch, running) in enumerate(seen[:moved]) if batch == 2 and running == 1]
    assert len(alone) == 2 and alone[-1] == moved - 1  # two calm reads in a row, the move at the third
    assert engine.metrics["row_moves"] >= 2  # into the two-row set, then back to the one-row set


def test_completions_stop_strings_models_and_metrics(tiny):
    server, target, tokenizer = tiny
    prompt = "Once upon a time"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 20
    stop = expected[len(expected) // 2: len(expected) // 2 + 3]
    cut = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True) if chunk.choices)
    assert streamed == cut.choices[0].text
    assert [model.id for model in server.client.models.list().data] == [MODEL]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("dflash2_requests_total", "dflash2_prompt_tokens_total", "dflash2_completion_tokens_total",
                 "dflash2_target_forwards_total", "dflash2_queue_depth", "dflash2_running_rows",
                 "dflash2_fused_round"):
        assert f"\n{name} " in text
    assert metric(server.url, "dflash2_fused_round") == 0  # a CPU runs eager rounds
    assert metric(server.url, "dflash2_fused_row_sets") == 0
    assert metric(server.url, "dflash2_row_sets") == 3  # 4 rows: runners of 1, 2 and 4


# ---------------------------------------------------------------------------------------------- failures
def test_every_bad_request_gets_its_4xx_and_the_next_good_one_is_answered(tiny):
    server, target, tokenizer = tiny
    url, headers = f"{server.url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    good = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    long_prompt = "word " * 600
    bad = [
        (b"{not json", headers, 400),
        ({**good, "model": "gpt-4"}, headers, 404),
        ({**good, "messages": []}, headers, 400),
        ({**good, "max_tokens": 0}, headers, 400),
        ({**good, "max_tokens": 100000}, headers, 400),
        ({**good, "messages": [{"role": "user", "content": long_prompt}]}, headers, 400),
        ({**good, "n": 2}, headers, 400),
        ({**good, "logprobs": True}, headers, 400),
        ({**good, "tools": [{"type": "function", "function": {"name": "f"}}]}, headers, 400),
        ({**good, "response_format": {"type": "json_object"}}, headers, 400),
        ({**good, "temperature": -1}, headers, 400),
        (good, {"Authorization": "Bearer wrong"}, 401),
        (good, {}, 401),
    ]
    for body, request_headers, status in bad:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(url, content=content, headers={**request_headers, "Content-Type": "application/json"},
                              timeout=60)
        assert response.status_code == status, (body if not isinstance(body, bytes) else body, response.text)
        error = response.json()["error"]
        assert error["message"] and "type" in error and "code" in error
        reply = httpx.post(url, json=good, headers=headers, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
    # what `transformers chat` sends: generation_config as a JSON string, stream_options, /load_model first
    loaded = httpx.post(f"{server.url}/load_model", json={"model": MODEL}, headers=headers)
    assert loaded.status_code == 200 and '"ready"' in loaded.text
    config = json.dumps({"max_new_tokens": 5, "do_sample": False})
    reply = chat(server.client, "Hi", None, extra_body={"generation_config": config})
    assert reply.usage.completion_tokens == 5


def test_a_client_that_leaves_mid_stream_frees_its_row_for_the_queued_request(tokenizer):
    target, drafter = tiny_pair(tokenizer)
    server = RunningServer(Engine(target, tokenizer, drafter, rows=1, max_model_len=512, max_queue=1), MODEL)
    try:
        stream = chat(server.client, "Tell me everything.", 400, temperature=0, stream=True)
        next(iter(stream))
        started = {}

        def queued():
            for chunk in chat(server.client, "Hi", 3, temperature=0, stream=True):
                started.setdefault("at", time.monotonic())

        waiting = threading.Thread(target=queued)
        waiting.start()
        deadline = time.monotonic() + 10
        while metric(server.url, "dflash2_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(server.url, "dflash2_running_rows") == 1
        with pytest.raises(openai.RateLimitError):  # one row busy, the queue of one full
            chat(server.client, "Hi", 3, temperature=0)
        assert "at" not in started
        left = time.monotonic()
        stream.close()
        waiting.join(30)
        assert 0 < started["at"] - left < 2.0  # it started once the row was free, at once
    finally:
        server.close()


SERVER_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny_drafter, tiny_target
from dflash2.serving.app import create_app, run_server
from dflash2.serving.engine import Engine
from transformers import PreTrainedTokenizerFast
tokenizer = PreTrainedTokenizerFast.from_pretrained({tokenizer!r})
target = tiny_target(vocab=len(tokenizer))
target.generation_config.eos_token_id = tokenizer.eos_token_id
drafter = tiny_drafter(target)
drafter.attach(target)
engine = Engine(target, tokenizer, drafter, rows=1, max_model_len=512)
run_server(create_app(engine, "tiny"), engine, "127.0.0.1", {port}, log_level="warning")
"""


def test_sigterm_ends_streams_with_an_error_event_waiting_requests_with_503_and_exits_0():
    port = free_port()
    script = SERVER_SCRIPT.format(tests=str(ROOT / "tests"), tokenizer=str(SHIPPED), port=port)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for_health(f"http://127.0.0.1:{port}", 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        stream = chat(client, "Tell me everything.", 400, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        outcome = {}

        def queued():
            try:
                chat(client, "Hi", 3, temperature=0)
            except openai.APIStatusError as error:
                outcome["status"] = error.status_code

        waiting = threading.Thread(target=queued)
        waiting.start()
        time.sleep(0.5)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        waiting.join(15)
        assert outcome.get("status") == 503
        assert process.wait(10) == 0
        assert time.monotonic() - signalled < 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_bench_drives_a_server_closed_loop_and_poisson(tiny, tmp_path):
    from dflash2.serving.bench import main

    server = tiny[0]
    report = main(["--url", f"{server.url}/v1", "--api-key", KEY, "--clients", "1", "3", "--rates", "50",
                   "--requests", "4", "--max-tokens", "6", "--max-seconds", "60", "--out", str(tmp_path / "r.json")])
    assert [setup.get("clients", setup.get("rate")) for setup in report["setups"]] == [1, 3, 50]
    for setup in report["setups"]:
        assert setup["requests"] == 4 and setup["errors"] == 0 and setup["completion_tokens"] == 24
        assert setup["tokens_per_second"] > 0 and 0 < setup["ttft_p50"] <= setup["latency_p95"]
        assert setup["tau"] >= 1.0  # each forward emits a token at least (the random drafter: about 1)
    assert json.loads((tmp_path / "r.json").read_text())["model"] == MODEL
    with pytest.raises(SystemExit, match="127.0.0.1"):
        main(["--url", "http://example.com:8000"])
