#!/usr/bin/env python
"""Generate the learners' workbooks in exercises/ from the solved ones in solutions/.

solutions/ is the single source. In every code cell, each block between `### BEGIN SOLUTION`
and `### END SOLUTION` (nbgrader's markers) becomes `# YOUR CODE HERE` plus
`raise NotImplementedError()` at the block's indentation; outputs and execution counts are
cleared; the first code cell is set to minipaged.colab.install_cell_source().

    python scripts/make_exercises.py           write exercises/ (what `make exercises` runs)
    python scripts/make_exercises.py --check   exit 1, naming the stale files, if exercises/ is out of date
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MD_BEGIN, MD_END = "=== BEGIN SOLUTION ===", "=== END SOLUTION ==="
STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
# Cell metadata a generated workbook keeps; the rest (execution timings, widget state) is noise.
KEEP_CELL_METADATA = ("tags", "collapsed", "jupyter", "nbgrader")  # nbgrader: a submission carries its grade ids

sys.path.insert(0, str(ROOT))
from minipaged.colab import install_cell_source  # noqa: E402


class SolutionMarkerError(ValueError):
    pass


def strip_solutions(source: str, where: str) -> str:
    """Replace every solution block of a code cell's source by the stub."""
    out: list[str] = []
    inside = False
    for n, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise SolutionMarkerError(f"{where}, line {n}: {BEGIN} inside another solution block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in STUB]
        elif stripped == END:
            if not inside:
                raise SolutionMarkerError(f"{where}, line {n}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise SolutionMarkerError(f"{where}: {BEGIN} is never closed by {END}")
    return "\n".join(out)


def strip_markdown_solutions(source: str) -> str:
    pattern = re.compile(re.escape(MD_BEGIN) + r".*?" + re.escape(MD_END), re.S)
    return pattern.sub("YOUR ANSWER HERE", source)


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    nb = copy.deepcopy(solution)
    first_code = True
    for i, cell in enumerate(nb.cells):
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        if cell.cell_type == "code":
            if first_code:
                cell.source = install_cell_source()
                first_code = False
            else:
                cell.source = strip_solutions(cell.source, f"{name}, cell {i}")
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source = strip_markdown_solutions(cell.source)
            cell.pop("attachments", None) if not cell.get("attachments") else None
    if "colab" in nb.metadata:
        nb.metadata["colab"] = {**nb.metadata["colab"], "provenance": []}
    nb.metadata.pop("widgets", None)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    s = nbformat.writes(nb)
    return s if s.endswith("\n") else s + "\n"


def expected_exercises(solutions: Path = SOLUTIONS) -> dict[str, str]:
    """File name -> the text exercises/ should hold for it."""
    out = {}
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        out[path.name] = render(make_exercise(nb, path.name))
    return out


def stale(solutions: Path = SOLUTIONS, exercises: Path = EXERCISES) -> list[str]:
    """What is out of date in exercises/: 'NAME (differs)', 'NAME (missing)', 'NAME (no solution)'."""
    want = expected_exercises(solutions)
    problems = []
    for name, text in want.items():
        target = exercises / name
        if not target.exists():
            problems.append(f"{name} (missing)")
        elif target.read_text(encoding="utf-8") != text:
            problems.append(f"{name} (differs)")
    for path in sorted(exercises.glob("*.ipynb")):
        if path.name not in want:
            problems.append(f"{path.name} (no solution)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report whether exercises/ is up to date")
    args = p.parse_args(argv)
    if args.check:
        problems = stale()
        if problems:
            print("exercises/ is out of date: " + ", ".join(problems) + ". Run `make exercises`.")
            return 1
        print("exercises/ is up to date")
        return 0
    EXERCISES.mkdir(exist_ok=True)
    want = expected_exercises()
    for name, text in want.items():
        target = EXERCISES / name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            print(f"wrote exercises/{name}")
    for path in sorted(EXERCISES.glob("*.ipynb")):
        if path.name not in want:
            path.unlink()
            print(f"removed exercises/{path.name} (its solution is gone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
