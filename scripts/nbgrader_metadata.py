#!/usr/bin/env python
"""Give the solved workbooks in solutions/ nbgrader's cell metadata, so nbgrader can grade them.

Derived from what the workbooks already say, so it never drifts: a code cell with
``### BEGIN SOLUTION`` is a solution cell (grade id ``<workbook>-solution-<k>``); a check cell
(tagged ``check``, first line ``# CHECK: <name>``) is an autograded test cell, locked, worth one
point (grade id ``<workbook>-check-<name>``). Other cells get none. ``make exercises`` keeps
the metadata in exercises/, so a learner's submission carries the grade ids nbgrader matches.

    python scripts/nbgrader_metadata.py           write the metadata into solutions/
    python scripts/nbgrader_metadata.py --check   exit 1, naming the cells, if any is missing or stale
    python scripts/nbgrader_metadata.py --config COURSE_DIR
                                                  write COURSE_DIR/nbgrader_config.py (cell time limit)

nbgrader stops any cell after ``ExecutePreprocessor.timeout`` seconds (30 by default) and gives
it 0. ``CELL_TIMEOUT_S`` is the limit each workbook needs: about four times its slowest cell,
measured on 2 CPU cores (docs/instructor.md has the table); the generated config sets the
largest, since nbgrader has one limit for all cells.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
BEGIN = "### BEGIN SOLUTION"
POINTS_PER_CHECK = 1

# workbook -> (slowest cell measured on 2 cores, seconds; the cell limit nbgrader needs, seconds)
CELL_TIMEOUT_S = {
    "01_kv_cache_math": (1, 30),
    "02_block_allocator": (1, 30),
    "03_block_table": (1, 30),
    "04_paged_attention_torch": (1, 30),
    "05_triton_decode_kernel": (2, 30),  # the CPU interpreter; compiled on a GPU, the first call compiles (~10 s)
    "06_scheduler": (1, 30),
    "07_assemble": (15, 120),  # the check that builds an engine from the learner's parts and serves SmolLM2
    "08_prefix_caching": (1, 30),
    "09_speculative_decoding": (12, 90),  # SmolLM2 served with speculation on
    "10_predict_and_measure": (10, 60),  # the profile measured once; the ledger builds 12 engines (~7 s)
    "11_structured_outputs": (8, 60),  # SmolLM2 loaded for its vocabulary; the 30 masks take about a second
    "12_kv_connector": (25, 120),  # SmolLM2 loaded, 4 prompts served on 3 engines (clean, minipaged's tier, yours)
}
DEFAULT_CELL_TIMEOUT_S = 120  # a workbook not in the table yet: as much as the slowest


def cell_timeout(stems: list[str] | None = None) -> int:
    """The one nbgrader cell limit that lets every workbook in ``stems`` (default: solutions/) finish."""
    stems = stems if stems is not None else [p.stem for p in sorted(SOLUTIONS.glob("*.ipynb"))]
    return max((CELL_TIMEOUT_S.get(s, (0, DEFAULT_CELL_TIMEOUT_S))[1] for s in stems), default=30)


def config_text(course_dir: Path, course_id: str = "minipaged") -> str:
    return (
        "# Written by minipaged's scripts/nbgrader_metadata.py --config: nbgrader's settings for the workbooks.\n"
        "c = get_config()  # noqa: F821 (nbgrader provides it)\n"
        f"c.CourseDirectory.root = {str(course_dir)!r}\n"
        f"c.CourseDirectory.course_id = {course_id!r}\n"
        "# The slowest check (workbook 07 builds an engine and serves SmolLM2) needs more than nbgrader's\n"
        "# default 30 s a cell; a cell past the limit scores 0. Per workbook: docs/instructor.md.\n"
        f"c.ExecutePreprocessor.timeout = {cell_timeout()}\n"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "check"


def expected_metadata(nb: nbformat.NotebookNode, stem: str) -> list[dict | None]:
    """Per cell: the nbgrader metadata it should carry, or None (no nbgrader metadata)."""
    out: list[dict | None] = []
    k = 0
    seen: set[str] = set()
    for cell in nb.cells:
        meta = None
        if cell.cell_type == "code" and "check" in cell.metadata.get("tags", []):
            first = cell.source.split("\n", 1)[0]
            name = _slug(first.removeprefix("# CHECK:"))
            gid = f"{stem}-check-{name}"
            while gid in seen:
                gid += "-2"
            meta = {"grade": True, "grade_id": gid, "locked": True, "points": POINTS_PER_CHECK,
                    "schema_version": 3, "solution": False, "task": False}
        elif cell.cell_type == "code" and BEGIN in cell.source:
            k += 1
            meta = {"grade": False, "grade_id": f"{stem}-solution-{k}", "locked": False,
                    "schema_version": 3, "solution": True, "task": False}
        if meta is not None:
            seen.add(meta["grade_id"])
        out.append(meta)
    return out


def problems(solutions: Path = SOLUTIONS) -> list[str]:
    bad = []
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, (cell, want) in enumerate(zip(nb.cells, expected_metadata(nb, path.stem))):
            if cell.metadata.get("nbgrader") != want:
                bad.append(f"{path.name} cell {i}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--config", metavar="COURSE_DIR", type=Path,
                   help="write COURSE_DIR/nbgrader_config.py (course root and the cell time limit) and stop")
    args = p.parse_args(argv)
    if args.config is not None:
        args.config.mkdir(parents=True, exist_ok=True)
        target = args.config / "nbgrader_config.py"
        target.write_text(config_text(args.config.resolve()), encoding="utf-8")
        print(f"wrote {target} (cell time limit {cell_timeout()} s)")
        return 0
    if args.check:
        bad = problems()
        if bad:
            print("nbgrader metadata missing or stale: " + ", ".join(bad) + ". Run scripts/nbgrader_metadata.py.")
            return 1
        print("solutions/ carry nbgrader metadata")
        return 0
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        changed = False
        for cell, want in zip(nb.cells, expected_metadata(nb, path.stem)):
            if cell.metadata.get("nbgrader") != want:
                changed = True
                if want is None:
                    cell.metadata.pop("nbgrader", None)
                else:
                    cell.metadata["nbgrader"] = want
        if changed:
            text = nbformat.writes(nb)
            path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
