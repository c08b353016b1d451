"""The course's workbooks: solutions/ is the source, exercises/ is generated from it.

- exercises/ is up to date with solutions/ (else: run `make exercises`);
- every workbook's first code cell is minipaged.colab.install_cell_source();
- every solution passes under `pytest --nbval-lax` (run as a subprocess, as a grader would);
- every exercise fails exactly at its check cells, each naming the unimplemented function;
- workbook 07 finds a learner's own workbooks in a shared folder.

Notebook runs are the slow part (a kernel and torch per workbook); each runs once.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
sys.path.insert(0, str(ROOT / "scripts"))

import make_exercises  # noqa: E402

from minipaged.checks._workbooks import WORKBOOKS, is_check_cell  # noqa: E402
from minipaged.colab import install_cell_source  # noqa: E402

# Two cores shared with other jobs: with two OpenMP threads per kernel, torch can run 100x slower.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _notebooks(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.ipynb"))


def test_workbook_list() -> None:
    assert [p.stem for p in _notebooks(SOLUTIONS)] == WORKBOOKS


def test_exercises_are_up_to_date() -> None:
    problems = make_exercises.stale()
    assert not problems, "exercises/ is out of date with solutions/: " + ", ".join(problems) + ". Run `make exercises`."


@pytest.mark.parametrize("path", _notebooks(SOLUTIONS) + _notebooks(EXERCISES), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_first_code_cell_is_the_install_cell(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source == install_cell_source(), (
        f"{path.name}: the first code cell must be minipaged.colab.install_cell_source() exactly"
        + (" (run `make exercises`)" if path.parent == EXERCISES else ""))


@pytest.mark.parametrize("path", _notebooks(SOLUTIONS), ids=lambda p: p.name)
def test_workbook_shape(path: Path) -> None:
    sol = nbformat.read(path, as_version=4)
    ex = nbformat.read(EXERCISES / path.name, as_version=4)
    checks = [c for c in sol.cells if is_check_cell(c)]
    assert checks, f"{path.name} has no check cells"
    for c in checks:
        assert c.source.startswith("# CHECK: "), f"{path.name}: a check cell must start with '# CHECK: <name>'"
        assert "check" in c.metadata.get("tags", []), f"{path.name}: tag check cells 'check'"
        assert "### BEGIN SOLUTION" not in c.source
    assert sum(c.source.count("### BEGIN SOLUTION") for c in sol.cells) >= 1
    intro = sol.cells[0].source
    assert sol.cells[0].cell_type == "markdown" and f"pytest --nbval-lax {path.stem}.ipynb" in intro
    # nbval-lax makes every code cell a test, not only the check cells: the intro must say so
    assert "each code cell is a test" in intro and "the check cells are the ones that judge your code" in intro.lower(), (
        f"{path.name}: the intro must say that under nbval-lax each code cell is a test and the check cells judge the code")
    for c in ex.cells:
        assert "SOLUTION" not in c.source, f"exercises/{path.name} still has a solution marker"
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    assert sum(c.source.count("raise NotImplementedError()") for c in ex.cells) >= 1


def test_make_exercises_replaces_blocks_at_their_indentation() -> None:
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    assert make_exercises.strip_solutions(src, "t") == (
        "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n")
    with pytest.raises(make_exercises.SolutionMarkerError):
        make_exercises.strip_solutions("### BEGIN SOLUTION\nx = 1\n", "t")


def _nbval(folder: Path, tmp_path: Path, name: str) -> tuple[int, str, ET.Element]:
    xml = tmp_path / f"{name}.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}",
         "-o", "addopts=", *[str(p) for p in _notebooks(folder)]],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900,
    )
    return proc.returncode, proc.stdout + proc.stderr, ET.parse(xml).getroot()


def test_solutions_pass_under_nbval(tmp_path: Path) -> None:
    rc, out, _ = _nbval(SOLUTIONS, tmp_path, "solutions")
    assert rc == 0, "a solution workbook fails under `pytest --nbval-lax solutions/`:\n" + out[-6000:]


def test_exercises_fail_exactly_at_their_check_cells(tmp_path: Path) -> None:
    rc, out, root = _nbval(EXERCISES, tmp_path, "exercises")
    assert rc == 1, out[-3000:]
    failed: dict[str, dict[int, str]] = {}
    for case in root.iter("testcase"):
        m = re.search(r"Cell (\d+)", case.get("name", ""))
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if m and problem is not None:
            nb_name = Path(case.get("file") or case.get("classname", "")).name or case.get("classname", "")
            text = (problem.get("message") or "") + (problem.text or "")
            failed.setdefault(nb_name, {})[int(m.group(1))] = text
    for path in _notebooks(EXERCISES):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        want = {i for i, c in enumerate(code) if is_check_cell(c)}
        key = next((k for k in failed if path.stem in k), None)
        got = failed.get(key, {})
        assert set(got) == want, f"{path.name}: nbval failed code cells {sorted(got)}, the check cells are {sorted(want)}"
        for i, text in got.items():
            assert "not implemented yet:" in text and "NotImplementedError" in text, (
                f"{path.name}, code cell {i}: a stub must fail with 'not implemented yet: <function>':\n{text[-2000:]}")


def test_assemble_finds_the_learners_own_workbooks(tmp_path: Path, capsys) -> None:
    """A flat folder of everybody's files: 07 takes alice's parts for alice and bob's for bob."""
    from minipaged.checks import NotImplementedYet, assemble

    for stem in ("02_block_allocator", "03_block_table", "04_paged_attention_torch", "06_scheduler"):
        shutil.copy(SOLUTIONS / f"{stem}.ipynb", tmp_path / f"alice_{stem}.ipynb")
        shutil.copy(EXERCISES / f"{stem}.ipynb", tmp_path / f"bob_{stem}.ipynb")
    parts = assemble.load_parts(tmp_path, learner="alice")
    assert parts.allocator_cls.__name__ == "MyBlockAllocator"
    assert "alice_02_block_allocator.ipynb" in capsys.readouterr().out
    with pytest.raises(NotImplementedYet, match="not implemented yet: MyBlockAllocator.__init__"):
        assemble.load_parts(tmp_path, learner="bob")


def test_play_cell_gives_every_request_its_own_answer() -> None:
    """Workbook 07's "Now play" example: the same prompt with the same seed gives the same answer,
    so the requests it sends must differ in seed or prompt."""
    import types

    nb = nbformat.read(SOLUTIONS / "07_assemble.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "## Now play" in c.source)
    code = re.search(r"```python\n(.*?)```", cell.source, re.S).group(1)
    calls = {}

    class FakeLLM:
        engine = types.SimpleNamespace(stats=lambda: {})

        def chat(self, messages, params=None):
            calls["messages"], calls["params"] = messages, params
            return [types.SimpleNamespace(text="")] * len(messages)

        generate = chat

    ns = {"assemble": types.SimpleNamespace(model_and_tokenizer=lambda: (None, None)),
          "build_engine": lambda *a, **k: FakeLLM(), "parts": None}
    exec(compile(code, "07 Now play", "exec"), ns)
    messages, params = calls["messages"], calls["params"]
    params = params if isinstance(params, list) else [params] * len(messages)
    assert len(messages) > 1
    requests = [(repr(m), p.seed) for m, p in zip(messages, params)]
    assert all(p.temperature > 0 for p in params)
    assert len(set(requests)) == len(requests), f"the play cell sends identical requests: {requests}"
