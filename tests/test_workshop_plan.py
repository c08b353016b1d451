"""docs/instructor.md's workshop plans against the stored run times (notebooks/timings.md, which
scripts/run_notebooks.py writes): the run-time column, the two-day plan's coverage and its clock."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "instructor.md").read_text(encoding="utf-8")
TIMINGS = (ROOT / "notebooks" / "timings.md").read_text(encoding="utf-8")
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WORKBOOKS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def stored_seconds() -> dict[str, int]:
    return {m.group(1)[:2]: int(m.group(2)) for m in re.finditer(r"^\| `(\d\d_\w+)` \| (\d+) \|", TIMINGS, flags=re.M)}


def two_day_plan() -> str:
    start = DOC.index("## Two-day workshop")
    return DOC[start:DOC.index("\n## ", start + 5)]


def test_timings_are_written_by_the_script_that_runs_the_lessons():
    assert TIMINGS.startswith("# Lesson timings\n\nMeasured by `scripts/run_notebooks.py`")
    assert "timings.md" in (ROOT / "scripts" / "run_notebooks.py").read_text()
    assert set(stored_seconds()) == {n[:2] for n in LESSONS}, "notebooks/timings.md lacks a lesson: run scripts/run_notebooks.py on it"


def test_the_run_time_column_is_the_stored_run_time():
    secs = stored_seconds()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\d\d) [^|]+\| ([^|]+)\|", DOC, flags=re.M)}
    for num, s in secs.items():
        assert num in rows, f"docs/instructor.md's table has no row for lesson {num}"
        assert rows[num].strip().startswith(f"{s} s"), f"lesson {num}: the table says {rows[num].strip()!r}, timings.md {s} s"


def test_the_two_day_plan_covers_every_lesson_and_workbook_with_stored_run_times():
    plan, secs = two_day_plan(), stored_seconds()
    for num, s in secs.items():
        assert re.search(rf"\| {num} [^|]*\[{s} s\]", plan), f"lesson {num} has no slot with its run time [{s} s]"
    for k in range(1, len(WORKBOOKS) + 1):
        assert re.search(rf"workbooks? [^|]*\b{k:02d}\b|workbook {k}\b", plan), f"workbook {k:02d} has no slot"


def test_the_two_day_plan_adds_up():
    for day in two_day_plan().split("**Day ")[1:]:
        rows = re.findall(r"^\| (\d+):(\d\d) \| ([^\n]*)\|$", day, flags=re.M)
        times = [int(h) * 60 + int(m) for h, m, _ in rows]
        assert times == sorted(times) and len(rows) > 5
        for (t, nxt, (_, _, what)) in zip(times, times[1:], rows):
            m = re.search(r"\((\d+)(?: \+ (\d+))? min", what)
            if m:
                assert nxt - t == int(m.group(1)) + int(m.group(2) or 0), f"{what.strip()}: the next slot starts {nxt - t} min later"
