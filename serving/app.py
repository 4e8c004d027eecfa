"""The HTTP side: an OpenAI-compatible FastAPI app around an `Engine`.

Endpoints: /v1/chat/completions, /v1/completions (streamed as server-sent events or not), /v1/models, /health,
/metrics (Prometheus text) and /load_model (what `transformers chat` asks before its first message). Errors are JSON in
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx status for every mistake in a request.

Requests are read as plain JSON and checked here field by field (`RequestSettings`): the field names are those of
transformers' own serving schema (`KNOWN_FIELDS`); responses are built with the `openai` package's types, as
transformers' server builds them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import secrets
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..generation.sampling import Sampling
from ..tasks import conversation_ids
from .engine import Engine, GenerationRequest, QueueFull, ShuttingDown

logger = logging.getLogger("dflash2.serve")

# Request fields that a value would change the answer for, which this server does not implement: refused (400)
# unless the value is the default. (name, the values that mean "off")
REFUSED_FIELDS = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}
# Fields read from a request (beyond the prompt and the model)
USED_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop", "seed", "stream",
               "stream_options", "generation_config", "chat_template_kwargs")
MAX_STOP_STRINGS = 4


def known_fields() -> set[str]:
    """Every field of a chat completion request in transformers' serving schema (OpenAI's, plus transformers'
    `generation_config`, `seed` and `chat_template_kwargs`); anything else in a request is ignored."""
    try:
        from transformers.cli.serving.chat_completion import TransformersCompletionCreateParamsStreaming as Params
    except ImportError:  # transformers without this serving module: OpenAI's schema alone
        from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming as Params
    return set(Params.__annotations__) | set(getattr(Params, "__mutable_keys__", ())) | set(USED_FIELDS)


KNOWN_FIELDS = known_fields() | {"prompt"}  # a completion's prompt


class RequestError(Exception):
    """A mistake in a request: the HTTP status, and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_kind(status: int) -> str:
    return {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500 else "server_error")


# ---------------------------------------------------------------------------------------------- request settings
@dataclass
class RequestSettings:
    """What a request asks for, checked: the prompt's token ids and the decoding settings."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def number(body: dict, name: str, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{name} must be {kind} from {low} to {high}; got {value!r}.", param=name)
    return value


def check_refused(body: dict) -> None:
    for name, off in REFUSED_FIELDS.items():
        if name in body and body[name] not in off:
            raise RequestError(400, f"{name}={body[name]!r} is not supported by this server (DFlash 2 speculative "
                                    "decoding of one answer per request); leave it out.", param=name,
                               code="unsupported_field")


def generation_config_fields(body: dict) -> dict:
    """The decoding fields of `generation_config` (a JSON string or object, as `transformers chat` sends), under the
    request's own names; the request's own fields win."""
    config = body.get("generation_config")
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            raise RequestError(400, "generation_config must be a JSON object (or a string holding one).",
                               param="generation_config") from None
    if not isinstance(config, dict):
        raise RequestError(400, "generation_config must be a JSON object.", param="generation_config")
    fields = {name: config[name] for name in ("temperature", "top_p", "top_k", "seed") if name in config}
    if "max_new_tokens" in config:
        fields["max_tokens"] = config["max_new_tokens"]
    if config.get("do_sample") is False:
        fields["temperature"] = 0.0
    return fields


def sampling_of(body: dict, default: Sampling) -> Sampling:
    """temperature 0: greedy; above 0: sampling with the request's temperature, top-k and top-p. A field the request
    leaves out takes the server's default (`dflash2 serve --temperature/--top-k/--top-p`)."""
    temperature = number(body, "temperature", 0.0, 2.0)
    top_p = number(body, "top_p", 0.0, 1.0)
    top_k = number(body, "top_k", -1, 1 << 30, integer=True)
    if top_p is not None and top_p <= 0:
        raise RequestError(400, "top_p must be above 0 (1 keeps every token).", param="top_p")
    if temperature is None:
        temperature = default.temperature if default.do_sample else 0.0
    if temperature == 0:
        return Sampling()
    top_p = default.top_p if top_p is None else top_p
    top_k = default.top_k if top_k is None else max(top_k, 0)  # -1: off, as vLLM reads it
    return Sampling(True, float(temperature), int(top_k), float(top_p))


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them.",
                           param="stop")
    return tuple(stops)


def request_settings(body: dict, prompt_ids: list[int], engine: Engine, default: Sampling,
                     default_max_tokens: int | None) -> RequestSettings:
    check_refused(body)
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        logger.warning("ignoring unknown request fields %s", unknown)
    body = {**generation_config_fields(body), **{k: v for k, v in body.items() if v is not None}}
    max_tokens = number(body, "max_completion_tokens", 1, 1 << 40, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", 1, 1 << 40, integer=True)
    problem = engine.limit_problem(len(prompt_ids), max_tokens)
    if problem:
        raise RequestError(400, problem, param="max_tokens" if "max_tokens" in problem else "messages",
                           code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max_tokens or 1 << 40, engine.max_tokens_for(len(prompt_ids)))
    seed = number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false.", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object.", param="stream_options")
    return RequestSettings(prompt_ids, max_tokens, sampling_of(body, default), seed, stop_strings(body), stream,
                           bool(options.get("include_usage")))


def message_text(message, index: int) -> dict:
    """A chat message as {"role", "content"} with text content (OpenAI's list of text parts joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"messages[{index}] must be an object with a role and a content.", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise RequestError(400, f"messages[{index}]: only text content parts are supported.", param="messages")
        content = "".join(part.get("text", "") for part in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts.",
                           param="messages")
    return {"role": message["role"], "content": content}


def chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects.", param="messages")
    messages = [message_text(message, index) for index, message in enumerate(messages)]
    kwargs = body.get("chat_template_kwargs") or {}
    if kwargs and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return conversation_ids(tokenizer, messages)


def completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= token < len(tokenizer) for token in prompt):
            raise RequestError(400, "prompt holds token ids outside the vocabulary.", param="prompt")
        return list(prompt)
    raise RequestError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request).",
                       param="prompt")


# ---------------------------------------------------------------------------------------------- the app
def create_app(engine: Engine, served_model_name: str, api_key: str | None = None, default: Sampling = Sampling(),
               default_max_tokens: int | None = None):
    """The FastAPI app serving `engine` as model `served_model_name` (requests must name it, or no model). `default`:
    the sampling of a request that sets no temperature (greedy unless given); `default_max_tokens`: the answer's
    limit when a request sets none (else as much as the context holds)."""
    app = FastAPI(title="dflash2 serve")
    created = int(time.time())

    def error_response(error: RequestError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                               code="invalid_api_key", kind="authentication_error")

    async def read_body(request: Request) -> dict:
        check_key(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"The request body is not valid JSON ({error}).") from None
        if not isinstance(body, dict):
            raise RequestError(400, "The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model != served_model_name:
            raise RequestError(404, f"The model {model!r} does not exist here; this server serves "
                                    f"{served_model_name!r}.", param="model", code="model_not_found")
        return body

    @app.exception_handler(RequestError)
    async def request_error(request, error: RequestError):
        return error_response(error)

    @app.exception_handler(404)
    async def not_found(request, error):
        return JSONResponse(error_body(f"No route {request.method} {request.url.path}.", code="not_found"), 404)

    @app.exception_handler(405)
    async def wrong_method(request, error):
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}."), 405)

    @app.get("/health")
    async def health():
        if engine.stopping:  # shutting down, or the engine failed
            return JSONResponse(error_body("The server is shutting down.", "service_unavailable"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "dflash2"}]}

    @app.post("/load_model")
    async def load_model(request: Request):
        await read_body(request)  # the model is checked there
        return StreamingResponse(iter([f"data: {json.dumps({'status': 'ready', 'cached': True})}\n\n"]),
                                 media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    async def respond(http_request, chat: bool):
        body = await read_body(http_request)
        prompt_ids = (chat_prompt if chat else completion_prompt)(body, engine.tokenizer)
        settings = request_settings(body, prompt_ids, engine, default, default_max_tokens)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (the server stopped)
                pass

        request = GenerationRequest(settings.prompt_ids, settings.max_tokens, settings.sampling, settings.seed,
                                    settings.stop, emit=emit)
        try:
            engine.submit(request)
        except QueueFull as error:
            raise RequestError(429, str(error), code="queue_full", kind="rate_limit_error") from None
        except ShuttingDown as error:
            raise RequestError(503, str(error), kind="service_unavailable") from None
        first = await first_event(http_request, request, events)
        if first is None:  # the client left while its request waited
            return JSONResponse(error_body("The client closed the request."), status_code=499)
        if first[0] == "error":
            return JSONResponse(error_body(first[2], error_kind(first[1])), status_code=first[1])
        reply = Reply(request, settings, served_model_name, chat)
        if settings.stream:
            return StreamingResponse(reply.stream(first, events), media_type="text/event-stream")
        event = first
        while event[0] == "text":
            event = await events.get()
        if event[0] == "error":
            return JSONResponse(error_body(event[2], error_kind(event[1])), status_code=event[1])
        return JSONResponse(reply.whole(event[1]))

    return app


async def first_event(http_request, request: GenerationRequest, events: asyncio.Queue):
    """The request's first event (it left the queue, or failed); None when the client disconnected first (the
    request is cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http_request.is_disconnected():
                request.cancel()
                return None


class Reply:
    """A request's answer in OpenAI's chat.completion / text_completion shapes, whole or as stream chunks."""

    def __init__(self, request: GenerationRequest, settings: RequestSettings, model: str, chat: bool):
        self.request, self.settings, self.model, self.chat = request, settings, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self) -> dict:
        prompt, completion = len(self.request.prompt_ids), len(self.request.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self, finish_reason: str) -> dict:
        from openai.types import Completion
        from openai.types.chat import ChatCompletion

        text = self.request.text
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
            reply = ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model,
                                   choices=[choice], usage=self.usage())
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
            reply = Completion(id=self.id, object="text_completion", created=self.created, model=self.model,
                               choices=[choice], usage=self.usage())
        return reply.model_dump(exclude_none=True)

    def chunk(self, text: str | None, finish_reason: str | None = None, usage: bool = False) -> str:
        from openai.types.chat import ChatCompletionChunk

        if usage:
            choices = []
        elif self.chat:
            delta = {"content": text} if text is not None else {}
            choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        else:
            choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason}]
        fields = dict(id=self.id, created=self.created, model=self.model, choices=choices,
                      usage=self.usage() if usage else None)
        if not self.chat:  # openai's Completion type has no chunk of its own (a chunk's finish_reason is null)
            fields = {"object": "text_completion", **{k: v for k, v in fields.items() if v is not None}}
            return f"data: {json.dumps(fields)}\n\n"
        reply = ChatCompletionChunk(object="chat.completion.chunk", **fields)
        return f"data: {reply.model_dump_json(exclude_none=True)}\n\n"

    async def stream(self, first, events: asyncio.Queue):
        """Server-sent events: the role, the text as it comes, the finish reason, the usage when asked, [DONE]; an
        error event when the server stops mid-answer. A client that leaves cancels the request (its row frees)."""
        try:
            if self.chat:
                from openai.types.chat import ChatCompletionChunk

                role = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                           model=self.model, choices=[{"index": 0, "delta": {"role": "assistant",
                                                                                             "content": ""}}])
                yield f"data: {role.model_dump_json(exclude_none=True)}\n\n"
            event = first
            while True:
                if event[0] == "text":
                    if event[1]:
                        yield self.chunk(event[1])
                elif event[0] == "finish":
                    yield self.chunk(None, event[1])
                    if self.settings.include_usage:
                        yield self.chunk(None, usage=True)
                    yield "data: [DONE]\n\n"
                    return
                else:
                    body = error_body(event[2], error_kind(event[1]))
                    body["error"]["code"] = event[1]
                    yield f"data: {json.dumps(body)}\n\n"
                    return
                event = await events.get()
        finally:
            self.request.cancel()  # no effect once the request finished; else its row frees at the next read


def prometheus_text(engine: Engine) -> str:
    """The server's counters and gauges in Prometheus' text format."""
    counts = engine.metrics
    lines = []

    def metric(name: str, kind: str, help_text: str, value) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

    metric("dflash2_requests_total", "counter", "Requests accepted into the queue.", counts["requests"])
    metric("dflash2_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", counts["prompt_tokens"])
    metric("dflash2_prompt_tokens_reused_total", "counter", "Prompt tokens not encoded again: a later turn of a "
           "conversation whose row still held them.", counts["prompt_tokens_reused"])
    metric("dflash2_completion_tokens_total", "counter", "Tokens answered by finished requests.",
           counts["completion_tokens"])
    metric("dflash2_target_forwards_total", "counter", "Target forwards per request row (its prefill and every "
           "round it took part in) of finished requests; tau = completion tokens / target forwards.",
           counts["target_forwards"])
    tau = counts["completion_tokens"] / counts["target_forwards"] if counts["target_forwards"] else 0.0
    metric("dflash2_tau", "gauge", "Tokens per target forward over finished requests.", f"{tau:.4f}")
    metric("dflash2_queue_depth", "gauge", "Requests waiting for a row.", engine.queue_depth)
    metric("dflash2_running_rows", "gauge", "Rows decoding a request.", engine.running_rows)
    metric("dflash2_rows", "gauge", "Rows of the round runner in use (1, 2, 4, ... up to --rows, as requests come "
           "and go).", engine.active.batch)
    metric("dflash2_max_rows", "gauge", "Requests decoded at once at most (--rows).", engine.rows)
    metric("dflash2_row_moves_total", "counter", "Requests moved to a runner of another batch size.",
           counts["row_moves"])
    metric("dflash2_fused_round", "gauge", "1 when the rounds run the inductor-fused round.", int(engine.fused))
    metric("dflash2_row_sets", "gauge", "Round runners of 1, 2, 4, ... rows the server keeps.", len(engine.row_sets))
    metric("dflash2_fused_row_sets", "gauge", "Round runners that run the inductor-fused round (each switches once its "
           "package is on disk: while the server is idle, or before requests move into it).", engine.fused_row_sets)
    lines.append(f'dflash2_round_info{{kind="{engine.runner.kind}"}} 1')
    return "\n".join(lines) + "\n"


def run_server(app, engine: Engine, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until SIGINT or SIGTERM. On the signal the engine stops at once: a stream in progress
    ends with an error event, a waiting request gets a 503; uvicorn then waits up to `GRACEFUL_SECONDS` for the
    connections to close, and the process exits normally (status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # not re-raised after shutdown, unlike uvicorn's own: the exit status is 0
            engine.stop()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SECONDS)
    engine.start()
    try:
        Server(config).run()
    finally:
        engine.shutdown()


GRACEFUL_SECONDS = 5
