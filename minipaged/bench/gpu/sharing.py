"""The paper's §6.3-6.5 on the simulated GPU: parallel sampling, beam search, a shared prefix, a chatbot.

Owns the sharing experiments of ``minipaged bench paper`` (``--parallel-samples``,
``--beam-width``, ``--shared-prefix``, ``--chatbot``). Every system serves the same trace
through minipaged's ``Scheduler`` and ``BlockAllocator`` on the bench's one clock loop, every
request arriving at once, and its max rate is the rate requests complete at while the queue is
full (:func:`capacity`: where §6.2's latency curves turn up; reading it off long Poisson curves,
as :mod:`.paper` does for Fig. 12, would take too long for ten workloads here):

* **parallel sampling** (Fig. 14a, Alpaca, OPT-13B): each request asks for ``n`` samples. vLLM
  computes the prompt once and forks its samples from it (``seq.forks``: the blocks shared,
  their reference counts raised, the last partial block copied on write);
* **beam search** (Fig. 14b): each request is a beam search of width ``W``, run by minipaged's
  own beam rule (``minipaged.beam_search.BeamGroup``: the ``2W`` best continuations of each
  beam, the ``W`` best of all kept, a beam with ``k`` children forked ``k - 1`` times, a beam
  with none freed at once). No model runs, so each beam's next-token logits are drawn at
  random (i.i.d. standard normal over a vocabulary of ``VOCAB``, seeded per request): the
  assumption that decides how often beams part, stated here and in the JSON;
* **shared prefix** (Fig. 16, WMT16 En-De, LLaMA-13B): every prompt starts with the same
  few-shot prefix, 80 tokens (one-shot) or 341 (five-shot), as §6.4 gives them. vLLM keeps the
  prefix's blocks in its prefix cache, so later prompts share them and skip computing them;
* **chatbot** (Fig. 17, OPT-13B): the conversation so far is the prompt, cut to 1,024 tokens,
  the answer at most 1,024 (``datasets.py``'s ``chatbot``). Nothing is shared: it is the
  reservation baselines' waste on long prompts.

The Orca baselines share nothing, as in the paper: a request of ``n`` samples or ``W`` beams is
``n`` (``W``) sequences, each with its own prompt and its own reservation, and every prompt
(its prefix too) is computed and reserved whole. The memory saved by sharing is the paper's
measure (Fig. 15): over vLLM's steps, the blocks its running block tables would need without
sharing less the physical blocks they hold, over the former (``beam_search.SharingCounter``),
with the queue full (the loaded system).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable

import numpy as np

from ...beam_search import BeamGroup, BeamSearchParams, SharingCounter
from ...sequence import FinishReason, Sequence, SequenceStatus
from ..clock import LengthStop, poisson_arrivals
from .cost import DEFAULT_CALIBRATION, StepCostModel, memory_plan
from .datasets import get_dataset, sample_lengths
from .policies import SYSTEMS
from .simulator import Setting, build_scheduler
from .simulator import pool_map as _pool_map
from .simulator import run as serve
from .specs import get_gpu, get_model

SHARING_SYSTEMS = ("orca_max", "orca_pow2", "orca_oracle", "vllm")
PREFIX_TOKENS = {"one-shot": 80, "five-shot": 341}  # §6.4, Fig. 16's caption
VOCAB = 1000  # the random logits' vocabulary (beam search): the 2W best of it are each beam's candidates
# The experiments: the paper's model and dataset for each, and its figure.
EXPERIMENTS = {
    "parallel": {"model": "opt-13b", "dataset": "alpaca", "figure": "Fig. 14a / 15"},
    "beam": {"model": "opt-13b", "dataset": "alpaca", "figure": "Fig. 14b / 15"},
    "prefix": {"model": "llama-13b", "dataset": "wmt16", "figure": "Fig. 16"},
    "chatbot": {"model": "opt-13b", "dataset": "chatbot", "figure": "Fig. 17"},
}
# What the paper reports (Kwon et al., SOSP 2023, §6.3-6.5), vLLM over Orca (Oracle) unless said.
PAPER = {
    "basic_gain": 1.3,  # Fig. 14's starting point: basic sampling on Alpaca
    "beam_gain": {6: 2.3},  # "from 1.3x in basic sampling to 2.3x in beam search with a width of 6"
    "memory_saved": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},  # Fig. 15, Alpaca
    "prefix_gain": {"one-shot": 1.67, "five-shot": 3.58},  # Fig. 16
    "chatbot_gain": 2.0,  # Fig. 17: over all three Orca baselines
}


@dataclass(frozen=True)
class Workload:
    """One workload: ``kind`` basic, parallel (``width`` samples), beam (``width`` beams), prefix
    (``prefix_tokens`` shared) or chatbot."""

    kind: str
    width: int = 1
    prefix_tokens: int = 0

    @property
    def label(self) -> str:
        return {"basic": "basic sampling", "parallel": f"parallel sampling, n={self.width}",
                "beam": f"beam search, width {self.width}", "chatbot": "chatbot",
                "prefix": f"shared prefix, {self.prefix_tokens} tokens"}[self.kind]


def workloads(experiment: str, values: Iterable) -> list[Workload]:
    """The workloads of ``experiment`` for each of ``values`` (a clear error for one it cannot take)."""
    out = []
    for v in values:
        if experiment in ("parallel", "beam"):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{experiment}: {v!r} is not a number of {'samples' if experiment == 'parallel' else 'beams'}"
                                 " >= 1: give e.g. 2,4,6")
            out.append(Workload("basic" if v == 1 else experiment, int(v)))
        elif experiment == "prefix":
            if v not in PREFIX_TOKENS:
                raise ValueError(f"shared prefix {v!r}: one of {', '.join(PREFIX_TOKENS)}")
            out.append(Workload("prefix", 1, PREFIX_TOKENS[v]))
        elif experiment == "chatbot":
            out.append(Workload("chatbot"))
        else:
            raise ValueError(f"unknown experiment {experiment!r}: {', '.join(EXPERIMENTS)}")
    return out


# -- the requests -------------------------------------------------------------------------------
def _prompt(i: int, p: int, prefix: int) -> list[int]:
    """Request ``i``'s prompt: the shared prefix (the same ids for everyone), then ids its own."""
    return list(range(1, prefix + 1)) + [100_000 + i] * (p - prefix) if prefix else [0] * p


def _seq(seq_id: Any, i: int, prompt: list[int], o: int, max_len: int) -> Sequence:
    seq = Sequence(seq_id, prompt, max_tokens=o, ignore_eos=True)
    seq.request = i
    seq.stop_checker = LengthStop(seq, max_len)
    return seq


class SimBeams:
    """Beam search on the clock: each request a ``BeamGroup`` (minipaged's beam rule), its logits
    drawn at random. ``make`` builds a request's first beam (holding seats for the others);
    ``after_update`` hands each beam that computed its last token its logits and, once all of a
    group's live beams have theirs, takes one step of the rule (forks and drops on the
    scheduler's tables); it returns the beams that finished."""

    def __init__(self, scheduler: Any, width: int, max_len: int, seed: int) -> None:
        self.scheduler, self.width, self.max_len, self.seed = scheduler, width, max_len, seed
        self.rng: dict = {}

    def make(self, i: int, prompt: list[int], o: int) -> Sequence:
        seq = Sequence(i, prompt, max_tokens=o, ignore_eos=True)
        seq.request = i
        seq.stop_checker = LengthStop(seq, self.max_len)
        req = SimpleNamespace(seq=seq, samples=[seq])
        seq.beam = BeamGroup(req, BeamSearchParams(beam_width=self.width, max_tokens=o, ignore_eos=True), (),
                             self.max_len)
        seq.forks = [Sequence(f"{i}#seat{k}", prompt, max_tokens=o) for k in range(1, self.width)]
        for f in seq.forks:
            f.request = i
        self.rng[i] = np.random.default_rng((self.seed, i))
        return seq

    def after_update(self, out: Any, finished: list) -> list:
        import torch

        groups = {}
        for s in out.scheduled:
            q = s.seq
            g = getattr(q, "beam", None)
            if g is None or q.status is not SequenceStatus.RUNNING or q.num_computed_tokens < q.num_tokens:
                continue
            i = q.request
            g.observe(q, torch.from_numpy(self.rng[i].standard_normal(VOCAB)).float())
            groups[id(g)] = (i, g)
        done = []
        for i, g in groups.values():
            if not g.ready():
                continue
            new, gone = g.advance(self.scheduler)
            for q in new:
                q.request = i
            done += [q for q in gone if q.finish_reason is not FinishReason.ABORT]
            if g.done:
                self.rng.pop(i, None)
        return done


def simulate(setting: Setting, work: Workload, system: str, rate: float, n: int, seed: int,
             parts: dict | None = None) -> tuple[Any, dict]:
    """``n`` requests of ``work`` at ``rate`` through ``system``: its SimResult, and (vLLM) the
    memory its sharing saved over the run's steps (``SharingCounter.as_dict``)."""
    spec = setting.spec()
    plan = memory_plan(setting.gpu, spec, setting.memory_bytes, max_num_batched_tokens=setting.max_num_batched_tokens,
                       max_num_seqs=setting.max_num_seqs)
    max_len = setting.max_len()
    pre = work.prefix_tokens
    reqs = [(p + pre, o) for p, o in sample_lengths(setting.dataset, n, max_len=max_len - pre, seed=seed)]
    arr = poisson_arrivals(n, rate, seed=seed)
    paged = SYSTEMS[system].reservation is None
    sched = build_scheduler(system, plan.kv_tokens, setting.block_size, max_len, setting.max_num_seqs,
                            setting.max_num_batched_tokens, prefix_caching=paged and pre > 0, **(parts or {}))
    cost = StepCostModel(setting.gpu, spec, DEFAULT_CALIBRATION)
    width = work.width if work.kind in ("parallel", "beam") else 1
    beams = SimBeams(sched, width, max_len, seed) if paged and work.kind == "beam" else None

    def make(i: int, p: int, o: int):
        prompt = _prompt(i, p, pre)
        if beams is not None:
            return beams.make(i, prompt, o)
        first = _seq(i, i, prompt, o, max_len)
        others = [_seq(f"{i}#{k}", i, prompt, o, max_len) for k in range(1, width)]
        if paged:  # vLLM: the samples are forked from the prompt once it is computed
            first.forks = others
            return first
        return [first, *others]  # Orca: n sequences, each its own prompt and reservation

    if not paged:
        return serve(sched, reqs, arr, cost, system, rate, skip_ahead=True, make_request=make, keep_batches=True), {}
    counter = SharingCounter()

    def on_step(out: Any, finished: list, t: float) -> None:
        counter.add(q.block_table.blocks for q in sched.running if q.block_table is not None)

    r = serve(sched, reqs, arr, cost, system, rate, skip_ahead=False, make_request=make, on_step=on_step, keep_batches=True,
              after_update=beams.after_update if beams is not None else None)
    return r, counter.as_dict()


def capacity(r: Any) -> float:
    """The most requests per second a system serves, read off a run where every request arrived at
    once: the rate they complete at between the 20% and the 70% finished (the queue is still full
    then; the warm-up and the tail are left out)."""
    ft = sorted(x for x in r.finish_times if x == x)
    a, b = int(0.2 * len(ft)), int(0.7 * len(ft))
    if b <= a or ft[b] <= ft[a]:
        raise ValueError(f"{len(ft)} finished requests are too few to read a rate from: simulate more")
    return (b - a) / (ft[b] - ft[a])


def _task(args: tuple) -> tuple:
    setting, work, system, n, seed, parts = args
    t0 = time.process_time()
    r, sharing = simulate(setting, work, system, 1e9, n, seed, parts)
    return work, system, r, sharing, time.process_time() - t0


def reproduce_sharing(experiment: str, values: Iterable, gpu: str = "a100-40gb", model: str | None = None,
                      dataset: str | None = None, systems: Iterable[str] = SHARING_SYSTEMS, num_requests: int = 600,
                      block_size: int = 16, memory_gb: float | None = None, seed: int = 0, workers: int | None = None,
                      parts: dict | None = None) -> dict:
    """One of the paper's §6.3-6.5 experiments for each of ``values`` (numbers of samples or beams,
    ``one-shot``/``five-shot``, or ``["chatbot"]``): the JSON ``minipaged bench paper`` writes.

    Each system serves the same ``num_requests`` requests, all arriving at once, and its max rate
    is the rate they complete at while the queue is full (:func:`capacity`): the rate its latency
    curve turns up at, which the paper reads off curves of long Poisson traces (§6.2's method,
    :mod:`.paper`), too long to run per workload here. ``model``/``dataset`` default to the paper's."""
    t0 = time.time()
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}: {', '.join(EXPERIMENTS)}")
    systems = list(systems)
    for s in systems:
        if s not in SHARING_SYSTEMS:
            raise ValueError(f"system {s!r} is not in the sharing experiments: {', '.join(SHARING_SYSTEMS)}")
    works = workloads(experiment, list(values))
    if not works:
        raise ValueError(f"{experiment}: give at least one value")
    if num_requests < 10:
        raise ValueError(f"num_requests={num_requests}: simulate at least 10 requests to read a rate")
    exp = EXPERIMENTS[experiment]
    g, m, d = get_gpu(gpu), get_model(model or exp["model"]), get_dataset(dataset or exp["dataset"])
    setting = Setting(g.name, m.name, d.name, block_size, None if memory_gb is None else int(memory_gb * (1 << 30)),
                      seed=seed)
    plan = memory_plan(g, m, setting.memory_bytes)
    if plan.kv_tokens < setting.max_len():
        raise ValueError(f"the KV cache holds {plan.kv_tokens} tokens, less than one {setting.max_len()}-token sequence "
                         f"of {m.name}: the reservation baselines could not run one request; pick more memory")
    for w in works:
        if w.width > setting.max_num_seqs:
            raise ValueError(f"{w.label}: more sequences than max_num_seqs={setting.max_num_seqs} run at once")
        if w.prefix_tokens >= setting.max_len() - 1:
            raise ValueError(f"a {w.prefix_tokens}-token prefix leaves no room in {m.name}'s {setting.max_len()} tokens")
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    tasks = [(setting, w, s, num_requests, seed + 100, parts) for w in works for s in systems]
    tasks.sort(key=lambda t: (t[2] != "vllm", -t[1].width))  # the slow runs (vLLM's, with sharing) first
    results = _pool_map(_task, tasks, workers)
    out: dict[str, Any] = {"experiment": experiment, "figure": exp["figure"], "runs": []}
    for w in works:
        run: dict[str, Any] = {"workload": w.label, "kind": w.kind, "width": w.width, "prefix_tokens": w.prefix_tokens,
                               "systems": {}}
        for s in systems:
            r, sh = next((r, sh) for ww, ss, r, sh, _ in results if ww == w and ss == s)
            entry = {"label": SYSTEMS[s].label, "max_rate": capacity(r), "mean_batched_sequences":
                     sum(r.batch_sizes) / len(r.batch_sizes) if r.batch_sizes else 0.0,
                     "throughput_tokens": r.throughput_tokens, "preemptions": r.num_preemptions,
                     "rejected": r.rejected, "num_requests": r.num_requests}
            if s == "vllm":
                entry["sharing"] = sh
            run["systems"][s] = entry
        v = run["systems"].get("vllm")
        if v:
            run["gains"] = {f"vllm_over_{s}": v["max_rate"] / e["max_rate"] for s, e in run["systems"].items()
                            if s != "vllm"}
            run["memory_saved"] = v["sharing"]["saving"]
        run["paper"] = paper_figures(w)
        out["runs"].append(run)
    out["settings"] = {
        "gpu": g.name, "model": m.name, "dataset": d.name, "block_size": block_size, "num_requests": num_requests,
        "max_num_seqs": setting.max_num_seqs, "max_num_batched_tokens": setting.max_num_batched_tokens,
        "max_len": setting.max_len(), "seed": seed, "trace_seed": seed + 100,
        "max_rate_measure": "every request arrives at once; the rate they complete at between 20% and 70% finished",
        "memory_plan": plan.__dict__, "calibration": DEFAULT_CALIBRATION.__dict__,
        "lengths": {"input": d.input.__dict__, "output": d.output.__dict__, "source": d.source,
                    "input_cap": d.input_cap, "output_cap": d.output_cap},
        "beam_logits": f"i.i.d. standard normal over {VOCAB} tokens, seeded per request (no model runs)",
        "orca_sharing": "none: each sample or beam is its own sequence with its own prompt and reservation",
        "memory_saved_measure": "over vLLM's steps: (blocks its running tables would need without sharing - "
                                "physical blocks they hold) / the former (beam_search.SharingCounter)",
        "reservation_placement": "buddy (policies.BuddySpans)",
        "parts": {k: getattr(v, "__name__", str(v)) for k, v in (parts or {}).items()},
        "wall_seconds": round(time.time() - t0, 1), "cpu_seconds": round(sum(c for *_, c in results), 1),
        "workers": workers,
    }
    return out


def paper_figures(w: Workload) -> dict:
    """What the paper reports for ``w`` (empty where it gives no number)."""
    if w.kind == "basic":
        return {"gain_over_orca_oracle": PAPER["basic_gain"]}
    if w.kind == "parallel":
        return {"memory_saved_range": list(PAPER["memory_saved"]["parallel"]),
                "gain_over_orca_oracle": "grows with n from basic sampling's 1.3x (Fig. 14a, no number given)"}
    if w.kind == "beam":
        d = {"memory_saved_range": list(PAPER["memory_saved"]["beam"])}
        if w.width in PAPER["beam_gain"]:
            d["gain_over_orca_oracle"] = PAPER["beam_gain"][w.width]
        else:
            d["gain_over_orca_oracle"] = "between 1.3x (basic) and 2.3x (width 6) (Fig. 14b, no number given)"
        return d
    if w.kind == "prefix":
        key = next(k for k, v in PREFIX_TOKENS.items() if v == w.prefix_tokens)
        return {"gain_over_orca_oracle": PAPER["prefix_gain"][key]}
    return {"gain_over_each_orca": PAPER["chatbot_gain"]}


def format_table(res: dict) -> str:
    st = res["settings"]
    rows = [f"{res['figure']}: {st['model']} on {st['gpu']}, {st['dataset']}; max rate (req/s): {st['num_requests']} "
            "requests at once, the rate they complete at with the queue full",
            f"{'workload':<32} " + " ".join(f"{SYSTEMS[s].label:>14}" for s in res["runs"][0]["systems"])
            + f" {'gain/Oracle':>12} {'saved':>7}"]
    for run in res["runs"]:
        g = run.get("gains", {}).get("vllm_over_orca_oracle")
        saved = run.get("memory_saved")
        rows.append(f"{run['workload']:<32} " + " ".join(f"{e['max_rate']:>14.3f}" for e in run["systems"].values())
                    + f" {(f'{g:.2f}x' if g is not None else '-'):>12} {(f'{100 * saved:.1f}%' if saved is not None else '-'):>7}")
    return "\n".join(rows)


def readme_rows(results: list[dict]) -> list[str]:
    """The README's sharing table's rows (one per workload of each result), beside the paper's numbers."""
    rows = []
    for res in results:
        st = res["settings"]
        for run in res["runs"]:
            gains, p = run.get("gains", {}), run["paper"]
            o = gains.get("vllm_over_orca_oracle")
            others = [gains.get(f"vllm_over_{s}") for s in ("orca_max", "orca_pow2")]
            pg = p.get("gain_over_orca_oracle", p.get("gain_over_each_orca"))
            pg = f"{pg:g}x" if isinstance(pg, (int, float)) else ("-" if pg is None else "grows")
            saved = run.get("memory_saved")
            rng = p.get("memory_saved_range")
            rows.append(f"| {res['figure']} | {st['model']}, {st['dataset']} | {run['workload']} | "
                        f"{run['systems']['vllm']['max_rate']:.2f} | {o:.2f}x | {pg} | "
                        + " / ".join(f"{x:.2f}x" for x in others if x is not None) + " | "
                        + (f"{100 * saved:.1f}%" if saved is not None and run["kind"] != "chatbot" else "-") + " | "
                        + (f"{100 * rng[0]:.1f}-{100 * rng[1]:.1f}%" if rng else "-") + " |")
    return rows


STORED = ("parallel", "beam", "prefix", "chatbot")  # docs/figures/paper_sharing_<experiment>.json
MARKERS = ("<!-- paper_sharing:begin -->", "<!-- paper_sharing:end -->")


def readme_block(results: list[dict]) -> str:
    """The README's table of the sharing experiments, from results of :func:`reproduce_sharing`."""
    n = {r["settings"]["num_requests"] for r in results}
    head = [f"Simulated on {results[0]['settings']['gpu']}, {'/'.join(map(str, sorted(n)))} requests per system and "
            "workload, all at once (`minipaged bench paper --parallel-samples 1,2,4,6`, `--beam-width 2,4,6`, "
            "`--shared-prefix one-shot,five-shot`, `--chatbot`; stored in docs/figures/paper_sharing_*.json). max rate: "
            "the rate vLLM completes requests at with its queue full; gains: that over each Orca's; memory saved: the "
            "blocks vLLM's sharing saves over the blocks its tables would need without it.", "",
            "| figure | model, dataset | workload | vLLM max rate (req/s) | gain over Orca (Oracle) | paper's gain | "
            "gain over Orca (Max) / (Pow2) | memory saved | paper's memory saved |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    return "\n".join(head + readme_rows(results))


def update_readme(readme: Any, results: list[dict]) -> bool:
    """Rewrite the text between the README's sharing markers from ``results``."""
    from pathlib import Path

    p = Path(readme)
    text = p.read_text(encoding="utf-8")
    b, e = MARKERS
    if b not in text or e not in text:
        return False
    head, rest = text.split(b, 1)
    _, tail = rest.split(e, 1)
    p.write_text(head + b + "\n" + readme_block(results) + "\n" + e + tail, encoding="utf-8")
    return True


def run_cli(a: Any) -> int:
    """``minipaged bench paper`` with one of the sharing flags."""
    chosen = [(k, v) for k, v in (("parallel", a.parallel_samples), ("beam", a.beam_width),
                                  ("prefix", a.shared_prefix), ("chatbot", ["chatbot"] if a.chatbot else None)) if v]
    if len(chosen) != 1:
        raise SystemExit("give one of --parallel-samples, --beam-width, --shared-prefix, --chatbot at a time")
    experiment, values = chosen[0]
    systems = [s.strip() for s in a.systems.split(",") if s.strip()] if a.systems else list(SHARING_SYSTEMS)
    systems = [s for s in systems if s != "fastertransformer"]  # the default list names it; §6.3-6.5 leave it out
    res = reproduce_sharing(experiment, values, a.gpu, a.model, a.dataset, systems,
                            600 if a.num_requests is None else a.num_requests, a.block_size,
                            a.memory_gb, a.seed, a.workers)
    print(format_table(res))
    from .. import save_run

    save_run(res, a)
    if a.readme:  # the README's table from the stored runs, this one in its place
        import json
        from pathlib import Path

        here = Path(a.json).parent if a.json else Path("docs/figures")
        runs = {k: here / f"paper_sharing_{k}.json" for k in STORED}
        results = [res if k == experiment else json.loads(runs[k].read_text()) for k in STORED
                   if k == experiment or runs[k].exists()]
        print(f"{'updated' if update_readme(a.readme, results) else 'no sharing markers in'} {a.readme}")
    return 0


def parse_prefixes(text: str) -> list[str]:
    """``one-shot,five-shot`` -> the list, with a clear error for a name the paper does not use."""
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in PREFIX_TOKENS]
    if not vals or bad:
        raise ValueError(f"{text!r}: give one-shot, five-shot or both (comma-separated)")
    return vals


def parse_counts(text: str) -> list[int]:
    """``2,4,6`` -> [2, 4, 6], with a clear error for anything else."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r}: give whole numbers separated by commas, e.g. 2,4,6") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{text!r}: give numbers >= 1, e.g. 2,4,6")
    return vals


__all__ = ["EXPERIMENTS", "PAPER", "PREFIX_TOKENS", "SHARING_SYSTEMS", "SimBeams", "Workload", "format_table",
           "paper_figures", "readme_block", "readme_rows", "update_readme", "reproduce_sharing", "simulate", "workloads"]
