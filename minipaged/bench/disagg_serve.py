"""`minipaged bench disagg-serve`: one colocated server against a producer, a consumer and the proxy, on this machine.

Owns this one measured comparison of real processes. In one run it starts one colocated
``minipaged serve`` and sends it ``bench serve``'s load; stops it; starts a ``kv_producer``, a
``kv_consumer`` (joined by the ``TorchDistributedConnector``) and ``minipaged proxy`` in front of
them, and sends the proxy the same requests (same seed: same prompts, same lengths, same arrival
times); then stops every process it started, also on an error or Ctrl-C (each child in a process
group of its own, checked empty afterwards, its ports free). It prints TTFT, TPOT, goodput and the
requests that succeeded side by side, whether the two give the same greedy text, where the
disaggregated path's time goes (from the servers' own ``/metrics``), and what two servers sharing
the same CPU cores can and cannot show.

    minipaged bench disagg-serve --num-requests 12 --rate 1 --max-output 32 --json docs/figures/disagg_serve.json

``minipaged bench disagg`` is the other half: the same comparison on the simulated GPU, where the
two phases do get machines of their own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any

from . import save_run

COLOCATED, DISAGG = "colocated", "disaggregated"
LABELS = {COLOCATED: "colocated (1 server)", DISAGG: "disaggregated (producer + consumer + proxy)"}
# the flags the bench sets on every server itself (a --serve-args that names one is refused)
OWN_FLAGS = ("--host", "--port", "--model", "--kv-transfer-config", "--kv-offloading-size")


def _transfer_config(role: str, kv_port: int, connect_timeout_s: float) -> str:
    return json.dumps({"kv_connector": "TorchDistributedConnector", "kv_role": role, "kv_port": kv_port,
                       "kv_connector_extra_config": {"connect_timeout_s": connect_timeout_s}})


def check_arguments(num_requests: int, rate: float, max_prompt: int, max_output: int, slo_ttft_ms: float,
                    slo_tpot_ms: float, serve_args: list[str], startup_timeout_s: float) -> None:
    """A clear ValueError, saying what to give instead, for any setting the run cannot use (before it starts anything)."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"--num-requests must be an integer >= 1, got {num_requests!r}")
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s (inf sends every request at once), got {rate!r}")
    if max_prompt < 1:
        raise ValueError(f"--max-prompt must be >= 1 token, got {max_prompt}")
    if max_output < 2:
        raise ValueError(f"--max-output must be >= 2 tokens (TPOT needs a second token), got {max_output}")
    for name, v in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number of milliseconds > 0, got {v!r}")
    if not startup_timeout_s > 0:
        raise ValueError(f"--startup-timeout must be > 0 seconds, got {startup_timeout_s!r}")
    for a in serve_args:
        flag = a.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise ValueError(f"--serve-args may not set {flag}: the bench sets {', '.join(OWN_FLAGS)} on every server "
                             f"itself (give the model with --model)")


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a new server could listen on ``port`` now (as servers do, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextmanager
def _stop_on_sigterm():
    """A SIGTERM to this process unwinds like Ctrl-C (so the children are stopped); main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class Children:
    """Every process the run starts, stopped in reverse order by :meth:`stop_all` (and checked gone)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, Any]] = []
        self.ports: list[int] = []

    def spawn(self, role: str, srv: Any, *extra_ports: int) -> Any:
        self.procs.append((role, srv))
        self.ports += [srv.port, *extra_ports]
        return srv.spawn()

    def stop_all(self) -> list[dict]:
        out = []
        for role, srv in reversed(self.procs):
            if srv.proc is None:
                continue
            try:
                code = srv.stop(grace_s=20.0)
            except Exception as e:  # noqa: BLE001 - go on stopping the others
                code = f"{type(e).__name__}: {e}"
            out.append({"role": role, "pid": srv.pid, "port": srv.port, "exit_code": code,
                        "survivors": srv.survivors()})
        return out[::-1]

    def ports_free(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if all(_port_free(p) for p in self.ports):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def _metrics(srv: Any) -> dict[str, float]:
    try:
        return srv.metrics()
    except Exception:  # noqa: BLE001 - figures from /metrics are extra; a missing one is left out
        return {}


def _since(after: dict, before: dict) -> dict:
    """Counters, sums and counts of ``after`` less those of ``before`` (what one run added)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _warm(url: str, vocab_size: int, timeout_s: float = 120.0) -> None:
    """One short greedy request, not measured: the first request's one-off costs stay out of the run
    (through the proxy it also crosses the KV link once)."""
    import urllib.request

    body = {"model": _first_model(url), "prompt": [(7 * i + 3) % max(2, vocab_size) for i in range(40)], "max_tokens": 4,
            "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        if r.status != 200:
            raise RuntimeError(f"the warm-up request to {url} got HTTP {r.status}")


def _first_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/models", timeout=30) as r:
        return json.loads(r.read().decode())["data"][0]["id"]


def _mean_ms(m: dict, name: str) -> float | None:
    n = m.get(f"vllm:{name}_count")
    return 1000.0 * m[f"vllm:{name}_sum"] / n if n else None


def _server_side(m: dict) -> dict:
    """A server's own view of its requests, from its ``/metrics``."""
    return {"requests": int(m.get("vllm:e2e_request_latency_seconds_count", 0)),
            "prompt_tokens": int(m.get("vllm:prompt_tokens_total", 0)),
            "prompt_tokens_from_connector": int(m.get("vllm:external_prefix_cache_hits_total", 0)),
            "prompt_tokens_from_prefix_cache": int(m.get("vllm:prefix_cache_hits_total", 0)),  # the connector's blocks too
            "ttft_mean_ms": _mean_ms(m, "time_to_first_token_seconds"),
            "prefill_mean_ms": _mean_ms(m, "request_prefill_time_seconds"),
            "e2e_mean_ms": _mean_ms(m, "e2e_request_latency_seconds")}


def _health(base: str) -> dict:
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return json.loads(r.read().decode())
    except Exception:  # noqa: BLE001
        return {}


def compare(model: str | None = None, num_requests: int = 12, rate: float = 1.0, dataset: str = "sharegpt-like",
            seed: int = 0, scale: float = 0.5, max_prompt: int = 256, max_output: int = 32, vocab_size: int = 49152,
            slo_ttft_ms: float = 2000.0, slo_tpot_ms: float = 400.0, serve_args: list[str] | None = None,
            startup_timeout_s: float = 600.0, timeout_s: float = 600.0, env: dict | None = None,
            progress: bool = True, log: Any = print) -> dict:
    """Both runs, one after the other; the JSON report as a dict. Every child is stopped before it returns or raises."""
    from ..model import resolve_model_path
    from ..server.launch import ServerProcess, free_port
    from .serve import run_load

    serve_args = list(serve_args or [])
    check_arguments(num_requests, rate, max_prompt, max_output, slo_ttft_ms, slo_tpot_ms, serve_args, startup_timeout_s)
    path = str(resolve_model_path(model))  # a missing model fails here, before any process starts
    load = dict(rate=rate, num_requests=num_requests, dataset=dataset, seed=seed, scale=scale, max_prompt=max_prompt,
                max_output=max_output, vocab_size=vocab_size, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                ignore_eos=True, timeout_s=timeout_s, progress=progress)
    children = Children()
    kw = dict(env=env, startup_timeout_s=startup_timeout_s, own_group=True)

    def server(**flags: Any) -> Any:
        srv = ServerProcess(path, **kw, **flags)
        srv.cmd += serve_args
        return srv

    reports: dict[str, dict] = {}
    side: dict[str, Any] = {}
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    error = None
    try:
        with _stop_on_sigterm():
            # 1. one colocated server
            t = time.perf_counter()
            srv = children.spawn(COLOCATED, server()).wait_ready()
            timings["colocated_startup_s"] = time.perf_counter() - t
            log(f"[1/2] colocated: {' '.join(srv.cmd[1:])} (ready in {timings['colocated_startup_s']:.0f} s)")
            _warm(srv.url, vocab_size)
            before = _metrics(srv)
            reports[COLOCATED] = run_load(srv.url, **load)
            side[COLOCATED] = {"server": _server_side(_since(_metrics(srv), before))}
            srv.stop()
            # 2. a producer and a consumer, started side by side (the consumer waits for the producer's link), then the proxy
            t = time.perf_counter()
            kv_port = free_port()
            prod = children.spawn("kv_producer", server(kv_transfer_config=_transfer_config(
                "kv_producer", kv_port, startup_timeout_s)), kv_port)
            cons = children.spawn("kv_consumer", server(kv_transfer_config=_transfer_config(
                "kv_consumer", kv_port, startup_timeout_s)))
            prod.wait_ready()
            cons.wait_ready()
            proxy = children.spawn("proxy", ServerProcess(command="proxy", prefill=prod.base, decode=cons.base, **kw))
            proxy.wait_ready()
            timings["disaggregated_startup_s"] = time.perf_counter() - t
            log(f"[2/2] disaggregated: producer :{prod.port}, consumer :{cons.port} (KV link on :{kv_port}), proxy "
                f":{proxy.port} (ready in {timings['disaggregated_startup_s']:.0f} s)")
            _warm(proxy.url, vocab_size)
            before = [_metrics(prod), _metrics(cons), _health(proxy.base)]
            reports[DISAGG] = run_load(proxy.url, **load)
            after = _health(proxy.base)
            side[DISAGG] = {"producer": _server_side(_since(_metrics(prod), before[0])),
                            "consumer": _server_side(_since(_metrics(cons), before[1])),
                            "proxy": {"requests": after.get("requests", 0) - before[2].get("requests", 0),
                                      "prefill_failures": after.get("prefill_failures", 0) - before[2].get("prefill_failures", 0),
                                      "last_prefill_error": after.get("last_prefill_error")}}
    except BaseException as e:  # noqa: BLE001 - stop the children first, then re-raise
        error = e
        raise
    finally:
        stopped = children.stop_all()
        free = children.ports_free()
        if error is not None:
            log(f"stopped {len(stopped)} process(es) after {type(error).__name__}; "
                f"{'none survives' if not any(p['survivors'] for p in stopped) else 'SOME SURVIVE'}; "
                f"ports {'free' if free else 'NOT free'}")
    return _report(reports, side, stopped, free, timings, time.perf_counter() - t_start, path, model, serve_args)


def _same_text(a: dict, b: dict) -> dict:
    ra, rb = a["_results"], b["_results"]
    both = [(x, y) for x, y in zip(ra, rb) if x.ok and y.ok]
    differ = [i for i, (x, y) in enumerate(zip(ra, rb)) if x.ok and y.ok and (x.text != y.text or x.output_len != y.output_len)]
    return {"compared": len(both), "equal": len(both) - len(differ), "differing_requests": differ}


def _report(reports: dict, side: dict, stopped: list, free: bool, timings: dict, wall: float, path: str,
            model: str | None, serve_args: list) -> dict:
    import torch

    c, d = reports[COLOCATED], reports[DISAGG]
    prod, cons = side[DISAGG]["producer"], side[DISAGG]["consumer"]
    col = side[COLOCATED]["server"]
    hop = None
    if None not in (d["ttft_ms"]["mean"], prod["e2e_mean_ms"], cons["ttft_mean_ms"]):
        # the client's TTFT through the proxy = the proxy's two round trips + the producer's whole request + the consumer's TTFT
        hop = d["ttft_ms"]["mean"] - prod["e2e_mean_ms"] - cons["ttft_mean_ms"]
    one_hop = (c["ttft_ms"]["mean"] - col["ttft_mean_ms"]) if None not in (c["ttft_ms"]["mean"], col["ttft_mean_ms"]) else None
    clean = {k: {kk: vv for kk, vv in r.items() if not kk.startswith("_")} for k, r in reports.items()}
    for k, r in reports.items():  # a load generator that was starved or paused sends late: say by how much
        clean[k]["max_send_lag_s"] = _send_lag(r)
    return {
        "what": "bench serve's load against one colocated minipaged serve, then the same requests against a kv_producer, "
                "a kv_consumer and minipaged proxy, all on this machine's CPU cores",
        "model": clean[COLOCATED]["settings"]["model"], "model_path": os.path.basename(path),
        "runs": clean,
        "same_greedy_text": _same_text(c, d),
        "server_side": side,
        "transfer": {"prompt_tokens": d.get("total_input_tokens"), "tokens_received_by_consumer": cons["prompt_tokens_from_connector"],
                     "consumer_prompt_tokens_computed": cons["prompt_tokens"] - cons["prompt_tokens_from_connector"],
                     "prefill_failures": side[DISAGG]["proxy"].get("prefill_failures")},
        "cost_ms": {"ttft_p50_added": _diff(d["ttft_ms"]["p50"], c["ttft_ms"]["p50"]),
                    "ttft_mean_added": _diff(d["ttft_ms"]["mean"], c["ttft_ms"]["mean"]),
                    "tpot_p50_added": _diff(d["tpot_ms"]["p50"], c["tpot_ms"]["p50"]),
                    "producer_prefill_mean": prod["prefill_mean_ms"], "colocated_prefill_mean": col["prefill_mean_ms"],
                    "consumer_prefill_mean": cons["prefill_mean_ms"],
                    "proxy_hops_mean": hop, "colocated_http_mean": one_hop},
        "processes": stopped, "all_stopped": not any(p["survivors"] for p in stopped), "ports_free": free,
        "timings_s": {**timings, "whole_run": wall},
        "serve_args": serve_args,
        "machine": {"platform": f"{platform.system()} {platform.machine()}", "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%d"),
    }


def _send_lag(report: dict) -> float:
    """The most any request was sent after its scheduled arrival time, in seconds."""
    from .serve import arrival_times

    st = report["settings"]
    rate = float(st["rate"])
    times = arrival_times(st["num_requests"], rate, st["arrival"], st["burst_size"], st["seed"])
    return max((r.send - t for r, t in zip(report["_results"], times)), default=0.0)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def format_table(res: dict) -> str:
    """The side-by-side table (markdown), one column a setup."""
    c, d = res["runs"][COLOCATED], res["runs"][DISAGG]
    slo = c["slo"]
    s = c["settings"]

    def good(r: dict) -> str:
        return f"{r['goodput']:.2f} ({r['goodput_fraction']:.0%} of requests)"

    rows = [("", LABELS[COLOCATED], LABELS[DISAGG]),
            ("requests ok / failed", f"{c['completed']} / {c['failed']}", f"{d['completed']} / {d['failed']}"),
            ("TTFT p50 / p99 (ms)", f"{_ms(c['ttft_ms']['p50'])} / {_ms(c['ttft_ms']['p99'])}",
             f"{_ms(d['ttft_ms']['p50'])} / {_ms(d['ttft_ms']['p99'])}"),
            ("TPOT p50 / p99 (ms)", f"{_ms(c['tpot_ms']['p50'])} / {_ms(c['tpot_ms']['p99'])}",
             f"{_ms(d['tpot_ms']['p50'])} / {_ms(d['tpot_ms']['p99'])}"),
            ("E2E latency p50 (ms)", _ms(c["e2el_ms"]["p50"]), _ms(d["e2el_ms"]["p50"])),
            (f"goodput (req/s; TTFT <= {slo['ttft_ms']:.0f} ms and TPOT <= {slo['tpot_ms']:.0f} ms, "
             f"over {s['num_requests']} / {s['rate']} req/s)", good(c), good(d)),
            ("output tokens/s (over the run's length)", f"{c['output_throughput']:.1f}", f"{d['output_throughput']:.1f}")]
    if "max_send_lag_s" in c:
        rows.append(("latest send behind its arrival time (s)", f"{c['max_send_lag_s']:.2f}", f"{d['max_send_lag_s']:.2f}"))
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "| --- | ---: | ---: |")
    return "\n".join(lines)


def statement(res: dict) -> str:
    """What this run can and cannot show, with its own figures."""
    same, tr, cost = res["same_greedy_text"], res["transfer"], res["cost_ms"]
    cpus = res["machine"]["cpus"]
    d = res["runs"][DISAGG]
    shown = [f"it works: {d['completed']} of {d['num_requests']} requests answered through the proxy "
             f"({tr['prefill_failures'] or 0} prefill failures), the consumer given {tr['tokens_received_by_consumer']} "
             f"of the {tr['prompt_tokens']} prompt tokens by the producer and computing {tr['consumer_prompt_tokens_computed']} "
             f"itself (each prompt's tokens past its last full block, at least its last token)",
             f"the same greedy text as the colocated server on {same['equal']} of {same['compared']} requests"]
    costs = []
    c = res["runs"][COLOCATED]
    if cost["ttft_p50_added"] is not None:
        costs.append(f"TTFT p50 {c['ttft_ms']['p50']:.0f} ms colocated, {d['ttft_ms']['p50']:.0f} ms through the proxy "
                     f"({cost['ttft_p50_added']:+.0f} ms)")
    if cost["producer_prefill_mean"] is not None and cost["colocated_prefill_mean"] is not None:
        costs.append(f"the producer's prefill {cost['producer_prefill_mean']:.0f} ms a request on average, sending the "
                     f"blocks and waiting for the consumer's acknowledgement included, against "
                     f"{cost['colocated_prefill_mean']:.0f} ms colocated")
    if cost["consumer_prefill_mean"] is not None:
        costs.append(f"the consumer's own prefill {cost['consumer_prefill_mean']:.0f} ms (loading the received blocks, "
                     f"then the last token)")
    if cost["proxy_hops_mean"] is not None and cost["colocated_http_mean"] is not None:
        costs.append(f"the proxy's two round trips {cost['proxy_hops_mean']:.0f} ms a request on average, against "
                     f"{cost['colocated_http_mean']:.0f} ms for the colocated server's one")
    shown.append("what the transfer and the extra hop cost: " + "; ".join(costs))
    faster = any(v is not None and v < 0 for v in (cost["ttft_p50_added"], cost["tpot_p50_added"]))
    why_faster = (" The disaggregated column came out faster on some figures, and that is no GPU effect either: two "
                  "engine processes can keep two cores busier than one engine's step loop does (a prefill on the "
                  "producer runs while the consumer decodes), and the two runs met different moments of a machine "
                  "other work shares." if faster else "")
    late = [f"{LABELS[k].split(' (')[0]} run by {r['max_send_lag_s']:.1f} s" for k, r in res["runs"].items()
            if r.get("max_send_lag_s", 0.0) > 1.0]
    if late:
        why_faster += (" The load generator fell behind its own schedule (" + ", ".join(late) + "): other work starved "
                       "or paused it, so the run's length, and the throughput over it, say more about the machine "
                       "than about either setup.")
    return (f"What this can and cannot show: the producer, the consumer and the proxy (and the load generator) run on the "
            f"same {cpus} CPU cores, so a prefill still takes the cores the decodes need. Disaggregation's benefit on GPUs "
            f"(decode steps free of prefill interference, each phase on hardware of its own) cannot appear here, and the "
            f"KV transfer goes over loopback (gloo on 127.0.0.1), so it crosses no real link: its cost here is copies "
            f"and system calls, not a network. A TPOT or goodput difference between the columns is the machine's, not "
            f"the design's. What the run does show: " + "; ".join(shown) + "." + why_faster)


def _load_line(res: dict) -> str:
    st = res["runs"][COLOCATED]["settings"]
    return (f"{st['num_requests']} requests ({st['dataset']}, scale {st['scale']}, prompts <= {st['max_prompt']}, "
            f"{st['max_output']} output tokens at most, EOS ignored, greedy; seed {st['seed']}), {st['arrival']} arrivals "
            f"at {st['rate']} req/s, the same for both; {res['model']}; {res['machine']['cpus']} CPU cores")


def format_result(res: dict) -> str:
    """What the command prints: the load, the table, the statement, and what was stopped."""
    stopped = f"processes stopped: {len(res['processes'])}, none left: {res['all_stopped']}, ports free: {res['ports_free']}"
    return "\n\n".join([_load_line(res), format_table(res), statement(res),
                         f"{stopped}; the whole run {res['timings_s']['whole_run']:.0f} s"])


def command_of(res: dict, json_path: str = "docs/figures/disagg_serve.json") -> str:
    """The command line that made ``res`` (its settings that differ from the defaults, and ``--json``)."""
    import shlex

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    defaults = vars(ap.parse_args([]))
    args = res.get("arguments", {})
    parts = ["minipaged", "bench", "disagg-serve"]
    for key in ("num_requests", "rate", "max_output"):  # always shown: the load's size
        parts += ["--" + key.replace("_", "-"), format(args.get(key, defaults[key]), "g")]
    for key, default in defaults.items():
        v = args.get(key, default)
        if key in ("num_requests", "rate", "max_output", "json", "progress") or v == default or v is None:
            continue
        parts += ["--" + key.replace("_", "-"), str(v)]
    if args.get("progress") is False:
        parts.append("--no-progress")
    parts += ["--json", json_path]
    return " ".join(shlex.quote(x) for x in parts)


def format_markdown(res: dict) -> str:
    """What the README shows: the command, the table, the statement (every figure from ``res``)."""
    m = res["machine"]
    head = (f"Command: `{command_of(res)}` ({res['model']}, {m['cpus']} CPU cores, torch {m['torch']}; measured "
            f"{res.get('when', '?')}, the whole run {res['timings_s']['whole_run']:.0f} s"
            + (f"; {res['note']}" if res.get("note") else "") + ").")
    st = res["runs"][COLOCATED]["settings"]
    load = (f"Both columns got the same {st['num_requests']} requests ({st['dataset']} lengths at scale {st['scale']}, "
            f"{st['max_output']} output tokens at most, EOS ignored, greedy; seed {st['seed']}) at the same Poisson "
            f"arrival times, {st['rate']} req/s, each after one unmeasured warm-up request.")
    stop = (f"Afterwards: {len(res['processes'])} processes stopped, none left (process groups checked): "
            f"{res['all_stopped']}; their ports free: {res['ports_free']}.")
    return "\n\n".join([head + " " + load, format_table(res), statement(res), stop])


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .serve import DATASETS, _rate

    p.description = ((__doc__ or "").strip().splitlines()[0].rstrip(".") + ". Starts and stops every server itself; the two runs "
                     "send the same requests at the same times.")
    p.add_argument("--model", default=None, help="a GGUF file or a model folder, served by every server (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=12, help="requests in each run (default 12)")
    p.add_argument("--rate", type=_rate, default=1.0, help="requests per second, Poisson arrivals (default 1; inf: all at once)")
    p.add_argument("--dataset", default="sharegpt-like", choices=sorted(DATASETS))
    p.add_argument("--scale", type=float, default=0.5, help="shrink the dataset's median lengths (default 0.5)")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=32, help="output tokens at most (EOS ignored; default 32)")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids in prompts stay below this (SmolLM2's vocabulary)")
    p.add_argument("--seed", type=int, default=0, help="the prompts and arrival times, the same for both runs (default 0)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput counts requests with TTFT at most this (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=400.0, help="... and TPOT at most this (default 400: a CPU's pace)")
    p.add_argument("--serve-args", default="", help='more flags for every server, e.g. "--max-num-seqs 16" (not the host, '
                                                    'port, model or KV connector: the bench sets those)')
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each server may take to answer /health (default 600)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take before what is left is cancelled")
    p.add_argument("--note", default=None, help="a note kept in the JSON, e.g. that the machine was shared")
    p.add_argument("--json", default=None, help="also write the report here (e.g. docs/figures/disagg_serve.json)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    import shlex

    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as e:
        raise ValueError(f"--serve-args is not a valid command line ({e}): quote it like \"--max-num-seqs 16\"") from None
    try:
        res = compare(model=args.model, num_requests=args.num_requests, rate=args.rate, dataset=args.dataset,
                      seed=args.seed, scale=args.scale, max_prompt=args.max_prompt, max_output=args.max_output,
                      vocab_size=args.vocab_size, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                      serve_args=serve_args, startup_timeout_s=args.startup_timeout, timeout_s=args.timeout,
                      progress=args.progress)
    except KeyboardInterrupt:
        print("minipaged bench disagg-serve: interrupted; the servers it started are stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as e:  # a server that would not start: its log's tail is in the message
        if isinstance(e, (FileNotFoundError, ValueError)):  # a missing model: the command line's usual error, status 2
            raise
        print(f"minipaged bench disagg-serve: error: {e}", file=sys.stderr)
        return 1
    if args.note:
        res["note"] = args.note
    print()
    print(format_result(res))
    save_run(res, args)
    ok = all(r["failed"] == 0 and r["completed"] for r in res["runs"].values()) and res["all_stopped"]
    return 0 if ok else 1


__all__ = ["compare", "check_arguments", "format_table", "format_result", "format_markdown", "command_of", "statement",
           "Children"]
