"""Colocated against disaggregated prefill on the simulated GPU: goodput under TTFT and TPOT SLOs, DistServe-style.

Owns this one comparison, on the step-cost model of ``minipaged.bench.gpu`` (a datasheet A100 and
OPT-13B by default; no real GPU). The same Poisson arrivals (ShareGPT-like lengths) are served by
two GPUs either way:

- **colocated**: each GPU serves half the requests (round robin) with continuous batching: every
  step runs its decodes and admits waiting prompts whole (prefill first, up to the token budget),
  so a long prefill stretches the decodes' step (the interference disaggregation removes);
- **disaggregated**: GPU 1 only prefills (the first token comes from there), then the prompt's KV
  crosses a link priced at ``prompt tokens x bytes per token / bandwidth`` (one transfer at a time),
  then GPU 2 only decodes.

TTFT is arrival to first token; TPOT is (last token - first token) / (output - 1), so a
transfer counts against TPOT. Goodput is the requests per second that meet both SLOs. Memory is
not modelled (at most ``max_num_seqs`` run per GPU). Disaggregation does not raise throughput: the
same two GPUs do the same work; it trades one GPU's prefill capacity for steadier decode steps.

Each GPU runs on the bench's one scheduler-on-a-clock loop (``clock.run_clock``) with :class:`OneGPU`
as its scheduler. The roles come from the requests alone: the prefill GPU's ask for one token (the
first), the decode GPU's arrive with their prompt's KV computed and their first token sampled
(:func:`arrived`).

    minipaged bench disagg [--rates 0.5,1,2,3,4] [--ttft-slo 1.0] [--tpot-slo 0.1] [--json docs/figures/disagg.json]
"""
from __future__ import annotations

import argparse

from ..data import ScheduledSeq, SchedulerOutput, Sequence
from . import save_run
from .clock import LengthStop, poisson_arrivals, run_clock

LINKS = {"nvlink": 300e9, "pcie4": 25e9, "rdma100": 12.5e9}  # bytes/s, one direction


def _arrivals(rate: float, n: int, seed: int, max_len: int) -> list[tuple[float, int, int]]:
    """(arrival time, prompt length, output length) of ``n`` requests: the bench's one Poisson
    process (``clock.poisson_arrivals``) and the simulated GPU's ShareGPT-like lengths."""
    from .gpu.datasets import sample_lengths

    times = poisson_arrivals(n, rate, seed)
    return [(t, max(1, int(p)), max(2, int(o))) for t, (p, o) in zip(times, sample_lengths("sharegpt", n, max_len=max_len, seed=seed))]


class OneGPU:
    """One GPU's scheduler for the clock (``clock.run_clock``): continuous batching, no memory model.
    Every step decodes one token of each running sequence, then admits waiting requests first come
    first served, each with all of its tokens not yet computed (a whole prompt; one token for a request
    whose prompt KV arrived computed), the first whatever its size and the others within ``budget``
    tokens, up to ``max_num_seqs`` running. Nothing is preempted or rejected."""

    def __init__(self, budget: int, max_num_seqs: int) -> None:
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add_request(self, seq: Sequence) -> bool:
        self.waiting.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        step = [ScheduledSeq.of(seq, 1) for seq in self.running]
        tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            n = self.waiting[0].num_tokens - self.waiting[0].num_computed_tokens
            if tokens and tokens + n > self.budget:
                break
            seq = self.waiting.pop(0)
            self.running.append(seq)
            step.append(ScheduledSeq.of(seq, n))
            tokens += n
        return SchedulerOutput(scheduled=step, num_batched_tokens=sum(s.num_new_tokens for s in step))

    def update(self, out: SchedulerOutput, sampled: dict) -> list[Sequence]:
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.append_token(sampled[s.seq.seq_id])
        out.finished = [seq for seq in self.running if seq.finish_reason is not None]
        self.running = [seq for seq in self.running if seq.finish_reason is None]
        return out.finished


def arrived(i: int, prompt_len: int, output_len: int) -> Sequence:
    """Request ``i`` as the decode GPU gets it (``run_clock``'s ``make_request``): its prompt's KV
    computed (it came over the link) and its first token sampled on the prefill GPU, so its first
    step there decodes; it stops after ``output_len`` tokens in all."""
    seq = Sequence(i, [0] * prompt_len, max_tokens=output_len, ignore_eos=True, num_computed_tokens=prompt_len)
    seq.stop_checker = LengthStop(seq)
    seq.stop_checker.advance(1)  # the first token, from the prefill GPU
    return seq


def simulate(system: str, rate: float, n: int = 200, seed: int = 0, gpu: str = "a100-40gb", model: str = "opt-13b",
             link: str = "nvlink", budget: int = 2048, max_num_seqs: int = 64, max_len: int = 2048) -> dict:
    """TTFT and TPOT of every request of one run (``system``: "colocated" or "disaggregated")."""
    from .gpu.cost import StepCostModel

    cost = StepCostModel(gpu, model)
    arr = _arrivals(rate, n, seed, max_len)
    times = [t for t, _, _ in arr]
    lengths = [(p, o) for _, p, o in arr]
    out: dict[int, tuple[float, float]] = {}
    if system == "colocated":
        for g in range(2):  # round robin: GPU g serves requests g, g + 2, ...
            ks = range(g, n, 2)
            run = run_clock(OneGPU(budget, max_num_seqs), [lengths[k] for k in ks], [times[k] for k in ks], cost)
            for j, k in enumerate(ks):
                out[k] = (run.first_token[j], run.finish[j])
    elif system == "disaggregated":
        pre = run_clock(OneGPU(budget, max_num_seqs), [(p, 1) for p, _ in lengths], times, cost)  # the first token
        bw = LINKS[link]
        link_free, ready = 0.0, [0.0] * n
        for k in sorted(range(n), key=lambda k: pre.finish[k]):  # one transfer at a time, as the prefills finish
            link_free = max(link_free, pre.finish[k]) + lengths[k][0] * cost.kv_per_token / bw
            ready[k] = link_free
        dec = run_clock(OneGPU(budget, max_num_seqs), lengths, ready, cost, make_request=arrived)
        for k in range(n):
            out[k] = (pre.first_token[k], dec.finish[k])
    else:
        raise ValueError(f"system must be colocated or disaggregated, got {system!r}")
    rows = []
    for k, (t, p, o) in enumerate(arr):
        first, last = out[k]
        rows.append({"ttft": first - t, "tpot": (last - first) / (o - 1), "finish": last})
    return {"rows": rows, "duration": max(r["finish"] for r in rows) - arr[0][0], "transfer_bytes_per_token": cost.kv_per_token}


def goodput(res: dict, ttft_slo: float, tpot_slo: float) -> float:
    ok = sum(1 for r in res["rows"] if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo)
    return ok / res["duration"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_sweep(rates=(0.5, 1, 2, 3, 4), ttft_slo: float = 1.0, tpot_slo: float = 0.1, n: int = 200, seed: int = 0,
              gpu: str = "a100-40gb", model: str = "opt-13b", links=("nvlink", "pcie4", "rdma100")) -> dict:
    out = {"gpu": gpu, "model": model, "gpus": 2, "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo}, "requests": n,
           "links_bytes_per_s": {k: LINKS[k] for k in links}, "rows": []}
    for rate in rates:
        row = {"rate": rate}
        systems = [("colocated", "nvlink")] + [("disaggregated", link) for link in links]
        for system, link in systems:
            res = simulate(system, rate, n, seed, gpu, model, link)
            name = system if system == "colocated" else f"disagg_{link}"
            ttft, tpot = [r["ttft"] for r in res["rows"]], [r["tpot"] for r in res["rows"]]
            row[name] = {"goodput": goodput(res, ttft_slo, tpot_slo), "throughput": n / res["duration"],
                         "ttft_p90": _pct(ttft, 0.9), "tpot_p90": _pct(tpot, 0.9)}
            out["kv_bytes_per_token"] = res["transfer_bytes_per_token"]
        best = max((k for k in row if k != "rate"), key=lambda k: row[k]["goodput"])
        row["wins"] = best
        out["rows"].append(row)
    return out


def format_sweep(r: dict) -> str:
    names = [k for k in r["rows"][0] if k not in ("rate", "wins")]
    head = (f"{r['model']} on 2 x {r['gpu']} (simulated), SLO TTFT <= {r['slo']['ttft_s']} s and TPOT <= "
            f"{r['slo']['tpot_s']} s; transfer {r['kv_bytes_per_token'] / 1e6:.2f} MB per prompt token over "
            + ", ".join(f"{k} {v / 1e9:g} GB/s" for k, v in r["links_bytes_per_s"].items()))
    lines = [head, "rate  " + "  ".join(f"{n:>22}" for n in names) + "  wins (goodput)"]
    for row in r["rows"]:
        cells = [f"{row[n]['goodput']:5.2f} req/s ({row[n]['throughput']:4.2f})" for n in names]
        lines.append(f"{row['rate']:4g}  " + "  ".join(f"{c:>22}" for c in cells) + f"  {row['wins']}")
    lines.append("goodput (throughput) in requests/s; disaggregation does not raise throughput: the same two GPUs do "
                 "the same work")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="0.5,1,2,3,4", help="request rates (req/s), comma-separated")
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tpot-slo", type=float, default=0.1)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--gpu", default="a100-40gb")
    p.add_argument("--model", default="opt-13b")
    p.add_argument("--json", help="also write the figures to this file (e.g. docs/figures/disagg.json)")


def run(a: argparse.Namespace) -> int:
    rates = [float(x) for x in a.rates.split(",") if x.strip()]
    r = run_sweep(rates, a.ttft_slo, a.tpot_slo, a.requests, gpu=a.gpu, model=a.model)
    print(format_sweep(r))
    save_run(r, a)
    return 0


__all__ = ["simulate", "goodput", "run_sweep", "format_sweep", "LINKS", "OneGPU", "arrived"]
