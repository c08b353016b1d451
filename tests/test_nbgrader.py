"""nbgrader grades the workbooks end to end: the solutions carry its cell metadata,
``nbgrader generate_assignment`` turns them into exercises/ exactly, and ``nbgrader autograde``
gives solved work full marks and unsolved work zero.

The metadata comes from ``scripts/nbgrader_metadata.py`` (solution cells from the ``### BEGIN
SOLUTION`` markers, one point per check cell); the nbgrader runs need the ``nbgrader`` package
(in the dev extra) and take about a minute each.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
_spec = importlib.util.spec_from_file_location("nbgrader_metadata", ROOT / "scripts" / "nbgrader_metadata.py")
nbgrader_metadata = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbgrader_metadata)


def test_solutions_carry_nbgrader_metadata():
    bad = nbgrader_metadata.problems()
    assert not bad, f"nbgrader metadata missing or stale: {bad}; run scripts/nbgrader_metadata.py, then `make exercises`"
    ids = []
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        graded = [c.metadata["nbgrader"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        assert graded and all(m["locked"] and m["points"] == 1 for m in graded), path.name
        checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
        assert len(graded) == len(checks), f"{path.name}: every check cell is worth a point, nothing else is"
        ids += [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), "grade ids must be unique"


def test_exercises_keep_the_grade_ids():
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        sol = nbformat.read(path, as_version=4)
        ex = nbformat.read(EXERCISES / path.name, as_version=4)
        assert [c.metadata.get("nbgrader") for c in sol.cells] == [c.metadata.get("nbgrader") for c in ex.cells], path.name


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # nbgrader runs `alembic` (its database migrations) from PATH: this interpreter's scripts
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _course(tmp_path: Path, workbooks: list[str]) -> Path:
    course = tmp_path / "course"
    (course / "source" / "wb").mkdir(parents=True)
    for name in workbooks:
        shutil.copy(SOLUTIONS / name, course / "source" / "wb" / name)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(course)!r}\n"
        "c.CourseDirectory.course_id = 'minipaged'\n"
        "c.ExecutePreprocessor.timeout = 600\n"
    )
    return course


@pytest.mark.slow
def test_generate_assignment_gives_exactly_the_exercises(tmp_path):
    pytest.importorskip("nbgrader")
    names = sorted(p.name for p in SOLUTIONS.glob("*.ipynb"))
    course = _course(tmp_path, names)
    _nbgrader(course, "generate_assignment", "wb", "--force")
    for name in names:
        got = nbformat.read(course / "release" / "wb" / name, as_version=4)
        want = nbformat.read(EXERCISES / name, as_version=4)
        assert [(c.cell_type, c.source) for c in got.cells] == [(c.cell_type, c.source) for c in want.cells], name
        assert all(not c.get("outputs") for c in got.cells if c.cell_type == "code")


@pytest.mark.slow
def test_autograde_gives_solved_work_full_marks_and_unsolved_zero(tmp_path):
    pytest.importorskip("nbgrader")
    from nbgrader.api import Gradebook

    names = ["02_block_allocator.ipynb", "03_block_table.ipynb"]  # pure Python: quick to run
    course = _course(tmp_path, names)
    _nbgrader(course, "generate_assignment", "wb", "--force")
    for student, folder in (("solved", SOLUTIONS), ("unsolved", EXERCISES)):
        (course / "submitted" / student / "wb").mkdir(parents=True)
        for name in names:
            shutil.copy(folder / name, course / "submitted" / student / "wb" / name)
    _nbgrader(course, "autograde", "wb", "--create", "--force")
    want = sum(1 for name in names for c in nbformat.read(SOLUTIONS / name, as_version=4).cells
               if c.metadata.get("nbgrader", {}).get("grade"))
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        solved, unsolved = gb.find_submission("wb", "solved"), gb.find_submission("wb", "unsolved")
        assert (solved.score, solved.max_score) == (want, want)
        assert (unsolved.score, unsolved.max_score) == (0, want)
