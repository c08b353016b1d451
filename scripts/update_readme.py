"""Regenerate the README's generated blocks from files in the repo.

- badges:  the lessons' "Open in Colab" links, from minipaged.colab.REPO_URL and notebooks/
- timings: notebooks/timings.md, written by scripts/run_notebooks.py (`make notebooks`)
- bench:   docs/figures/bench.json, written by `make bench` (minipaged bench --json ...)

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


def badges_block() -> str:
    rows = ["| lesson | open | workbook |", "| --- | --- | --- |"]
    workbooks = {p.name[:2]: p for p in sorted((ROOT / "exercises").glob("*.ipynb"))}
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        rel = nb.relative_to(ROOT).as_posix()
        wb = workbooks.get(nb.name[:2])
        wb_cell = f"[{wb.name}]({wb.relative_to(ROOT).as_posix()}) [![Colab]({BADGE})]({colab_badge_url(wb.relative_to(ROOT).as_posix())})" if wb else "-"
        rows.append(f"| [{_title(nb)}]({rel}) | [![Open In Colab]({BADGE})]({colab_badge_url(rel)}) | {wb_cell} |")
    return "\n".join(rows)


def timings_block() -> str:
    p = ROOT / "notebooks" / "timings.md"
    return p.read_text().strip() if p.exists() else "(run `make notebooks` to measure)"


def bench_block() -> str:
    p = ROOT / "docs" / "figures" / "bench.json"
    if not p.exists():
        return "(run `make bench` to measure)"
    r = json.loads(p.read_text())
    from minipaged.bench.serving import format_table

    w, kb, c = r["workload"], r["kv_budget"], r["ceiling"]
    lines = [
        f"Command: `{r.get('command', 'minipaged bench')}` on {r['machine']['cpus']} CPU cores, "
        f"torch {r['machine']['torch']}, model {r['model']['name']} (fp32).",
        "",
        f"Workload: {w['description']}.",
        f"KV budget for static and continuous alike: {kb['mib']:.0f} MiB ({kb['note']}).",
        "",
        "```",
        format_table(r),
        "```",
        "",
        f"- continuous batching: **{r['systems']['continuous'].get('x_static', 0):.2f}x** static batching and "
        f"**{r['systems']['continuous'].get('x_naive', 0):.2f}x** naive in output tokens/s"
        + (f"; **{r['systems']['continuous']['output_tokens_per_s'] / r['systems']['hf']['output_tokens_per_s']:.2f}x** `transformers.generate`"
           f" at batch {r['systems']['hf']['peak_concurrent_seqs']}" if "hf" in r["systems"] else "")
        + ".",
        f"- KV waste: paged **{r['systems']['continuous']['kv_waste'] * 100:.1f}%** vs contiguous max-length "
        f"reservation **{r['systems']['static']['kv_waste'] * 100:.1f}%**.",
        f"- Same KV memory: paged held **{r.get('concurrency_ratio', 0):.1f}x** as many sequences at once"
        + (" (every request of the workload at once: the pool had room for more)"
           if r["systems"]["continuous"]["peak_concurrent_seqs"] == w["num_requests"] else "") + ".",
        f"- This machine's fp32 GEMM runs at {c['gemm_gflops']:.0f} GFLOP/s: a compute-bound limit of "
        f"{c['compute_bound_tokens_per_s']:.0f} tokens/s for this model; continuous batching reached "
        f"{r['systems']['continuous']['fraction_of_compute_bound'] * 100:.0f}% of it.",
    ]
    if "naive" in r["systems"] and r["systems"]["naive"].get("note"):
        lines.append(f"- naive: {r['systems']['naive']['note']}.")
    return "\n".join(lines)


BLOCKS = {"badges": badges_block, "timings": timings_block, "bench": bench_block}


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
