#!/usr/bin/env python
"""How long `minipaged grade` takes for a class: N learners x the course's workbooks.

Builds a class folder of copies of solutions/ (two learners in three) and exercises/ (the
others, unsolved), grades it with `minipaged grade --jobs J`, and prints the wall-clock time,
the mean time per workbook, and whether the grades came out as built (solved: every check
passes; unsolved: none does).

    python scripts/bench_grading.py                       # 30 learners x all workbooks, --jobs = cores, bwrap if present
    python scripts/bench_grading.py --workbooks 7         # 30 learners x workbooks 01-07
    python scripts/bench_grading.py --learners 5 --jobs 2 --no-sandbox
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", type=int, default=30)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workbooks", type=int, default=0, metavar="K", help="only the first K workbooks (default: all)")
    p.add_argument("--no-sandbox", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="build the class and write the grades here (default: a temp folder)")
    args = p.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="minipaged-bench-grading-"))
    cls, out = work / "class", work / "out"
    shutil.rmtree(cls, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    solved = {}
    for i in range(args.learners):
        name = f"learner{i:02d}"
        solved[name] = i % 3 != 2
        (cls / name).mkdir(parents=True)
        books = sorted((ROOT / ("solutions" if solved[name] else "exercises")).glob("*.ipynb"))
        for nb in books[: args.workbooks or None]:
            shutil.copy(nb, cls / name / nb.name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "minipaged.checks.grading", str(cls), "--csv", str(out / "grades.csv"), "--overwrite",
           "--jobs", str(args.jobs)] + (["--no-sandbox"] if args.no_sandbox else [])
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    rows = [json.loads(line) for line in (out / "grades.jsonl").read_text().splitlines() if line.strip()]
    wrong = []
    by = defaultdict(list)
    for r in rows:
        if not r["check"].startswith("("):
            by[(r["learner"], r["workbook"])].append(r["result"])
    for (learner, wb), results in sorted(by.items()):
        ok = all(x in ("pass", "skip") for x in results)
        none = not any(x == "pass" for x in results)
        if (solved[learner] and not ok) or (not solved[learner] and not none):
            wrong.append(f"{learner}/{wb}: {results}")
    n = len(by)
    sandboxed = "without a sandbox" not in proc.stderr
    print(f"{args.learners} learners x {n // max(1, args.learners)} workbooks = {n} submissions graded in {wall / 60:.1f} min "
          f"(--jobs {args.jobs}, {'bwrap' if sandboxed else 'no sandbox'}, {os.cpu_count()} cores): "
          f"{wall / max(1, n):.1f} s per workbook on average")
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) {load0:.1f} at the start, {load1:.1f} at the end: other work on the machine slows this")
    print(f"grades as built: {'yes' if not wrong else 'NO: ' + '; '.join(wrong[:5])}")
    print(f"grader exit status {proc.returncode}; class and grades in {work}")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
