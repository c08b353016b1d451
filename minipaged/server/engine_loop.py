"""The one thread that owns the engine, and the queues that connect it to HTTP handlers.

Owns the engine's thread: the engine is single-threaded by design, so every call to
``add_request``, ``step`` and ``abort_request`` happens here, and nowhere else. Handlers (on
the asyncio event loop) ``submit`` and ``abort`` through a thread-safe inbox; the loop sends each
request's events back into that request's ``asyncio.Queue`` with ``call_soon_threadsafe``, which
never blocks, so a slow client cannot stall the engine. It decides admission (the waiting-queue
limit), text deltas, and the per-token timings the metrics record. It never parses HTTP.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import parts
from .protocol import APIError, bad_request, internal_error, overloaded, shutting_down

log = logging.getLogger("minipaged.server")


def text_delta(shown: str, out: Any, stops: list[str]) -> str:
    """The text an output adds to what the client was already ``shown``; never a stop string's start.

    When the engine's outputs carry ``delta_text`` (text added since the previous output), that is
    used as is. Otherwise it is computed from the cumulative ``text``: a trailing partial UTF-8
    character, and a tail that could be the start of a stop string, are held back until the next
    output (or the last) settles them.
    """
    d = getattr(out, "delta_text", None)
    if d is not None:
        return d
    text = out.text
    if not out.finished:
        text = text.rstrip("\ufffd")
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        text = text[: len(text) - hold]
    if len(text) > len(shown) and text.startswith(shown):
        return text[len(shown):]
    return ""


class _ParamError(ValueError):
    """A refusal that names the request field to change."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _param_of(e: Exception) -> str:
    """The request field an engine refusal is about (for the error body's ``param``)."""
    param = getattr(e, "param", None)
    if param is not None:
        return param
    msg = str(e)
    for prefix, field_ in (("SamplingParams(n=", "n"), ("max_tokens=", "max_tokens"), ("stop string", "stop"),
                           ("chat_template", "chat_template")):
        if msg.startswith(prefix):
            return field_
    return "prompt"


@dataclass
class Event:
    """What the engine thread sends a request's handler.

    ``kind``: "token" (``output`` is the engine's RequestOutput; ``choices`` lists, per sample that
    changed, its new text and, once, its finish reason) or "error" (``error`` is an APIError; the
    request is over). A "token" event whose output is finished is the last one.
    """

    kind: str
    request_id: str = ""
    output: Any = None
    delta: str = ""  # sample 0's new text
    error: APIError | None = None
    time: float = 0.0
    choices: list = field(default_factory=list)  # (sample index, new text, finish reason once it finishes)


@dataclass
class _Sample:
    shown: str = ""
    num_tokens: int = 0
    last_token_time: float = 0.0
    finished: bool = False


@dataclass
class _Request:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stops: list[str]
    arrival: float
    auto_max_tokens: bool = False
    first_token_seen: bool = False
    samples: dict = field(default_factory=dict)  # sample index -> _Sample
    params: Any = None  # its SamplingParams (the metrics' request histograms read n and max_tokens)


def samples_of(out: Any) -> list:
    """A RequestOutput's samples: its ``outputs`` (one per sample with ``SamplingParams(n)``), else itself."""
    outs = getattr(out, "outputs", None)
    return list(outs) if outs else [out]


@dataclass
class LoopStats:
    """A snapshot the loop publishes after every step (read from any thread; replaced whole)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_in_flight: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    last_step_time: float = 0.0
    extra: dict = field(default_factory=dict)


def cache_config_of(eng: Any) -> dict:
    """What /metrics shows of the engine's KV cache (vllm:cache_config_info) and the last step's
    scheduled tokens (vllm:iteration_tokens_total)."""
    cfg = getattr(eng, "config", None)
    if cfg is None or getattr(eng, "allocator", None) is None or getattr(cfg, "block_size", None) is None:
        return {}  # an engine without paged KV (a test's scripted one) has no cache to describe
    kv_dtype = getattr(cfg, "kv_cache_dtype", "auto")  # vLLM's cache_dtype: 8-bit pages by name, else the model's
    return {"cache_config": {"block_size": cfg.block_size, "num_gpu_blocks": eng.allocator.num_blocks,
                             "enable_prefix_caching": bool(getattr(cfg, "enable_prefix_caching", False)),
                             "cache_dtype": kv_dtype if kv_dtype != "auto" else str(getattr(eng, "dtype", "auto")).replace("torch.", "")},
            "step_tokens": getattr(eng, "last_step_tokens", 0)}


class EngineLoop:
    """Owns one engine in one background thread.

    ``engine_factory()`` is called in that thread, so the engine is built where it runs.
    ``max_waiting_requests``: a request that arrives while that many wait is refused with 503.
    ``metrics``: an object with ``on_step(engine, stats)``, ``on_first_token(s)``,
    ``on_token(s)``, ``on_finish(output, e2e_s)``, ``on_rejected(reason)`` (see metrics.py), or None.
    """

    def __init__(self, engine_factory: Callable[[], Any], max_waiting_requests: int = 512, metrics: Any = None) -> None:
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be an int >= 1, got {max_waiting_requests!r}")
        self._factory = engine_factory
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.engine: Any = None
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._accepting = True
        self._drain_deadline: float | None = None
        self._stopped = threading.Event()
        self.fatal_error: str | None = None
        self.max_model_len: int = 0

    # -- lifecycle (any thread) ------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> "EngineLoop":
        """Start the thread and wait until the engine is built; re-raise what building it raised."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="minipaged-engine-loop", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the engine was not built within {timeout_s:.0f} s")
        if self._startup_error is not None:
            raise self._startup_error
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    def begin_shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Take no new requests; in-flight ones may finish for ``drain_timeout_s``, then are aborted."""
        self._accepting = False
        self._inbox.put(("shutdown", time.perf_counter() + max(0.0, drain_timeout_s)))

    def shutdown(self, drain_timeout_s: float = 10.0, join_timeout_s: float = 30.0) -> None:
        """``begin_shutdown`` and wait for the thread to end."""
        if self._thread is None:
            return
        self.begin_shutdown(drain_timeout_s)
        self._thread.join(drain_timeout_s + join_timeout_s)

    # -- requests (the asyncio side) -------------------------------------------------------
    def submit(self, request_id: str, prompt: Any, params: Any, events: asyncio.Queue, loop: asyncio.AbstractEventLoop,
               arrival: float | None = None, auto_max_tokens: bool = False) -> None:
        """Queue a request for the engine thread; its events come back into ``events``.

        The first event is an error (bad prompt, too long, overloaded) or its first tokens.
        ``auto_max_tokens``: the client gave no limit, so the answer may fill what is left of the
        context (or of the whole KV pool, when that is smaller), as vLLM's server does.
        """
        if not self.accepting:
            raise shutting_down() if not self._accepting else internal_error(f"the engine loop has stopped: {self.fatal_error}")
        req = _Request(request_id, loop, events, list(getattr(params, "stop", []) or []), arrival or time.perf_counter(),
                       auto_max_tokens)
        self._inbox.put(("add", req, prompt, params))

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); its blocks are freed on the engine thread."""
        self._inbox.put(("abort", request_id))

    # -- the engine thread -----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._factory()
            self.max_model_len = max_model_len_of(self.engine)
            self._publish()
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller, who would otherwise wait forever
            self._startup_error = e
            self._stopped.set()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - the loop must say why it died, then fail every request
            self.fatal_error = f"{type(e).__name__}: {e}"
            log.error("the engine loop died:\n%s", traceback.format_exc())
            for r in list(self._requests.values()):
                self._send(r, Event("error", error=internal_error(f"the engine loop stopped: {self.fatal_error}")))
            self._requests.clear()
        finally:
            self._drain_inbox_after_stop()
            self._stopped.set()

    def _run(self) -> None:
        eng = self.engine
        while True:
            busy = eng.has_unfinished_requests()
            self._drain_inbox(block=not busy)
            if self._drain_deadline is not None:
                if not self._requests:
                    return
                if time.perf_counter() >= self._drain_deadline:
                    for rid in list(self._requests):
                        self._abort_now(rid, final=True)
                    return
            if not eng.has_unfinished_requests():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not end the server
                self._fail_step(e)
                continue
            now = time.perf_counter()
            self._publish(now)  # before the outputs go out: a client that saw its end sees its blocks free
            for out in outs:
                self._dispatch(out, now)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "add":
                self._add(*item[1:])
            elif kind == "abort":
                self._abort_now(item[1], final=False)
            elif kind == "shutdown":
                self._drain_deadline = item[1] if self._drain_deadline is None else min(self._drain_deadline, item[1])
            elif kind == "call":
                item[1](self.engine)
                self._publish()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox_after_stop(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._send(item[1], Event("error", error=shutting_down()))

    def _add(self, req: _Request, prompt: Any, params: Any) -> None:
        eng = self.engine
        if self._drain_deadline is not None:
            self._send(req, Event("error", error=shutting_down()))
            return
        waiting = len(eng.scheduler.waiting)
        if waiting >= self.max_waiting_requests:
            if self.metrics is not None:
                self.metrics.on_rejected("overloaded")
            self._send(req, Event("error", error=overloaded(waiting, self.max_waiting_requests)))
            return
        if req.request_id in self._requests:
            self._send(req, Event("error", error=bad_request(f"request id {req.request_id!r} is already in use")))
            return
        try:
            if req.auto_max_tokens:
                prompt, params = self._fill_max_tokens(prompt, params)
            else:
                prompt = self._check_max_tokens(prompt, params)
            eng.add_request(prompt, params, request_id=req.request_id)
        except (ValueError, TypeError) as e:
            if self.metrics is not None:
                self.metrics.on_rejected("invalid")
            self._send(req, Event("error", error=bad_request(str(e), _param_of(e))))
            return
        except Exception as e:  # noqa: BLE001 - a broken add must not end the server
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._send(req, Event("error", error=internal_error(f"the engine could not take the request: {type(e).__name__}: {e}")))
            return
        req.params = params
        self._requests[req.request_id] = req

    def _fill_max_tokens(self, prompt: Any, params: Any) -> tuple[Any, Any]:
        """max_tokens = the room left after the prompt, in the context and in the KV pool: the answer
        ends within both (a prompt that leaves no room is the engine's to reject)."""
        encode = getattr(self.engine, "encode_prompt", None)
        if encode is None:
            return prompt, params
        ids = list(encode(prompt))
        pool = self.engine.allocator.num_blocks * self.engine.allocator.block_size
        # the context holds prompt + answer; the pool one token less (the last token is returned, never cached)
        room = min(self.max_model_len - len(ids), pool - len(ids) + 1)
        return ids, dataclasses.replace(params, max_tokens=max(1, room))

    def _check_max_tokens(self, prompt: Any, params: Any) -> Any:
        """A max_tokens that cannot fit after the prompt is refused before any work, naming both numbers
        (vLLM's 400). A prompt that is itself too long is left to the engine, whose message says so.
        Returns the prompt as token ids (so it is tokenized once), or as it was."""
        encode = getattr(self.engine, "encode_prompt", None)
        max_tokens = getattr(params, "max_tokens", None)
        if encode is None or not isinstance(max_tokens, int) or not self.max_model_len:
            return prompt
        ids = list(encode(prompt))
        if len(ids) < self.max_model_len and len(ids) + max_tokens > self.max_model_len:
            raise _ParamError("max_tokens",
                f"this model's maximum context length is {self.max_model_len} tokens, but {len(ids) + max_tokens} were "
                f"asked for: {len(ids)} in the prompt and max_tokens={max_tokens} for the answer; the prompt leaves room for "
                f"{self.max_model_len - len(ids)}: lower max_tokens to at most {self.max_model_len - len(ids)}, or shorten the prompt")
        return ids

    def _abort_now(self, rid: str, final: bool) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            return
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001 - already gone from the engine is fine
            log.warning("abort_request(%r) failed:\n%s", rid, traceback.format_exc())
        if self.metrics is not None:
            self.metrics.on_aborted()
        if final:  # the server is shutting down: tell the client its answer ends here
            self._send(req, Event("error", error=APIError(503, "the server shut down before this request finished", "server_shutting_down", None, "aborted")))
        self._publish()

    def _dispatch(self, out: Any, now: float) -> None:
        req = self._requests.get(out.request_id)
        if req is None:
            return  # aborted: its client is gone
        if out.finish_reason in ("rejected", "error"):  # refused at admission, or failed inside a step
            self._requests.pop(req.request_id, None)
            if self.metrics is not None:
                self.metrics.on_rejected("invalid" if out.finish_reason == "rejected" else "error")
            if out.finish_reason == "rejected":
                err = bad_request(out.error or "the engine rejected the request", "prompt")
            else:
                err = internal_error(f"the engine failed while serving this request: {out.error}")
            self._send(req, Event("error", output=out, error=err))
            return
        m = self.metrics
        choices = []
        for i, sample in enumerate(samples_of(out)):
            state = req.samples.setdefault(i, _Sample())
            n_new = len(sample.token_ids) - state.num_tokens
            if n_new > 0:
                if m is not None:
                    if not req.first_token_seen:
                        m.on_first_token(now - req.arrival)
                        m.on_token(0.0, n_new - 1)
                    elif state.num_tokens == 0:  # another sample's first token: it came with the prompt's step
                        m.on_token(0.0, n_new)
                    else:
                        m.on_token((now - state.last_token_time) / n_new, n_new)
                req.first_token_seen = True
                state.num_tokens, state.last_token_time = len(sample.token_ids), now
            delta = text_delta(state.shown, sample, req.stops)
            state.shown += delta
            reason = sample.finish_reason if sample.finished and not state.finished else None
            state.finished = state.finished or bool(sample.finished)
            if delta or reason is not None:
                choices.append((i, delta, reason))
        if out.finished and m is not None:  # counted before the client hears of it: a /metrics read after the answer sees it
            m.on_finish(out, now - req.arrival, req.params)
        self._send(req, Event("token", output=out, delta="".join(d for i, d, _ in choices if i == 0), choices=choices, time=now))
        if out.finished:
            self._requests.pop(req.request_id, None)

    def _fail_step(self, e: Exception) -> None:
        """A step raised: every in-flight request ends with an error, and its blocks are freed."""
        log.error("engine.step() raised; failing its %d in-flight requests:\n%s", len(self._requests), traceback.format_exc())
        err = internal_error(f"the engine failed while serving this request: {type(e).__name__}: {e}")
        for rid in list(self._requests):
            req = self._requests.pop(rid)
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
            self._send(req, Event("error", error=err))
        self._publish()

    def _send(self, req: _Request, ev: Event) -> None:
        ev.request_id = req.request_id
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, ev)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            if req.request_id in self._requests:
                self._abort_now(req.request_id, final=False)

    def _publish(self, now: float | None = None) -> None:
        eng = self.engine
        sched = eng.scheduler
        st = LoopStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_blocks=eng.allocator.num_blocks,
            num_used_blocks=parts.num_used_blocks(eng.allocator),
            num_in_flight=len(self._requests),
            num_steps=getattr(eng, "num_steps", 0),
            num_preemptions=getattr(sched, "num_preemptions", 0),
            last_step_time=now or time.perf_counter(),
            extra={**prefix_cache_counts(eng), **cache_config_of(eng)},
        )
        self.stats = st
        if self.metrics is not None:
            self.metrics.on_step(st)

    # -- for tests and /health -------------------------------------------------------------
    def call(self, fn: Callable[[Any], Any], timeout_s: float = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (tests, checks)."""
        box: dict = {}
        done = threading.Event()

        def run(engine):
            try:
                box["value"] = fn(engine)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            done.set()

        self._inbox.put(("call", run))
        if not done.wait(timeout_s):
            raise TimeoutError(f"the engine thread did not run the call within {timeout_s} s")
        if "error" in box:
            raise box["error"]
        return box["value"]


def prefix_cache_counts(engine: Any) -> dict:
    """Prefix-cache token counts ``{"queries": q, "hits": h}`` when the engine has a prefix cache, else {};
    with a KV connector also ``external_queries`` / ``external_hits`` (tokens asked of it, and given by it)."""
    counts = _device_prefix_counts(engine)
    connector = getattr(engine, "connector", None)
    if connector is not None and counts:
        counts.update(external_queries=int(connector.tiers["external_queries"]),
                      external_hits=int(connector.tiers["external_hits"]))
    return counts


def _device_prefix_counts(engine: Any) -> dict:
    if getattr(engine, "prefix_cache", None) is not None:  # the scheduler counts lookups in prompt tokens
        ps = getattr(engine.scheduler, "prefix_stats", None)
        if ps is not None and hasattr(ps, "queried_tokens") and hasattr(ps, "hit_tokens"):
            return {"queries": int(ps.queried_tokens), "hits": int(ps.hit_tokens)}
    for source in (engine, getattr(engine, "allocator", None), getattr(engine, "scheduler", None)):
        stats = getattr(source, "prefix_cache_stats", None)
        if callable(stats):
            stats = stats()
        if isinstance(stats, dict) and "queries" in stats and "hits" in stats:
            return {"queries": int(stats["queries"]), "hits": int(stats["hits"])}
    return {}


def max_model_len_of(engine: Any) -> int:
    """The engine's context length: its config's, else the model's positions."""
    for v in (getattr(getattr(engine, "config", None), "max_model_len", None), getattr(engine, "max_model_len", None)):
        if isinstance(v, int) and v > 0:
            return v
    return int(engine.model.config.max_position_embeddings)


