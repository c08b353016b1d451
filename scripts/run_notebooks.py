"""Execute the lessons top to bottom, store them with their outputs, and time each one.

    python scripts/run_notebooks.py                     # every notebooks/NN_*.ipynb (what `make notebooks` runs)
    python scripts/run_notebooks.py notebooks/03_page_table.ipynb
    python scripts/run_notebooks.py --check             # execute, write nothing; exit 1 on an error or a blown budget

Widgets are rendered as static pictures (MINIPAGED_STATIC=1), so the stored notebooks show
every plot on a repository page. Each lesson's install cell is stamped first
(scripts/stamp_colab.py). A lesson that fails keeps its previously stored version and the
script exits 1. Timings go to notebooks/timings.md (a table for the README): the budget is
two minutes a lesson and ten for all of them on 2 CPU cores. Running some lessons replaces
their rows and keeps the others (the table says which rows were re-measured).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

LESSON_BUDGET_S = 120.0
TOTAL_BUDGET_S = 600.0


def lessons(paths: list[str]) -> list[Path]:
    if not paths:
        return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.glob("[0-9][0-9]_*.ipynb")) if p.is_dir() else [p]
    return [p.resolve() for p in out]


def _cell_seconds(cell) -> float | None:
    ex = cell.get("metadata", {}).get("execution", {})
    a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
    if not (a and b):
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(b) - parse(a)).total_seconds()


def execute(path: Path, timeout: int) -> tuple[object, float, tuple[float, int, str]]:
    """Run one notebook in a fresh kernel; return (notebook, seconds, (slowest cell s, index, first line))."""
    import nbformat
    from nbclient import NotebookClient

    import stamp_colab

    raw = json.loads(path.read_text(encoding="utf-8"))
    stamp_colab.stamp(raw)  # the install cell first, as every lesson must start
    nb = nbformat.reads(stamp_colab.dumps(raw), as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=True,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    slowest = (0.0, -1, "")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        s = _cell_seconds(cell)
        if s is not None and s > slowest[0]:
            slowest = (s, i, _gist(cell.source))
        cell.metadata.pop("execution", None)  # timestamps would make every run a diff
        cell.outputs = coalesce_streams(cell.outputs)
    return nb, seconds, slowest


def _gist(source: str) -> str:
    """The first line of a cell that does something (not an import, a comment or a magic)."""
    lines = [ln.strip() for ln in source.splitlines() if ln.strip()]
    for ln in lines:
        if not ln.startswith(("#", "%", "import ", "from ")):
            return ln[:60]
    return lines[0][:60] if lines else ""


def coalesce_streams(outputs: list) -> list:
    """Merge consecutive stdout (or stderr) pieces, e.g. a streamed answer, into one output."""
    merged: list = []
    for o in outputs:
        if (o.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == o.get("name")):
            merged[-1]["text"] += o["text"]
        else:
            merged.append(o)
    return merged


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def _stored_rows(path: Path) -> dict[str, tuple[float | None, str]]:
    """The lesson rows of an existing timings table: name -> (seconds, slowest cell)."""
    out: dict[str, tuple[float | None, str]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 4 and cols[0].startswith("`") and cols[0].endswith("`"):
            secs = None if cols[1] == "failed" else float(cols[1])
            out[cols[0].strip("`")] = (secs, cols[3])
    return out


def merge_timings(rows: list[tuple[str, float | None, str]], path: Path) -> list[tuple[str, float | None, str]]:
    """The stored table's rows with the lessons just run replaced (or added), in lesson order."""
    merged = {name: (s, slow) for name, (s, slow) in _stored_rows(path).items()}
    merged.update({name: (s, slow) for name, s, slow in rows})
    return [(name, *merged[name]) for name in sorted(merged)]


def write_timings(rows: list[tuple[str, float | None, str]], path: Path, partial: list[str] | None = None) -> None:
    total = sum(s for _, s, _ in rows if s is not None)
    lines = [
        "# Lesson timings",
        "",
        f"Measured by `scripts/run_notebooks.py` (`make notebooks`) on {machine()}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d}. Each lesson runs top to bottom in a fresh kernel, "
        "the default model included; the budget is 2 minutes a lesson and 10 for all of them.",
        "",
    ]
    if partial:
        lines += [f"Re-measured on that day: {', '.join(f'`{n}`' for n in partial)}; the other rows are from an earlier "
                  "full run (the total adds rows measured on different days).", ""]
    lines += [
        "| lesson | seconds | within 2 min | slowest cell |",
        "|---|---:|:---:|---|",
    ]
    for name, s, slow in rows:
        if s is None:
            lines.append(f"| `{name}` | failed | ✗ | {slow} |")
        else:
            lines.append(f"| `{name}` | {s:.0f} | {'✓' if s <= LESSON_BUDGET_S else '✗'} | {slow} |")
    lines.append(f"| **all lessons** | **{total:.0f}** | {'✓' if total <= TOTAL_BUDGET_S else '✗'} (10 min) | |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="lessons or folders (default: notebooks/NN_*.ipynb)")
    ap.add_argument("--check", action="store_true", help="execute only: store nothing, write no timings")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default 600)")
    ap.add_argument("--timings", type=Path, default=NOTEBOOKS / "timings.md")
    a = ap.parse_args(argv)

    import nbformat

    os.environ["MINIPAGED_STATIC"] = "1"  # the kernels inherit it: widgets draw their static picture
    # On a shared machine, OpenMP threads spinning for a descheduled sibling make small matmuls
    # many times slower (and timings meaningless); waiting passively costs little when idle.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    paths = lessons(a.paths)
    if not paths:
        print("no lessons found", file=sys.stderr)
        return 1
    rows: list[tuple[str, float | None, str]] = []
    failed = over = False
    for path in paths:
        print(f"{path.name} ...", end=" ", flush=True)
        try:
            nb, seconds, (slow_s, slow_i, slow_src) = execute(path, a.timeout)
        except Exception as e:  # noqa: BLE001 - reported, the other lessons still run
            failed = True
            msg = str(e).strip().splitlines()
            print("FAILED\n" + "\n".join("    " + ln for ln in msg[-12:]))
            rows.append((path.stem, None, (msg[-1] if msg else type(e).__name__)[:80].replace("|", "/")))
            continue
        slow = f"cell {slow_i}: {slow_s:.0f} s (`{slow_src.replace('`', '')}`)" if slow_i >= 0 else ""
        flag = "" if seconds <= LESSON_BUDGET_S else f"  OVER the {LESSON_BUDGET_S:.0f} s budget"
        over |= bool(flag)
        print(f"{seconds:.0f} s (slowest {slow}){flag}")
        rows.append((path.stem, seconds, slow))
        if not a.check:
            nbformat.write(nb, path)
    total = sum(s for _, s, _ in rows if s is not None)
    print(f"all: {total:.0f} s" + ("" if total <= TOTAL_BUDGET_S else f"  OVER the {TOTAL_BUDGET_S:.0f} s budget"))
    over |= total > TOTAL_BUDGET_S
    if not a.check and not failed:
        # a full run writes the table; a run of some lessons replaces their rows and keeps the others
        write_timings(rows if not a.paths else merge_timings(rows, a.timings), a.timings,
                      partial=None if not a.paths else [name for name, _, _ in rows])
        print(f"wrote {a.timings.relative_to(ROOT) if a.timings.is_relative_to(ROOT) else a.timings}")
    elif not a.check:
        print("(timings.md is written only when the lessons run without error)")
    return 1 if failed or (a.check and over) else 0


if __name__ == "__main__":
    sys.exit(main())
