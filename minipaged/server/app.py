"""The FastAPI app: OpenAI's routes over one ``EngineLoop``.

Owns HTTP: reading bodies within a size limit, routing, server-sent events, noticing a client
that went away (its request is aborted), and turning every error into an OpenAI-style JSON body
with a 4xx (or a bare 500 without a traceback). It never calls the engine: it talks to the
engine loop only, through ``submit`` / ``abort`` and each request's event queue.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true``), ``GET /health``, ``GET /metrics``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from .engine_loop import EngineLoop, Event, samples_of
from .metrics import ServerMetrics
from .routes import add_generate_routes
from .security import Guard, unencodable

log = logging.getLogger("minipaged.server")


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (the engine's are an EngineConfig, passed to the engine factory).

    ``model_names``: the names a request's ``model`` may use; the first is listed first.
    ``max_waiting_requests``: past this many waiting, a new request gets 503.
    ``max_request_bytes``: a larger body gets 413. ``max_prompts``: a batch of more prompts gets 400.
    ``drain_timeout_s``: on shutdown, how long in-flight requests may run before they are aborted.
    """

    model_names: tuple[str, ...] = ("minipaged",)
    max_waiting_requests: int = 512
    max_request_bytes: int = 1 << 20
    max_prompts: int = 64
    drain_timeout_s: float = 10.0
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    # security.Guard: a key every /v1 route needs as "Authorization: Bearer <key>" (None: none), and
    # the Host names answered (None: any; "loopback": this machine's own, as `serve` sets on 127.0.0.1)
    api_key: str | None = None
    allowed_hosts: Any = None
    log_requests: bool = False  # log each request's id, prompt count and sampling parameters (info level)
    # vLLM's --trust-request-chat-template: a chat request may bring its own Jinja template
    # (rendered sandboxed); off, such a request gets 400, as in vLLM
    trust_request_chat_template: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:<id>" unless a request says otherwise
    return_tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(f"model_names must be non-empty strings, got {self.model_names!r}")
        for name in ("max_waiting_requests", "max_request_bytes", "max_prompts", "default_completion_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key must be a non-empty string, or None for no key")


class _Disconnected(Exception):
    pass


class _SafeJSON(JSONResponse):
    """A JSON body that renders whatever a message quotes (a lone surrogate too) as ASCII escapes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error_response(e: P.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return _SafeJSON(e.body(), status_code=e.status, headers=headers)


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise P.APIError(413, f"the request body has {int(length)} bytes, more than the limit of {limit}: send a shorter prompt", "invalid_request_error", None, "request_too_large")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise P.APIError(413, f"the request body is over the limit of {limit} bytes: send a shorter prompt", "invalid_request_error", None, "request_too_large")
    if not buf:
        raise P.bad_request("the request has no body: send a JSON object")
    try:
        data = json.loads(buf)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise P.bad_request(f"the body is not valid JSON ({str(e)[:120]}): send a JSON object") from None
    bad = unencodable(data)
    if bad is not None:  # "\udcff" is valid JSON but no text: say where, never fail later with a 500
        raise P.bad_request(f"{bad}, which cannot be encoded as UTF-8: send whole surrogate pairs or UTF-8 text", None, "invalid_string")
    return data


def create_app(engine_factory: Callable[[], Any] | EngineLoop, config: ServerConfig | None = None) -> FastAPI:
    """The app. ``engine_factory()`` builds the engine on the engine thread when the app starts;
    or pass an ``EngineLoop`` (started or not) to share one."""
    cfg = config or ServerConfig()
    metrics = ServerMetrics(cfg.model_names[0])
    if isinstance(engine_factory, EngineLoop):
        loop_ = engine_factory
        loop_.metrics = loop_.metrics or metrics
        metrics = loop_.metrics
    else:
        loop_ = EngineLoop(engine_factory, cfg.max_waiting_requests, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(loop_.start)
        yield
        await asyncio.to_thread(loop_.shutdown, cfg.drain_timeout_s)

    app = FastAPI(title="minipaged", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = cfg
    app.add_middleware(Guard, api_key=cfg.api_key, allowed_hosts=cfg.allowed_hosts)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        msg = f"no route {request.method} {request.url.path}: see GET /v1/models, POST /v1/completions, POST /v1/chat/completions" if e.status_code in (404, 405) else str(e.detail)
        return _error_response(P.APIError(e.status_code, msg, kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(P.bad_request(f"invalid request: {str(e)[:300]}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error_response(P.internal_error(f"the server failed on this request ({type(e).__name__}); its log has the details"))

    @app.get("/health")
    async def health():
        if loop_.accepting:
            return JSONResponse({"status": "ok"})
        why = "shutting down" if loop_.alive else f"engine loop stopped: {loop_.fatal_error}"
        return JSONResponse({"status": why}, status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    def _model_card(name: str, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "minipaged", "root": cfg.model_names[0],
                "parent": None, "max_model_len": loop_.max_model_len}

    @app.get("/v1/models")
    async def models():
        created = P.now()
        return {"object": "list", "data": [_model_card(n, created) for n in cfg.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        if model_id not in cfg.model_names:
            raise P.model_not_found(model_id, list(cfg.model_names))
        return _model_card(model_id, P.now())

    async def _generate(path: str, kind: str, request: Request):  # POST /v1/completions, /v1/chat/completions
        arrival = time.perf_counter()
        data = await _read_json(request, cfg.max_request_bytes)
        req = P.parse_request(kind, data)
        if req.model is not None and req.model not in cfg.model_names:
            raise P.model_not_found(req.model, list(cfg.model_names))
        model = req.model or cfg.model_names[0]
        if kind == "chat" and req.request_template() is not None and not cfg.trust_request_chat_template:
            raise P.untrusted_chat_template()
        default_max = cfg.default_completion_max_tokens if kind == "completion" else max(1, loop_.max_model_len)
        params = P.sampling_params_of(req, default_max)
        prompts = P.prompts_of(req)
        if len(prompts) > cfg.max_prompts:
            raise P.bad_request(f"{len(prompts)} prompts in one request, more than {cfg.max_prompts}: split the batch", "prompt")
        rid = P.new_id(kind)
        if cfg.log_requests:
            log.info("request %s: %s, %d prompt(s), %s", rid, kind, len(prompts), params)
        sub_ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        auto = kind == "chat" and req.max_tokens is None and req.max_completion_tokens is None
        for sid, prompt in zip(sub_ids, prompts):
            loop_.submit(sid, prompt, params, events, aio, arrival, auto_max_tokens=auto)
        call = _Call(kind, rid, model, P.now(), sub_ids, events, loop_, n=getattr(params, "n", 1))
        if getattr(params, "logprobs", None) is not None:
            call.top_logprobs = params.logprobs
        as_ids = req.return_tokens_as_token_ids
        call.tokens_as_ids = cfg.return_tokens_as_token_ids if as_ids is None else as_ids
        if kind == "completion" and req.echo:
            call.echo = {sid: _prompt_text(loop_, p) for sid, p in zip(sub_ids, prompts)}
        call.watch(request)  # a hang-up is noticed the moment it happens, however busy the request is
        handed_off = False
        try:
            await call.wait_first(request)  # errors (bad prompt, too long, overloaded) before any header
            if req.stream:  # from here the streaming response listens for the hang-up, and aborts, itself
                call.unwatch()
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                call.continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
                handed_off = True
                return _EventStream(call, include_usage)
            return JSONResponse(await call.collect(request))
        except _Disconnected:
            return Response(status_code=499)
        finally:
            call.unwatch(check=False)
            if not handed_off:
                call.abort_unfinished()

    add_generate_routes(app, _generate)
    return app


def _prompt_text(loop_: EngineLoop, prompt: Any) -> str:
    """A completion prompt's text, for ``echo``: the string itself, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    tok = getattr(loop_.engine, "tokenizer", None)
    return tok.decode(list(prompt)) if tok is not None else ""


class _EventStream(StreamingResponse):
    """Server-sent events of one call; however the response ends (done, client gone, cancelled),
    the call's unfinished engine requests are aborted at once, not when the generator is collected."""

    def __init__(self, call: "_Call", include_usage: bool) -> None:
        super().__init__(call.stream(include_usage), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.abort_unfinished()


class _Call:
    """One HTTP request's engine requests (one per prompt of a batch) and their event queue.

    Choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's order for a batch with ``n``).
    """

    def __init__(self, kind: str, rid: str, model: str, created: int, sub_ids: list[str], events: asyncio.Queue,
                 loop_: EngineLoop, n: int = 1) -> None:
        self.kind, self.rid, self.model, self.created, self.n = kind, rid, model, created, n
        self.index = {sid: i for i, sid in enumerate(sub_ids)}
        self.events, self.loop_ = events, loop_
        self.unfinished = set(sub_ids)
        self.buffered: list[Event] = []
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}  # prompt tokens the prefix cache gave (usage.prompt_tokens_details)
        self.completion_tokens: dict[str, int] = {}
        self.top_logprobs: int | None = None  # logprobs asked for: this many top tokens per position
        self.echo: dict[str, str] | None = None  # completions with echo: each prompt's text
        self.continuous_usage = False  # stream_options.continuous_usage_stats: usage in every chunk
        self.tokens_as_ids = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
        self.logprobs_sent: dict[int, int] = {}  # choice -> positions of logprobs already streamed
        self.text_sent: dict[int, int] = {}  # choice -> characters already streamed (text_offset)
        self._watcher: asyncio.Future | None = None
        self.gone = False  # the client hung up

    def watch(self, request: Request) -> None:
        """Watch for the client's hang-up (``http.disconnect``) until ``unwatch``."""
        async def wait_gone() -> None:
            while (await request.receive()).get("type") != "http.disconnect":
                pass

        self._watcher = asyncio.ensure_future(wait_gone())

    def unwatch(self, check: bool = True) -> None:
        """Stop watching; with ``check``, raise _Disconnected if the client already hung up."""
        w, self._watcher = self._watcher, None
        if w is None:
            return
        if w.done() and not w.cancelled() and w.exception() is None:
            self.gone = True
            if check:
                raise _Disconnected()
        w.cancel()

    def _choice(self, request_id: str, sample: int) -> int:
        return self.index[request_id] * self.n + sample

    async def _next(self, request: Request | None) -> Event:
        """The next event; while none comes, check every second whether the client is still there."""
        get = asyncio.ensure_future(self.events.get())
        watcher = self._watcher if request is not None else None
        try:
            while True:
                done, _ = await asyncio.wait({get} | ({watcher} if watcher is not None else set()), timeout=1.0,
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher is not None and watcher.done():
                    self.gone = True
                    raise _Disconnected()
                if get in done:
                    return get.result()
                if request is not None and watcher is None and await request.is_disconnected():
                    self.gone = True
                    raise _Disconnected()
        finally:
            if not get.done():
                get.cancel()

    def _note(self, ev: Event) -> None:
        if ev.kind == "error" or (ev.output is not None and ev.output.finished):
            self.unfinished.discard(ev.request_id)
        if ev.output is not None:
            self.prompt_tokens[ev.request_id] = len(ev.output.prompt_token_ids)
            self.cached_tokens[ev.request_id] = int(getattr(ev.output, "num_cached_tokens", None) or 0)
            self.completion_tokens[ev.request_id] = sum(len(x.token_ids) for x in samples_of(ev.output))

    async def wait_first(self, request: Request) -> None:
        """Wait for every engine request's first event; raise the first error among them."""
        seen: set[str] = set()
        while len(seen) < len(self.index):
            ev = await self._next(request)
            self._note(ev)
            if ev.kind == "error":
                raise ev.error
            seen.add(ev.request_id)
            self.buffered.append(ev)

    def abort_unfinished(self) -> None:
        for sid in list(self.unfinished):
            self.loop_.abort(sid)
        self.unfinished.clear()

    def _usage(self) -> dict:
        return P.usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()), sum(self.cached_tokens.values()))

    def _logprobs(self, entries: list, offset: int = 0) -> dict:
        n = self.top_logprobs or 0
        if self.kind == "chat":
            return P.chat_logprobs(entries, n, self.tokens_as_ids)
        return P.completion_logprobs(entries, n, offset, self.tokens_as_ids)

    def _entries(self, out: Any, sample: Any) -> list:
        """A sample's per-token logprobs; with echo, the prompt's first (its first position has none)."""
        entries = list(getattr(sample, "logprobs", None) or [])
        if self.echo:
            pl = getattr(out, "prompt_logprobs", None)
            entries = (list(pl) if pl else [None] * len(out.prompt_token_ids)) + entries
        return entries

    async def collect(self, request: Request) -> dict:
        texts = {i: "" for i in range(len(self.index) * self.n)}
        reasons: dict[int, str | None] = {}
        logprobs: dict[int, Any] = {}
        pending = list(self.buffered)
        while pending or self.unfinished:
            ev = pending.pop(0) if pending else await self._next(request)
            self._note(ev)
            if ev.kind == "error":
                raise ev.error
            for j, delta, reason in ev.choices:
                texts[self._choice(ev.request_id, j)] += delta
                if reason is not None:
                    reasons[self._choice(ev.request_id, j)] = P.finish_reason(reason)
            if ev.output.finished:  # the engine's final texts, stop strings already cut
                prefix = self.echo.get(ev.request_id, "") if self.echo else ""
                for j, sample in enumerate(samples_of(ev.output)):
                    c = self._choice(ev.request_id, j)
                    texts[c] = prefix + sample.text
                    if self.top_logprobs is not None:
                        logprobs[c] = self._logprobs(self._entries(ev.output, sample))
        choices = [{"index": i, "text": texts[i], "finish_reason": reasons.get(i), "logprobs": logprobs.get(i)} for i in sorted(texts)]
        body = P.completion_body(self.kind, self.rid, self.model, choices, sum(self.prompt_tokens.values()),
                                 sum(self.completion_tokens.values()), self.created)
        body["usage"] = self._usage()  # with prompt_tokens_details.cached_tokens
        return body

    async def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        pending = list(self.buffered)
        try:
            if self.kind == "chat":
                for i in range(len(self.index) * self.n):
                    yield P.sse(P.chunk("chat", self.rid, self.model, self.created, i, "", None, first=True))
            while pending or self.unfinished:
                ev = pending.pop(0) if pending else await self._next(None)
                self._note(ev)
                if ev.kind == "error":
                    yield P.sse(ev.error.body())
                    break
                samples = samples_of(ev.output)
                for j, delta, reason in ev.choices:
                    c = self._choice(ev.request_id, j)
                    lp = None
                    if self.echo and c not in self.text_sent:  # the prompt goes first, in the first chunk
                        delta = self.echo.get(ev.request_id, "") + delta
                    if self.top_logprobs is not None and j < len(samples):
                        entries = self._entries(ev.output, samples[j])
                        sent = self.logprobs_sent.get(c, 0)
                        lp = self._logprobs(entries[sent:], self.text_sent.get(c, 0))
                        self.logprobs_sent[c] = len(entries)
                    self.text_sent[c] = self.text_sent.get(c, 0) + len(delta)
                    yield P.sse(P.chunk(self.kind, self.rid, self.model, self.created, c, delta, P.finish_reason(reason),
                                        logprobs=lp, usage_so_far=self._usage() if self.continuous_usage else None))
            if include_usage:
                last = P.usage_chunk(self.kind, self.rid, self.model, self.created,
                                     sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))
                last["usage"] = self._usage()
                yield P.sse(last)
            yield P.sse("[DONE]")
        finally:  # the client went away (the response was cancelled) or an error ended it
            self.abort_unfinished()
