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
    env.pop("TRITON_INTERPRET", None)  # as in a learner's kernel: the workbooks decide for themselves
    r = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _course(root: Path, sources: dict[str, Path]) -> Path:
    """An nbgrader course folder: the given solved workbooks as assignment `wb`, and the
    nbgrader_config.py that docs/instructor.md tells an instructor to generate (its cell limit)."""
    course = root / "course"
    (course / "source" / "wb").mkdir(parents=True)
    for name, path in sources.items():
        shutil.copy(path, course / "source" / "wb" / name)
    assert nbgrader_metadata.main(["--config", str(course)]) == 0
    return course


def _graded(course: Path) -> set[str]:
    return {c.metadata["nbgrader"]["grade_id"] for name in os.listdir(course / "source" / "wb")
            for c in nbformat.read(course / "source" / "wb" / name, as_version=4).cells
            if c.metadata.get("nbgrader", {}).get("grade")}


def _autograde(course: Path, students: dict[str, Path]) -> dict[str, dict[str, tuple[float, str]]]:
    """Autograde each student's copy of the assignment; per student, per graded cell that did not
    get full marks: (its score, what the cell wrote to stderr or its error). Full marks: {}."""
    from nbgrader.api import Gradebook

    names = sorted(os.listdir(course / "source" / "wb"))
    for student, folder in students.items():
        (course / "submitted" / student / "wb").mkdir(parents=True)
        for name in names:
            shutil.copy(folder / name, course / "submitted" / student / "wb" / name)
    _nbgrader(course, "autograde", "wb", "--create", "--force")
    lost: dict[str, dict[str, tuple[float, str]]] = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in students:
            lost[student] = {}
            for name in names:
                graded = nbformat.read(course / "autograded" / student / "wb" / name, as_version=4)
                for cell in graded.cells:
                    meta = cell.metadata.get("nbgrader", {})
                    if not meta.get("grade"):
                        continue
                    g = gb.find_grade(meta["grade_id"], Path(name).stem, "wb", student)
                    if g.score != g.max_score:
                        said = [o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stderr"]
                        said += [f"{o.get('ename')}: {o.get('evalue')}" for o in cell.get("outputs", []) if o.get("output_type") == "error"]
                        lost[student][meta["grade_id"]] = (g.score, ("stderr: " if said and not said[0].startswith(("Timeout", "Cell")) else "") + " | ".join(said)[:300])
            sub = gb.find_submission("wb", student)
            lost[student]["(total)"] = (float(sub.score), f"max {float(sub.max_score):g}")
    return lost


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """One generated assignment of every solved workbook (a 10th joins by being in solutions/)."""
    pytest.importorskip("nbgrader")
    course = _course(tmp_path_factory.mktemp("nbgrader"), {p.name: p for p in sorted(SOLUTIONS.glob("*.ipynb"))})
    _nbgrader(course, "generate_assignment", "wb", "--force")
    return course


@pytest.mark.slow
def test_generate_assignment_gives_exactly_the_exercises(generated):
    names = sorted(p.name for p in SOLUTIONS.glob("*.ipynb"))
    assert names == sorted(os.listdir(generated / "release" / "wb"))
    for name in names:
        got = nbformat.read(generated / "release" / "wb" / name, as_version=4)
        want = nbformat.read(EXERCISES / name, as_version=4)
        assert [(c.cell_type, c.source) for c in got.cells] == [(c.cell_type, c.source) for c in want.cells], name
        assert all(not c.get("outputs") for c in got.cells if c.cell_type == "code")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_autograde_gives_every_solved_workbook_full_marks_and_unsolved_zero(generated):
    """The whole class as docs/instructor.md runs it: every workbook, one assignment, the generated
    config. A check that writes to stderr (a notice) or runs past the cell limit loses its point."""
    want = len(_graded(generated))
    stems = {gid.split("-check-")[0] for gid in _graded(generated)}
    assert stems == {p.stem for p in SOLUTIONS.glob("*.ipynb")}, "a workbook without a graded check"
    lost = _autograde(generated, {"solved": SOLUTIONS, "unsolved": EXERCISES})
    assert lost["solved"].pop("(total)") == (want, f"max {want}"), f"solved work lost points: {lost['solved']}"
    assert lost["unsolved"].pop("(total)") == (0, f"max {want}"), "an unsolved workbook scored points"
    assert len(lost["unsolved"]) == want


def test_the_generated_config_gives_each_workbook_its_cell_limit():
    text = nbgrader_metadata.config_text(Path("/course"))
    limit = nbgrader_metadata.cell_timeout()
    assert f"c.ExecutePreprocessor.timeout = {limit}" in text and limit > 30
    for stem in (p.stem for p in SOLUTIONS.glob("*.ipynb")):
        measured, need = nbgrader_metadata.CELL_TIMEOUT_S.get(stem, (0, nbgrader_metadata.DEFAULT_CELL_TIMEOUT_S))
        assert need <= limit and need >= max(30, 3 * measured), stem
    doc = (ROOT / "docs" / "instructor.md").read_text()
    for stem, (_, need) in nbgrader_metadata.CELL_TIMEOUT_S.items():
        assert f"| `{stem}` | {need} s |" in doc, f"docs/instructor.md gives no cell limit for {stem}"
    assert "nbgrader_metadata.py --config" in doc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_check_that_writes_to_stderr_loses_its_point(tmp_path):
    """What the issue saw: nbgrader gives 0 to a passing cell that writes to stderr. Planted in one
    check of a quick workbook, the grading above names that cell and what it wrote."""
    name = "02_block_allocator.ipynb"
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    check = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))
    check.source += '\nimport sys; print("minipaged: CPU kernels loaded", file=sys.stderr)'
    planted = tmp_path / "planted"
    planted.mkdir()
    nbformat.write(nb, planted / name)
    course = _course(tmp_path, {name: planted / name})
    _nbgrader(course, "generate_assignment", "wb", "--force")
    lost = _autograde(course, {"solved": planted})["solved"]
    gid = check.metadata["nbgrader"]["grade_id"]
    assert set(lost) == {gid, "(total)"}, lost
    assert lost[gid][0] == 0 and "CPU kernels loaded" in lost[gid][1], lost


@pytest.mark.slow
def test_building_the_cpu_kernels_writes_nothing_to_stderr(tmp_path):
    """The kernels' build notice goes to the `minipaged.cpu` logger at INFO, never to stderr by
    itself; the minipaged command shows it."""
    code = ("from minipaged.cpu import build\nbuild.library()\nprint(build.announcement())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "minipaged: CPU kernels" in r.stdout, r.stderr[-2000:]
    assert r.stderr == "", f"building or loading the CPU kernels wrote to stderr: {r.stderr[-2000:]}"
    r = subprocess.run([sys.executable, "-m", "minipaged", "info"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "minipaged: CPU kernels" in r.stderr, r.stderr[-2000:]
