"""Regenerate the README's generated blocks from files in the repo.

- badges:  the lessons' "Open in Colab" links, from minipaged.colab.REPO_URL and notebooks/
- timings: notebooks/timings.md, written by scripts/run_notebooks.py (`make notebooks`)
- bench:   docs/figures/bench.json, written by `make bench` (minipaged bench --json ...)
- bench_quick: docs/figures/bench_quick.json, written by
           `minipaged bench --quick --no-progress --json docs/figures/bench_quick.json`
- bench_quick_fp32: docs/figures/bench_quick_fp32.json, written by
           `minipaged bench --quick --fp32-weights --no-progress --json docs/figures/bench_quick_fp32.json`
- speed:   docs/figures/speed.json, written by `minipaged bench speed --json docs/figures/speed.json`
- ablation: docs/figures/ablation.json, written by `minipaged bench ablation --json docs/figures/ablation.json`
- profile: docs/figures/profile.json, written by `minipaged bench profile --json docs/figures/profile.json`
- tp:      docs/figures/tp.json, written by `minipaged bench tp --json docs/figures/tp.json`
- spec:    docs/figures/spec.json, written by `minipaged bench spec --json docs/figures/spec.json`
- disagg_serve: docs/figures/disagg_serve.json, written by
           `minipaged bench disagg-serve --json docs/figures/disagg_serve.json`

Usage: python scripts/update_readme.py [--check]   (--check: exit 1 if the README is stale)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minipaged.colab import colab_badge_url  # noqa: E402

BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def _title(nb: Path) -> str:
    try:
        cells = json.loads(nb.read_text())["cells"]
        for c in cells:
            if c["cell_type"] == "markdown":
                for line in "".join(c["source"]).splitlines():
                    if line.startswith("# "):
                        return line[2:].strip()
    except (OSError, ValueError, KeyError):
        pass
    return nb.stem.replace("_", " ")


def _workbook_of(nb: Path) -> Path | None:
    """The workbook a lesson's closing cell sends the learner to (``exercises/NN_name.ipynb``), if it
    exists: lesson 12's workbook is 09, and lessons 00, 09, 10, 11 have none."""
    try:
        cells = json.loads(nb.read_text())["cells"]
        last = next(c for c in reversed(cells) if c["cell_type"] == "markdown")
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    m = re.search(r"exercises/([0-9][0-9]_\w+\.ipynb)", "".join(last["source"]))
    p = ROOT / "exercises" / m.group(1) if m else None
    return p if p is not None and p.exists() else None


def badges_block() -> str:
    rows = ["| lesson | open | workbook |", "| --- | --- | --- |"]
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        rel = nb.relative_to(ROOT).as_posix()
        wb = _workbook_of(nb)
        wb_cell = f"[{wb.name}]({wb.relative_to(ROOT).as_posix()}) [![Colab]({BADGE})]({colab_badge_url(wb.relative_to(ROOT).as_posix())})" if wb else "-"
        rows.append(f"| [{_title(nb)}]({rel}) | [![Open In Colab]({BADGE})]({colab_badge_url(rel)}) | {wb_cell} |")
    return "\n".join(rows)


def timings_block() -> str:
    p = ROOT / "notebooks" / "timings.md"
    return p.read_text().strip() if p.exists() else "(run `make notebooks` to measure)"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def bench_block(name: str = "bench.json", pictures: bool = True) -> str:
    p = ROOT / "docs" / "figures" / name
    if not p.exists():
        return "(run `make bench` to measure)" if name == "bench.json" else f"(no docs/figures/{name} yet)"
    r = json.loads(p.read_text())
    from minipaged.bench.serving import format_attribution, format_online, format_table

    w, kb, c, S = r["workload"], r["kv_budget"], r["ceiling"], r["systems"]
    lines = [
        f"Command: `{r.get('command', 'minipaged bench')}` on {r['machine']['cpus']} CPU cores, "
        f"torch {r['machine']['torch']}, model {r['model']['name']} (fp32)"
        + (f"; the whole bench took {r['bench_seconds'] / 60:.0f} min" if r.get("bench_seconds") else "") + ".",
        "",
        f"Workload: {w['description']}.",
        f"KV budget, the same for every minipaged system: {kb['blocks']} blocks of {kb['block_size']} tokens = "
        f"{kb['mib']:.0f} MiB ({kb['note']}).",
        "",
        "```",
        format_table(r),
        "```",
        "",
    ]
    att = r.get("attribution", {})
    if att:
        lines += [
            "What each idea buys (ratios of output tokens/s; each changes one thing):",
            "",
            "| gain | ratio | cells compared |",
            "| --- | --- | --- |",
        ]
        for key, a in att.items():
            lines.append(f"| {a['isolates']} | **{a['ratio']:.2f}x** | {a['of'].replace('_', ' ')} |")
        lines.append("")
    tok = r.get("tokens")
    if tok:
        bad = {k: v for k, v in tok["systems"].items() if v["equal"] != v["compared"]}
        lines.append(f"- Greedy tokens: " + ("every system produced the same tokens as "
                     f"{tok['reference']} on every request compared." if not bad else
                     "; ".join(f"{k} matched {tok['reference']} on {v['equal']} of {v['compared']} requests" for k, v in bad.items()) + "."))
    if "continuous_paged" in S and "static_contiguous" in S:
        sp_w = f" and {S['static_paged']['kv_waste'] * 100:.1f}% (static)" if "static_paged" in S else ""
        lines.append(f"- KV waste: paged **{S['continuous_paged']['kv_waste'] * 100:.1f}%** (continuous){sp_w} vs contiguous max-length reservation "
                     f"**{S['static_contiguous']['kv_waste'] * 100:.1f}%**; the same memory held "
                     f"**{r.get('concurrency_ratio', 0):.1f}x** as many sequences at once.")
    if "naive" in S:
        lines.append(f"- continuous_paged: **{_x(S.get('continuous_paged', {}).get('x_naive'))}** naive"
                     + (f", **{S['continuous_paged']['output_tokens_per_s'] / S['hf']['output_tokens_per_s']:.2f}x** "
                        f"`transformers.generate` at batch {S['hf']['peak_concurrent_seqs']}" if "hf" in S and "continuous_paged" in S else "")
                     + "." + (f" naive: {S['naive']['note']}; {S['naive']['latency_note']}." if S["naive"].get("note") else ""))
    rf = r.get("roofline")
    if rf:
        meas = rf.get("measured_compute_bound_batch")
        lines.append(
            f"- This machine: fp32 GEMM {c['gemm_gflops']:.0f} GFLOP/s, memory read {rf['bandwidth']['read_GBps']:.1f} GB/s "
            f"(copy {rf['bandwidth']['copy_GBps']:.1f} GB/s), ridge {rf['ridge_flops_per_byte']:.1f} flops/byte: decode turns "
            f"compute-bound at batch ~{rf['predicted_compute_bound_batch']:.0f} by the roofline, "
            + (f"~{meas:.0f} measured" if meas else "not within the batches measured")
            + f". Compute-bound limit {c['compute_bound_tokens_per_s']:.0f} tokens/s for this model; continuous_paged reached "
            f"{S.get('continuous_paged', {}).get('fraction_of_compute_bound', 0) * 100:.0f}% of it.")
    if r.get("online"):
        lines += ["", "Online arrivals (Poisson), for the four systems:", "", "```", format_online(r), "```"]
    sp = r.get("shared_prefix")
    if sp and sp.get("measured"):
        lines += ["", "Shared system prompt, prefix caching on vs off:", "", "```", json.dumps(sp, indent=1), "```"]
    shown = [(png, alt) for png, alt in FIGURES if (ROOT / "docs" / "figures" / png).exists()] if pictures else []
    if shown:
        lines.append("")
        lines += [f"![{alt}](docs/figures/{png})" for png, alt in shown]
    return "\n".join(lines)


# The bench's pictures, in the order the README shows them (those the last run wrote).
FIGURES = [
    ("attribution.png", "what paging and refilling each buy"),
    ("online.png", "online arrivals: throughput, TTFT and goodput against the request rate"),
    ("roofline.png", "the decode roofline of this machine"),
    ("throughput.png", "throughput"),
    ("timeline.png", "who holds each batch slot"),
    ("kv_usage.png", "KV reserved vs used"),
]


def speed_block() -> str:
    p = ROOT / "docs" / "figures" / "speed.json"
    if not p.exists():
        return "(run `minipaged bench speed --json docs/figures/speed.json` to measure)"
    from minipaged.bench.speed import format_summary

    res = json.loads(p.read_text())
    m = res.get("machine", {})
    systems = res.get("arguments", {}).get("systems", "minipaged,transformers,batch1")
    extra = "" if systems == "minipaged,transformers,batch1" else f" --systems {systems}"
    head = (f"Command: `minipaged bench speed{extra} --json docs/figures/speed.json` on {m.get('cpus', '?')} CPU cores, "
            f"torch {m.get('torch', '?')}, {m.get('threads', '?')} threads.")
    return head + "\n\n```\n" + format_summary(res).strip() + "\n```"


def profile_block() -> str:
    p = ROOT / "docs" / "figures" / "profile.json"
    if not p.exists():
        return "(run `minipaged bench profile --json docs/figures/profile.json` to measure)"
    from minipaged.bench.profile import format_markdown

    res = json.loads(p.read_text())
    head = (f"Command: `minipaged bench profile --max-tokens {res.get('max_tokens')} --json docs/figures/profile.json` "
            f"({res.get('threads')} threads, attention {res.get('attention')!r}).")
    return head + "\n\n" + format_markdown(res).strip()


def bench_quick_block() -> str:
    return bench_block("bench_quick.json", pictures=False)


def bench_quick_fp32_block() -> str:
    return bench_block("bench_quick_fp32.json", pictures=False)


def ablation_block() -> str:
    p = ROOT / "docs" / "figures" / "ablation.json"
    if not p.exists():
        return "(run `minipaged bench ablation --json docs/figures/ablation.json` to measure)"
    from minipaged.bench.ablation import format_markdown

    res = json.loads(p.read_text())
    m = res.get("machine", {})
    head = (f"Command: `minipaged bench ablation --json docs/figures/ablation.json` ({res['num_requests']} chat requests x "
            f"{res['max_tokens']} tokens, greedy; {m.get('cpus', '?')} threads, torch {m.get('torch', '?')}; measured "
            f"{res.get('when', '?')}, one process, rung after rung).")
    return head + "\n\n" + format_markdown(res).strip()


def spec_block() -> str:
    p = ROOT / "docs" / "figures" / "spec.json"
    if not p.exists():
        return ("(run `minipaged bench spec --json docs/figures/spec.json` then `python scripts/update_readme.py` "
                "to measure)")
    from minipaged.bench.spec import format_goals, format_markdown

    res = json.loads(p.read_text())
    m, c = res.get("machine", {}), res["speculative_config"]
    head = (f"Command: `minipaged bench spec --json docs/figures/spec.json` ({res['max_tokens']} new tokens a request, "
            f"greedy, EOS ignored; batch 1: {res['batch1_requests']} request(s) served one at a time; each side the best of "
            f"{res['repeats']} interleaved run(s); `speculative_config={{\"method\": \"{c['method']}\", "
            f"\"num_speculative_tokens\": {c['num_speculative_tokens']}, \"prompt_lookup_max\": {c['prompt_lookup_max']}, "
            f"\"prompt_lookup_min\": {c['prompt_lookup_min']}}}`, back-off on; {m.get('cpus', '?')} threads, torch "
            f"{m.get('torch', '?')}; measured {res.get('when', '?')}). Workloads: "
            + "; ".join(f"**{k}**: {v}" for k, v in res.get("workloads", {}).items()) + ".")
    lines = [head, "", format_markdown(res).strip(), "",
             f"- Greedy tokens equal with speculation on and off, in every run: **{res['greedy_equal']}**.",
             f"- Goals: {format_goals(res)}.",
             f"- Route: {res['route']}."]
    return "\n".join(lines)


def tp_block() -> str:
    p = ROOT / "docs" / "figures" / "tp.json"
    if not p.exists():
        return "(run `minipaged bench tp --json docs/figures/tp.json` to measure)"
    from minipaged.bench.tp import format_table

    res = json.loads(p.read_text())
    sizes = list(res["by_size"])
    head = (f"Command: `minipaged bench tp --json docs/figures/tp.json` ({res['model']}, {res['batch']} greedy requests x "
            f"{res['max_tokens']} tokens, decode steps only; rank 0 runs {res['threads']} torch threads and each worker 1, "
            "all on the same CPU cores). The milliseconds depend on what else those cores are running: read the shares "
            "and ratios (time inside the all-reduces against the whole step, bytes measured against predicted), not the "
            "absolute times.")
    lines = [head, "", format_table(res), ""]
    if len(sizes) > 1:
        one, n = res["by_size"][sizes[0]], res["by_size"][sizes[-1]]
        k, ratio = sizes[-1], n["seconds_per_step"] / one["seconds_per_step"]
        ar = n["all_reduce_seconds_per_step"]
        lines.append(f"- N = {k}: **{ar / n['seconds_per_step']:.0%}** of each decode step inside the all-reduces; "
                     f"{ratio:.2f}x the time of N = {sizes[0]} per step. "
                     + ("The ranks share the same cores, so the arithmetic is not divided, only interleaved, and every "
                        "all-reduce waits for the slowest rank." if ratio >= 1 else
                        "A ratio below 1 cannot come from the split (the same cores do the same total arithmetic): "
                        f"it comes from how the operating system divides the cores among every running process, of "
                        f"which N = {k} has {k}. The all-reduce share is the cost of the split either way."))
        lines.append(f"- Bytes all-reduced per token: {n['all_reduce_bytes_per_token']:,.0f} measured, "
                     f"{res['predicted_all_reduce_bytes_per_token']:,} predicted ({res['rule']}).")
    return "\n".join(lines)


def disagg_serve_block() -> str:
    p = ROOT / "docs" / "figures" / "disagg_serve.json"
    if not p.exists():
        return "(run `minipaged bench disagg-serve --json docs/figures/disagg_serve.json` to measure)"
    from minipaged.bench.disagg_serve import format_markdown

    return format_markdown(json.loads(p.read_text()))


def validation_block() -> str:
    """The simulated GPU's cost model against this CPU (scripts/validate_simgpu_cpu.py)."""
    p = ROOT / "docs" / "figures" / "simgpu_cpu_validation.json"
    if not p.exists():
        return "(run `python scripts/validate_simgpu_cpu.py` to measure)"
    r = json.loads(p.read_text())
    m, c, t = r["machine"], r["calibration"], r["target_error"]
    if r.get("linear_profile"):
        how = (f"the linear layers and attention priced by their measured times on this CPU (profiles of the route's "
               f"own operators, not of the engine), one calibration for every row (step overhead "
               f"{c['step_overhead_s'] * 1e3:.1f} ms, {c['seq_overhead_s'] * 1e3:.2f} ms a sequence, "
               f"{c.get('token_overhead_s', 0.0) * 1e3:.3f} ms a token)")
    else:
        how = (f"one calibration for every row (step overhead {c['step_overhead_s'] * 1e3:.1f} ms, "
               f"{c['seq_overhead_s'] * 1e3:.2f} ms a sequence, {c['compute_efficiency']:.2f} of the GEMM rate, "
               f"bandwidth as measured)")
    lines = [f"`{r['settings']['command']}` on this CPU (read {m['read_GBps']:.1f} GB/s, fp32 GEMM "
             f"{m['gemm_GFLOPs']:.0f} GFLOP/s), {r['model']['name']} on the plain route; {how}; target: within {t:.0%}.",
             "", "| what | measured | predicted | error |", "| --- | ---: | ---: | ---: |"]
    for s in r["steps"]:
        if s["role"] == "validation":
            lines.append(f"| decode step, batch {s['batch']} | {s['measured_s'] * 1e3:.1f} ms | {s['predicted_s'] * 1e3:.1f} ms "
                         f"| {s['error']:+.0%} |")
    w = r["workload"]
    lines.append(f"| {w['requests']} requests through the simulated scheduler | {w['measured']['tokens_per_s']:.1f} tok/s "
                 f"| {w['simulated']['tokens_per_s']:.1f} tok/s | {w['simulated']['error']:+.0%} |")
    for name, cell in (r.get("factorial") or {}).get("cells", {}).items():
        lines.append(f"| factorial bench: {name} | {cell['measured']['tokens_per_s']:.1f} tok/s "
                     f"| {cell['predicted']['tokens_per_s']:.1f} tok/s | {cell['error']:+.0%} |")
    lines.append("")
    lines.append(f"Within {t:.0%} everywhere: {'yes' if r['within_target'] else 'no'} "
                 f"(worst {r['worst_validation_error']:.1%}).")
    d = r.get("drift_between_passes")
    if d:
        lines.append(f"Each figure is the mean of two passes, one early and one late in the run; this machine itself "
                     f"drifted between them by up to {d.get('decode', 0):.0%} on a decode step and "
                     f"{d.get('factorial', 0):.0%} on a factorial cell, the noise floor any prediction here sits on.")
    return "\n".join(lines)


BLOCKS = {"badges": badges_block, "ablation": ablation_block, "timings": timings_block, "bench": bench_block, "bench_quick": bench_quick_block,
          "bench_quick_fp32": bench_quick_fp32_block,
          "speed": speed_block,
          "profile": profile_block,
          "tp": tp_block,
          "spec": spec_block,
          "disagg_serve": disagg_serve_block,
          "simgpu_validation": validation_block}


def render(text: str) -> str:
    for name, fn in BLOCKS.items():
        pat = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"README.md has no <!-- {name}:start --> ... <!-- {name}:end --> block")
        text = pat.sub(lambda m: m.group(1) + fn() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    old = readme.read_text()
    new = render(old)
    if "--check" in argv:
        if new != old:
            print("README.md is out of date: run `python scripts/update_readme.py`")
            return 1
        return 0
    readme.write_text(new)
    print("README.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
