"""Grade the course's workbooks: run each one and score its check cells.

    minipaged grade PATH... [--csv FILE] [--timeout S]

A PATH is a workbook (``02_block_allocator.ipynb``), or a folder of a class's submissions:
either one sub-folder per learner (``class/alice/02_block_allocator.ipynb``) or files named
by learner (``class/alice_02_block_allocator.ipynb``, ``02_block_allocator (bob).ipynb``).
Each workbook is executed top to bottom in a fresh kernel (nbclient, kernel ``python3``,
the notebook's folder as working directory), then every **check cell** (a code cell that
starts with ``# CHECK``, tagged ``check``) becomes one line of the scoreboard:

    pass    the check ran and printed its success line
    FAIL    the check raised CheckFailed / NotImplementedYet / CheckTimeout: the first line says why
    skip    the check could not run here and said so (e.g. Triton missing on macOS)
    ERROR   the cell crashed otherwise (a NameError because an earlier cell failed, ...)

A code cell that is not a check and crashes is listed too (as ``cell N``), since every
check after it usually fails for that reason. A file that is not a notebook, or a notebook
that cannot be read, is reported as ``broken`` and the others are still graded.

The same cells are tests for pytest: ``pytest --nbval-lax exercises/02_block_allocator.ipynb``
grades one workbook, one test per code cell, and only check cells fail on correct code.

``--csv FILE`` writes the scoreboard (learner, workbook, check, result, message, file);
``--timeout S`` is the limit per cell (default 600 s; a check also stops itself after its
own time limit). Workbook 07 reads a learner's workbooks 02-06 from the same folder: the
grader tells it whose they are (MINIPAGED_WORKBOOKS, MINIPAGED_LEARNER). The return code
is 0 when every check passed (or skipped), 1 otherwise, 2 when nothing could be graded.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .checks._workbooks import WORKBOOKS, check_name, identify, is_check_cell, learner_from_name

FAIL_NAMES = {"CheckFailed", "NotImplementedYet", "CheckTimeout", "AssertionError"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Submission:
    learner: str
    workbook: str  # a known workbook name, or the file's stem
    path: Path


@dataclass
class Row:
    learner: str
    workbook: str
    check: str
    result: str  # pass, FAIL, skip, ERROR, broken, missing
    message: str
    file: str

    @property
    def ok(self) -> bool:
        return self.result in ("pass", "skip")


# -- finding the submissions ------------------------------------------------------------------
def _learner(path: Path, root: Path | None, stem: str | None) -> str:
    from_name = learner_from_name(path.name, stem)
    if root is not None:
        rel = path.relative_to(root)
        if len(rel.parts) > 1:
            return rel.parts[0] if not from_name else f"{rel.parts[0]}/{from_name}"
        if from_name:
            return from_name
        return root.name
    return from_name or path.parent.resolve().name


def discover(paths: list[str]) -> tuple[list[Submission], list[Row]]:
    subs: list[Submission] = []
    rows: list[Row] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            rows.append(Row("?", path.name, "(file)", "broken", f"{p} does not exist", str(path)))
            continue
        if path.is_file():
            stem = identify(path.name)
            learner = _learner(path, None, stem)
            if path.suffix != ".ipynb":
                rows.append(Row(learner, stem or path.stem, "(file)", "broken",
                                f"not a notebook ({path.suffix or 'no extension'}): submit the .ipynb file "
                                "(File > Download > .ipynb)", str(path)))
                continue
            subs.append(Submission(learner, stem or path.stem, path))
            continue
        for f in sorted(path.rglob("*")):
            if not f.is_file() or ".ipynb_checkpoints" in f.parts or any(part.startswith(".") for part in f.relative_to(path).parts):
                continue
            stem = identify(f.name)
            if f.suffix == ".ipynb":
                subs.append(Submission(_learner(f, path, stem), stem or f.stem, f))
            elif stem is not None:  # named like a workbook, but not a notebook
                rows.append(Row(_learner(f, path, stem), stem or f.stem, "(file)", "broken",
                                f"not a notebook ({f.suffix or 'no extension'}): submit the .ipynb file", str(f)))
    return subs, rows


# -- running one workbook -------------------------------------------------------------------------
@contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_line(text: str) -> str:
    text = _ANSI.sub("", text or "").strip()
    return text.split("\n", 1)[0].strip()[:300] if text else ""


def _cell_result(cell) -> tuple[str, str]:
    err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
    if err is not None:
        ename = err.get("ename", "Error")
        msg = _first_line(err.get("evalue", "")) or ename
        if ename in FAIL_NAMES:
            return "FAIL", msg
        if ename in ("KeyboardInterrupt", "CellTimeoutError"):
            return "FAIL", f"stopped: the cell ran past the grader's time limit ({msg})"
        return "ERROR", f"{ename}: {msg}"
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    for line in _ANSI.sub("", text).splitlines():
        if line.startswith("SKIPPED"):
            return "skip", line.strip()
    return "pass", ""


def grade_notebook(sub: Submission, timeout: float = 600) -> list[Row]:
    """Execute one workbook and return one row per check cell (plus crashed non-check cells)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    def row(check: str, result: str, message: str) -> Row:
        return Row(sub.learner, sub.workbook, check, result, message, str(sub.path))

    try:
        nb = nbformat.read(sub.path, as_version=4)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return [row("(file)", "broken", f"not a readable notebook: {type(e).__name__}: {_first_line(str(e))}")]
    except Exception as e:  # nbformat's own validation and reader errors
        return [row("(file)", "broken", f"not a readable notebook: {type(e).__name__}: {_first_line(str(e))}")]
    checks = [i for i, c in enumerate(nb.cells) if is_check_cell(c)]
    if not checks:
        return [row("(file)", "broken", "no check cells: is this one of the course's workbooks?")]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
                            resources={"metadata": {"path": str(sub.path.parent.resolve())}})
    crash = ""
    with _env(MINIPAGED_WORKBOOKS=str(sub.path.parent.resolve()), MINIPAGED_LEARNER=sub.learner.split("/")[-1]):
        try:
            client.execute()
        except CellTimeoutError as e:
            crash = f"a cell ran past {timeout:.0f} s: {_first_line(str(e))}"
        except DeadKernelError as e:
            crash = f"the kernel died (out of memory, or a crash in native code): {_first_line(str(e))}"
        except Exception as e:
            crash = f"{type(e).__name__}: {_first_line(str(e))}"
    rows = []
    executed = True
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if is_check_cell(cell):
            name = check_name(cell, i)
            if cell.get("execution_count") is None and not cell.get("outputs"):
                rows.append(row(name, "ERROR", f"not run: {crash or 'the notebook stopped before this cell'}"))
                executed = False
                continue
            result, msg = _cell_result(cell)
            rows.append(row(name, result, msg))
        else:
            result, msg = _cell_result(cell)
            if result in ("ERROR", "FAIL"):
                rows.append(row(f"cell {i} (your code, not a check)", "ERROR", msg))
    if crash and executed:
        rows.append(row("(run)", "ERROR", crash))
    return rows


# -- the scoreboard -------------------------------------------------------------------------------
def _missing_rows(subs: list[Submission], file_rows: list[Row], by_folder: bool) -> list[Row]:
    """In a class folder, the workbooks someone submitted that a learner did not."""
    if not by_folder:
        return []
    seen: dict[str, set] = {}
    for s in subs:
        seen.setdefault(s.learner, set()).add(s.workbook)
    for r in file_rows:  # a broken file still counts as handed in
        seen.setdefault(r.learner, set()).add(r.workbook)
    all_wb = sorted({w for ws in seen.values() for w in ws if w in WORKBOOKS})
    rows = []
    for learner, ws in sorted(seen.items()):
        for w in all_wb:
            if w not in ws:
                rows.append(Row(learner, w, "(file)", "missing", "no submission for this workbook", ""))
    return rows


def print_scoreboard(rows: list[Row], out=sys.stdout) -> None:
    if not rows:
        print("nothing was graded", file=out)
        return
    head = ["learner", "workbook", "check", "result", "message"]
    table = [[r.learner, r.workbook, r.check, r.result, r.message] for r in rows]
    width = [min(max(len(x[i]) for x in table + [head]), cap) for i, cap in enumerate((20, 26, 48, 7, 10_000))]

    def fmt(cells):
        cut = [c if len(c) <= width[i] else c[: width[i] - 1] + "\u2026" for i, c in enumerate(cells)]
        return "  ".join(c.ljust(width[i]) for i, c in enumerate(cut[:4])) + "  " + cut[4]

    print(fmt(head).rstrip(), file=out)
    print("-" * min(150, sum(width[:4]) + 8 + 20), file=out)
    last = None
    for cells in table:
        if last is not None and cells[0] != last:
            print("", file=out)
        print(fmt(cells).rstrip(), file=out)
        last = cells[0]
    print("", file=out)
    learners: dict[str, list[Row]] = {}
    for r in rows:
        learners.setdefault(r.learner, []).append(r)
    for learner, rs in learners.items():
        checks = [r for r in rs if r.result in ("pass", "FAIL", "skip", "ERROR") and not r.check.startswith("cell ")]
        passed_n = sum(r.result == "pass" for r in checks)
        extra = []
        skipped = sum(r.result == "skip" for r in checks)
        if skipped:
            extra.append(f"{skipped} skipped")
        bad_files = [r for r in rs if r.result in ("broken", "missing")]
        if bad_files:
            extra.append(f"{len(bad_files)} file(s) broken or missing")
        print(f"{learner}: {passed_n}/{len(checks)} checks passed" + (f" ({', '.join(extra)})" if extra else ""), file=out)


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "workbook", "check", "result", "message", "file"])
        for r in rows:
            w.writerow([r.learner, r.workbook, r.check, r.result, r.message, r.file])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minipaged grade", description="Run workbooks and score their check cells.",
                                epilog="One scoreboard line per learner, workbook and check cell.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="a workbook .ipynb, or a folder of submissions")
    p.add_argument("--csv", metavar="FILE", help="also write the scoreboard as CSV")
    p.add_argument("--timeout", type=float, default=600, metavar="S", help="time limit per cell in seconds (default 600)")
    args = p.parse_args(argv)
    subs, rows = discover(args.paths)
    file_rows = list(rows)
    by_folder = any(Path(x).is_dir() for x in args.paths)
    if not subs and not rows:
        print("no workbooks found in " + ", ".join(args.paths), file=sys.stderr)
        return 2
    order = {w: i for i, w in enumerate(WORKBOOKS)}
    subs.sort(key=lambda s: (s.learner, order.get(s.workbook, 99), s.workbook, s.path.name))
    counts: dict = {}
    for s in subs:
        counts[(s.learner, s.workbook)] = counts.get((s.learner, s.workbook), 0) + 1
    for s in subs:
        t = time.perf_counter()
        print(f"grading {s.learner} / {s.workbook} ({s.path}) ...", file=sys.stderr, flush=True)
        graded = grade_notebook(s, timeout=args.timeout)
        if counts[(s.learner, s.workbook)] > 1:  # two files of one workbook: say which is which
            for r in graded:
                r.check = f"{r.check} [{s.path.name}]"
        rows.extend(graded)
        print(f"  done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    rows.extend(_missing_rows(subs, file_rows, by_folder))
    rows.sort(key=lambda r: (r.learner, order.get(r.workbook, 99), r.workbook))
    print_scoreboard(rows)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"\nwrote {args.csv}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
