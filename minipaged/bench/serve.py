"""`minipaged bench serve`: a load generator for any OpenAI-compatible server (minipaged or vLLM).

Owns online measurement: a seeded request set (lengths from ``workloads.py``), an arrival
process (Poisson, constant or bursts), bounded in count and in time, sent over HTTP with
streaming; per request the time to first token, every later chunk's arrival, the end. It
reports throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), and goodput
under a stated SLO, as JSON (and a plot). It speaks only the OpenAI API (``/v1/completions``
or ``/v1/chat/completions`` with ``stream: true``), so it never imports the engine and measures
``vllm serve`` the same way.

    minipaged bench serve --url http://127.0.0.1:8000/v1 --rate 2 --num-requests 32 --dataset sharegpt-like

Definitions (as vLLM's benchmark uses them): TTFT = first token's arrival - send time;
TPOT = (end - first token) / (output tokens - 1); ITL = the gaps between consecutive streamed
chunks; goodput = the requests that met every SLO divided by the **offered window**, the time
over which the load was offered (requests sent / rate), i.e. the offered rate times the fraction
that met the SLO, so it never exceeds the offered rate. With ``--rate inf`` (everything sent at
once) there is no offered window, and goodput is divided by the run's length instead (vLLM's
benchmark divides by the run's length at every rate); the report says which (``goodput_window``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .clock import poisson_arrivals
from .workloads import synthetic

DATASETS = {"sharegpt-like": "sharegpt", "alpaca-like": "alpaca", "fixed": "fixed"}
ARRIVALS = ("poisson", "constant", "burst")
PERCENTILES = (50, 90, 99)


# -- what to send, and when ------------------------------------------------------------------
@dataclass
class LoadRequest:
    prompt: Any  # token ids (completions) or text (chat)
    prompt_len: int
    output_len: int


def make_requests(dataset: str = "sharegpt-like", num_requests: int = 32, seed: int = 0, vocab_size: int = 49152,
                  scale: float = 1.0, max_prompt: int = 256, max_output: int = 256,
                  fixed: tuple[int, int] = (64, 32), prompt_format: str = "ids") -> list[LoadRequest]:
    """Seeded requests whose lengths follow ``workloads.synthetic``'s distributions.

    ``prompt_format``: "ids" sends token ids (exact prompt lengths; the server's vocabulary must
    hold ``vocab_size`` ids), "text" sends words of about one token each (for chat endpoints).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}: use one of {sorted(DATASETS)}")
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt_format must be 'ids' or 'text', got {prompt_format!r}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    wl = synthetic(DATASETS[dataset], num_requests=num_requests, seed=seed, vocab_size=vocab_size,
                   max_prompt=max_prompt, max_output=max_output, fixed=fixed if dataset == "fixed" else None, scale=scale)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "sky", "while", "it", "rained", "all", "day"]
    out = []
    for i, r in enumerate(wl.requests):
        n = len(r.prompt_token_ids)
        prompt: Any = r.prompt_token_ids if prompt_format == "ids" else " ".join(words[(i + k) % len(words)] for k in range(n))
        out.append(LoadRequest(prompt, n, r.max_tokens))
    return out


def arrival_times(n: int, rate: float, arrival: str = "poisson", burst_size: int = 8, seed: int = 0) -> list[float]:
    """Send times in seconds from the start, for ``n`` requests at ``rate`` requests/s on average.

    poisson: exponential gaps (independent users); constant: one every 1/rate s; burst:
    ``burst_size`` at once every ``burst_size / rate`` s. ``rate=inf`` sends everything at t=0.
    """
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}: use one of {ARRIVALS}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf sends all at once), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        return [i / rate for i in range(n)]
    if arrival == "burst":
        if burst_size < 1:
            raise ValueError(f"burst_size must be >= 1, got {burst_size}")
        return [(i // burst_size) * burst_size / rate for i in range(n)]
    return poisson_arrivals(n, rate, seed)


# -- one request -----------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0  # tokens the server says it generated (usage), else the chunks counted
    send: float = 0.0  # seconds since the run started
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    finish_reason: str | None = None
    text: str = ""  # the streamed text, joined (to compare two servers' greedy outputs)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


async def _one(client, url: str, endpoint: str, model: str, req: LoadRequest, t0: float, ignore_eos: bool, timeout: float) -> Result:
    res = Result(prompt_len=req.prompt_len)
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
        path = "/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/completions"
    start = time.perf_counter()
    res.send = start - t0
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url.rstrip("/") + path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {msg['error'].get('message', msg['error'])}"[:200]
                    return res
                if msg.get("usage"):
                    res.output_len = int(msg["usage"].get("completion_tokens") or 0)
                for ch in msg.get("choices") or []:
                    piece = ch.get("text") if endpoint != "chat" else (ch.get("delta") or {}).get("content")
                    now = time.perf_counter()
                    if piece:
                        res.text += piece
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        chunks += 1
                        last = now
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
        res.e2e = time.perf_counter() - start
        res.output_len = res.output_len or chunks
        res.ok = chunks > 0 or res.output_len > 0
        if not res.ok:
            res.error = "the stream ended without any token"
    except asyncio.CancelledError:
        res.error = "cancelled: the run's time limit passed"
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported, never fatal
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


# -- a run -----------------------------------------------------------------------------------
def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(xs) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def offered_window(num_requests: int, rate: float | None) -> float | None:
    """Seconds over which ``num_requests`` at ``rate`` requests/s were offered (``num_requests / rate``);
    None when there is none (no rate given, or ``rate=inf``: everything sent at once)."""
    if rate is None or not math.isfinite(rate) or rate <= 0 or num_requests < 1:
        return None
    return num_requests / rate


def summarize(results: list[Result], duration: float, slo_ttft_ms: float, slo_tpot_ms: float,
              rate: float | None = None) -> dict:
    """The run's figures. Latencies in milliseconds; throughputs per second of ``duration``.

    Goodput is the requests that met both SLOs divided by the offered window (``len(results) /
    rate``): the offered rate times the fraction that met the SLO, never above ``rate``. Without a
    finite ``rate`` it is divided by ``duration`` (``goodput_window`` says which)."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_len for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    good = [r for r in ok if r.ttft * 1000 <= slo_ttft_ms and r.tpot * 1000 <= slo_tpot_ms]
    offered = offered_window(len(results), rate)
    window = offered if offered else (duration if duration > 0 else 0.0)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.output_len > 1]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2e for r in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        # over the offered window: the rate times the fraction (exactly the rate when every request met the SLO)
        "goodput": (rate * (len(good) / len(results)) if offered else len(good) / window) if window else 0.0,
        "goodput_fraction": len(good) / len(results) if results else 0.0,
        "goodput_window_s": window,
        "goodput_window": "offered" if offered else "run",
    }


def intervals(report: dict, level: float = 0.9, resamples: int = 1000, seed: int = 0) -> dict:
    """Bootstrap intervals (``level``, over the run's requests drawn again with replacement) for the
    p50 TTFT and TPOT (ms) and goodput (req/s, over the same window as the report's): how much
    each number could move had the same load brought other requests. ``{"ttft_p50_ms": (lo, hi), ...}``."""
    res = report["_results"]
    slo, window = report["slo"], report["goodput_window_s"]
    n = len(res)
    if n == 0 or not window:
        return {k: (None, None) for k in ("ttft_p50_ms", "tpot_p50_ms", "goodput")}
    ok = np.array([r.ok for r in res])
    ttft = np.array([r.ttft for r in res]) * 1000.0
    tpot = np.array([r.tpot for r in res]) * 1000.0
    has_tpot = np.array([r.output_len > 1 for r in res])
    good = ok & (ttft <= slo["ttft_ms"]) & (tpot <= slo["tpot_ms"])
    idx = np.random.default_rng(seed).integers(0, n, (resamples, n))
    q = (100 * (1 - level) / 2, 100 * (1 + level) / 2)

    def p50(values: np.ndarray, mask: np.ndarray) -> tuple:
        meds = [np.median(values[i][mask[i]]) for i in idx if mask[i].any()]
        return tuple(float(x) for x in np.percentile(meds, q)) if meds else (None, None)

    gp = good[idx].sum(axis=1) / window
    return {"ttft_p50_ms": p50(ttft, ok), "tpot_p50_ms": p50(tpot, ok & has_tpot),
            "goodput": tuple(float(x) for x in np.percentile(gp, q))}


async def _fetch_model(client, url: str) -> str:
    r = await client.get(url.rstrip("/") + "/models", timeout=10.0)
    r.raise_for_status()
    data = r.json()["data"]
    if not data:
        raise ValueError(f"{url}/models lists no model: pass --model")
    return data[0]["id"]


async def run_load_async(url: str, requests: list[LoadRequest], times: list[float], model: str | None = None,
                         endpoint: str = "completions", max_concurrency: int | None = None, duration_s: float | None = None,
                         timeout_s: float = 600.0, request_timeout_s: float = 300.0, ignore_eos: bool = True,
                         progress: bool = True, on_tick: Any = None) -> tuple[list[Result], float, str]:
    """Send ``requests[i]`` at ``times[i]``; stop sending after ``duration_s``; cancel what is left
    after ``timeout_s``. Returns (results of the requests sent, seconds from the first send to the
    last end, the model name used)."""
    import httpx

    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=request_timeout_s) as client:
        model = model or await _fetch_model(client, url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc=f"bench serve {url}", unit="req")
        t0 = time.perf_counter()

        async def send(i: int) -> Result:
            await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - t0)))
            if sem is not None:
                async with sem:
                    r = await _one(client, url, endpoint, model, requests[i], t0, ignore_eos, request_timeout_s)
            else:
                r = await _one(client, url, endpoint, model, requests[i], t0, ignore_eos, request_timeout_s)
            if bar is not None:
                bar.update(1)
            return r

        chosen = [i for i, t in enumerate(times) if duration_s is None or t <= duration_s]
        tasks = [asyncio.ensure_future(send(i)) for i in chosen]
        ticker = None
        if on_tick is not None:
            async def tick():
                while True:
                    await asyncio.sleep(0.5)
                    on_tick(time.perf_counter() - t0)
            ticker = asyncio.ensure_future(tick())
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        results = []
        for t in tasks:
            try:
                results.append(await t)
            except asyncio.CancelledError:
                results.append(Result(error="cancelled: the run's time limit passed"))
        if ticker is not None:
            ticker.cancel()
        if bar is not None:
            bar.close()
    ends = [r.send + r.e2e for r in results if r.ok]
    starts = [r.send for r in results]
    duration = (max(ends) - min(starts)) if ends else 0.0
    return results, duration, model


def _run(coro):
    """``asyncio.run``, also from inside a running event loop (a Jupyter kernel): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def fresh_seed() -> int:
    """A seed no earlier run is likely to have used (from the OS's randomness)."""
    import secrets

    return secrets.randbelow(2**31)


def run_load(url: str, rate: float = float("inf"), num_requests: int = 32, dataset: str = "sharegpt-like",
             arrival: str = "poisson", burst_size: int = 8, seed: int | None = None, endpoint: str = "completions",
             model: str | None = None, scale: float = 1.0, max_prompt: int = 256, max_output: int = 256,
             fixed: tuple[int, int] = (64, 32), vocab_size: int = 49152, prompt_format: str | None = None,
             max_concurrency: int | None = None, duration_s: float | None = None, timeout_s: float = 600.0,
             slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 200.0, ignore_eos: bool = True,
             progress: bool = True, on_tick: Any = None) -> dict:
    """One run at one rate; the JSON report as a dict (see ``summarize``), with its settings.

    ``seed``: the prompts and arrival times. None (the default) draws a fresh one each run, so a
    second run against the same server does not find its prompts in the prefix cache; the seed
    used is in ``report["settings"]["seed"]``, and passing it again repeats the run's requests."""
    if seed is None:
        seed = fresh_seed()
    fmt = prompt_format or ("text" if endpoint == "chat" else "ids")
    reqs = make_requests(dataset, num_requests, seed, vocab_size, scale, max_prompt, max_output, fixed, fmt)
    times = arrival_times(num_requests, rate, arrival, burst_size, seed)
    results, duration, model = _run(run_load_async(
        url, reqs, times, model, endpoint, max_concurrency, duration_s, timeout_s, ignore_eos=ignore_eos,
        progress=progress, on_tick=on_tick))
    report = summarize(results, duration, slo_ttft_ms, slo_tpot_ms, rate=rate)
    report["settings"] = {
        "url": url, "model": model, "endpoint": endpoint, "dataset": dataset, "num_requests": num_requests,
        "rate": rate if math.isfinite(rate) else "inf", "arrival": arrival, "burst_size": burst_size, "seed": seed,
        "scale": scale, "max_prompt": max_prompt, "max_output": max_output, "prompt_format": fmt,
        "max_concurrency": max_concurrency, "duration_s": duration_s, "timeout_s": timeout_s, "ignore_eos": ignore_eos,
    }
    report["machine"] = {"platform": f"{platform.system()} {platform.machine()}", "python": platform.python_version()}
    report["_results"] = results
    return report


def sweep(url: str, rates: list[float], **kw: Any) -> list[dict]:
    """``run_load`` at each rate in turn: latency against load. Without ``seed``, each rate gets
    fresh prompts (the same prompts again would be served from the prefix cache); with one, the
    same requests each time."""
    return [run_load(url, rate=r, **kw) for r in rates]


def to_json(report: dict | list) -> str:
    def clean(r: dict) -> dict:
        return {k: v for k, v in r.items() if not k.startswith("_")}
    return json.dumps([clean(r) for r in report] if isinstance(report, list) else clean(report), indent=2)


# -- pictures --------------------------------------------------------------------------------
def plot_run(report: dict, path: str | Path | None = None):
    """When each request was sent, got its first token and ended, and the TTFT/latency CDFs."""
    import matplotlib.pyplot as plt

    res = [r for r in report["_results"] if r.ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, r in enumerate(sorted(res, key=lambda r: r.send)):
        a.plot([r.send, r.send + r.ttft], [i, i], color="tab:orange", lw=2)
        a.plot([r.send + r.ttft, r.send + r.e2e], [i, i], color="tab:blue", lw=2)
    a.set(xlabel="seconds since the run started", ylabel="request", title="waiting for the first token (orange), streaming (blue)")
    for key, label in (("ttft", "TTFT"), ("e2e", "end-to-end")):
        xs = np.sort([getattr(r, key) for r in res])
        b.plot(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), label=label)
    b.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    b.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def plot_sweep(reports: list[dict], path: str | Path | None = None, knee: float | None = None):
    """TTFT, TPOT and end-to-end latency (p50 and p99) against the offered request rate."""
    import matplotlib.pyplot as plt

    rates = [r["settings"]["rate"] for r in reports]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), ("time to first token", "time per output token", "end-to-end latency")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [r[key][p] for r in reports], style, label=p)
        if knee is not None:
            ax.axvline(knee, color="grey", ls=":", label="knee")
        ax.set(xlabel="offered rate (requests/s)", ylabel="ms", title=title)
        ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def find_knee(reports: list[dict], key: str = "ttft_ms", factor: float = 3.0) -> float | None:
    """The first offered rate whose p50 ``key`` is over ``factor`` times the lowest p50 at a lower rate.

    The running minimum, not the first rate's value, is the floor: one slow request at a low rate
    (a busy machine, a cold cache) should not hide the knee.
    """
    floor = None
    for r in reports:
        p50 = r[key]["p50"]
        if p50 is None:
            continue
        if floor is not None and p50 > factor * floor:
            return r["settings"]["rate"]
        floor = p50 if floor is None else min(floor, p50)
    return None


def format_report(r: dict) -> str:
    s = r["settings"]
    lines = [
        f"{s['num_requests']} requests ({s['dataset']}, seed {s.get('seed')}), {s['arrival']} arrivals at {s['rate']} req/s -> {s['url']} ({s['model']})",
        f"completed {r['completed']}, failed {r['failed']} in {r['duration_s']:.1f} s",
        f"throughput: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, {r['total_token_throughput']:.1f} total tok/s",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        st = r[key]
        if st["mean"] is None:
            lines.append(f"{name:12s} (no data)")
        else:
            lines.append(f"{name:12s} mean {st['mean']:8.1f} ms  p50 {st['p50']:8.1f}  p90 {st['p90']:8.1f}  p99 {st['p99']:8.1f}")
    over = (f"over the offered window of {r['goodput_window_s']:.1f} s = requests / rate" if r.get("goodput_window") == "offered"
            else f"over the run's {r['duration_s']:.1f} s: no offered window at rate {s['rate']}")
    lines.append(f"goodput: {r['goodput']:.2f} req/s ({r['goodput_fraction']:.0%} of requests met TTFT <= {r['slo']['ttft_ms']:.0f} ms "
                 f"and TPOT <= {r['slo']['tpot_ms']:.0f} ms; {over})")
    for err, n in r["errors"].items():
        lines.append(f"  {n} x {err}")
    return "\n".join(lines)


def comparison_table(reports: dict[str, dict | None]) -> str:
    """A markdown table, one row per server: {"minipaged serve (2 CPU cores)": report, "vllm serve (GPU)": None}.

    A missing report leaves its row to whoever can run it (the README's vLLM row needs a GPU).
    """
    rows = ["| server | requests | rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) | E2E p50 (ms) | goodput (req/s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in reports.items():
        if r is None:
            rows.append(f"| {name} | not measured here: run the command in docs/serving.md on a GPU and fill this row | | | | | | |")
            continue
        s = r["settings"]
        rows.append(
            f"| {name} | {r['completed']}/{r['num_requests']} ({s['dataset']}) | {s['rate']} | {r['output_throughput']:.1f} | "
            f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['p50']:.0f} | {r['e2el_ms']['p50']:.0f} | "
            f"{r['goodput']:.2f} (TTFT <= {r['slo']['ttft_ms']:.0f} ms, TPOT <= {r['slo']['tpot_ms']:.0f} ms) |")
    return "\n".join(rows)


# -- command line ----------------------------------------------------------------------------
def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 requests/s (or inf), got {s}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (ends in /v1)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /models)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--rate", type=_rate, default=float("inf"), help="requests per second on average (default inf: all at once)")
    p.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    p.add_argument("--burst-size", type=int, default=8, help="requests per burst with --arrival burst")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="send no request after this many seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="cancel what is still running after this many seconds")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--dataset", default="sharegpt-like", choices=sorted(DATASETS))
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens with --dataset fixed")
    p.add_argument("--output-len", type=int, default=32, help="output tokens with --dataset fixed")
    p.add_argument("--scale", type=float, default=0.5, help="shrink the dataset's median lengths (a CPU serves slowly)")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids in prompts stay below this (SmolLM2's vocabulary)")
    p.add_argument("--prompt-format", default=None, choices=["ids", "text"], help="default: ids for completions, text for chat")
    p.add_argument("--seed", type=int, default=None,
                   help="the prompts and arrivals; default: a fresh seed each run (printed), so a second run does not "
                        "hit the prefix cache with the first run's prompts. Give it to repeat a run exactly")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput counts requests with TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="... and TPOT at most this")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let the model stop early (lengths then vary)")
    p.add_argument("--launch", action="store_true",
                   help="start `minipaged serve` (default model, or --launch-model) on a free port for this run, then stop it")
    p.add_argument("--launch-model", default=None, help="the model --launch serves (a GGUF file or a model folder)")
    p.add_argument("--launch-args", default="", help='more flags for the launched server, e.g. "--max-num-seqs 16"')
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG of the run here")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    for name in ("num_requests", "burst_size", "max_prompt", "max_output", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.launch:
        import shlex

        from ..server.launch import ServerProcess

        srv = ServerProcess(args.launch_model)
        srv.cmd += shlex.split(args.launch_args)
        with srv:
            args.url, args.launch = srv.url, False
            print(f"launched: {' '.join(srv.cmd[1:])}", flush=True)
            return run(args)
    report = run_load(
        args.url, rate=args.rate, num_requests=args.num_requests, dataset=args.dataset, arrival=args.arrival,
        burst_size=args.burst_size, seed=args.seed, endpoint=args.endpoint, model=args.model, scale=args.scale,
        max_prompt=args.max_prompt, max_output=args.max_output, fixed=(args.input_len, args.output_len),
        vocab_size=args.vocab_size, prompt_format=args.prompt_format, max_concurrency=args.max_concurrency,
        duration_s=args.duration, timeout_s=args.timeout, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        ignore_eos=args.ignore_eos, progress=args.progress,
    )
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(to_json(report) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot_run(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if report["completed"] else 1
