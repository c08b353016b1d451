"""The install cell every lesson and workbook starts with (minipaged.colab.install_cell_source()).

Slow test: the cell's own code runs in a fresh virtual environment that already holds torch
and triton (as Colab's image does), pretending to be Colab (a fake ``google.colab`` module),
with the package taken from this checkout instead of the repository URL. It must install
minipaged and the default model, and leave torch and triton exactly as they were.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minipaged.colab import install_cell_source, install_commands

ROOT = Path(__file__).resolve().parent.parent


def test_cell_runs_the_documented_commands():
    """The slow test swaps the command list for a local one; that list must be the cell's own."""
    assert repr(install_commands()) in install_cell_source()


def test_cell_does_nothing_outside_colab(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("MINIPAGED_WHEEL", raising=False)
    exec(compile(install_cell_source(), "<install cell>", "exec"), {"__name__": "__main__"})
    assert calls == [], "outside Colab the install cell must not run pip"
    assert "ready" in capsys.readouterr().out


def test_cell_skips_the_install_when_minipaged_is_there(monkeypatch, tmp_path):
    """Rerunning the cell on Colab (or a kernel restart) must not reinstall anything."""
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    exec(compile(install_cell_source(), "<install cell>", "exec"), {"__name__": "__main__"})
    assert calls == []


def _run_cell_without_minipaged(monkeypatch, run):
    """Run the install cell as on a runtime where minipaged is not installed yet."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "minipaged" else real(name, *a))
    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(install_cell_source(), "<install cell>", "exec"), {"__name__": "__main__"})


def test_the_wheel_override_replaces_the_release_without_editing_the_cell(monkeypatch, capsys):
    calls = []
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setenv("MINIPAGED_WHEEL", "/content/minipaged-0.1.0-py3-none-any.whl")
    _run_cell_without_minipaged(monkeypatch, lambda args, **k: calls.append(args) or subprocess.CompletedProcess(args, 0, "", ""))
    assert [c[-1] for c in calls] == ["/content/minipaged-0.1.0-py3-none-any.whl", install_commands()[1][-1]]
    assert "ready" in capsys.readouterr().out


@pytest.mark.parametrize("pip_says", ["ERROR: Could not find a version that satisfies the requirement (404)",
                                      "fatal: unable to access 'https://github.com/': Could not resolve host: github.com"])
def test_a_release_that_cannot_be_fetched_stops_with_the_alternatives(monkeypatch, pip_says):
    from minipaged import colab

    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    monkeypatch.delenv("MINIPAGED_WHEEL", raising=False)
    with pytest.raises(Exception) as e:
        _run_cell_without_minipaged(monkeypatch, lambda args, **k: subprocess.CompletedProcess(args, 1, "", "Traceback...\n" + pip_says + "\n"))
    msg = str(e.value)
    assert type(e.value).__name__ == "InstallFailed" and e.value._render_traceback_() == [msg]
    assert f"Could not install minipaged {colab.RELEASE}" in msg and pip_says in msg and colab.REPO_URL in msg
    assert f"%env MINIPAGED_WHEEL=/content/{colab.wheel_name()}" in msg and "drive.mount('/content/drive')" in msg
    assert f"%env MINIPAGED_WHEEL=/content/drive/MyDrive/{colab.wheel_name()}" in msg


@pytest.mark.slow  # runs pip
def test_a_wheel_that_is_not_there_stops_with_the_alternatives_from_real_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_WHEEL", str(tmp_path / "minipaged-0.1.0-py3-none-any.whl"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(Exception, match="Could not install minipaged") as e:
        _run_cell_without_minipaged(monkeypatch, subprocess.run)
    assert "does not exist" in str(e.value) or "No such file" in str(e.value), str(e.value)


def test_colab_installs_and_opens_the_pinned_release_of_this_version():
    """Never a moving branch: the tag of this package's version, set in one place."""
    import tomllib

    import minipaged
    from minipaged import colab

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "minipaged.__version__"}
    version = minipaged.__version__  # set once, there
    assert colab.RELEASE == f"v{version}"
    assert install_commands()[0][-1] == f"minipaged @ git+{colab.REPO_URL}@{colab.RELEASE}"
    assert colab.colab_badge_url("notebooks/00_setup_and_tour.ipynb").endswith(f"/blob/{colab.RELEASE}/notebooks/00_setup_and_tour.ipynb")
    readme = (ROOT / "README.md").read_text()
    assert "/blob/main/" not in readme and "@main" not in readme, "the README's Colab links must open the pinned release"


def test_the_first_cell_prints_the_version_and_the_route(monkeypatch, capsys):
    import minipaged

    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(compile(install_cell_source(), "<install cell>", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert f"minipaged {minipaged.__version__} ready" in out
    assert "a default LLM() runs" in out and ("CPU" in out or "GPU" in out)


COLAB_IPYWIDGETS = "ipywidgets==7.7.1"  # what Colab ships (JupyterLab 4 needs 8: the course extra)


def test_install_cell_installs_no_extra():
    """Colab keeps its ipywidgets 7.7.1: the cell installs the package bare, never `[course]`."""
    import tomllib

    for args in install_commands():
        assert not any("[" in a or "ipywidgets" in a for a in args), args
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["course"]
    assert "ipywidgets>=8" in extra, "JupyterLab 4 renders only ipywidgets 8: the course extra must ask for it"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_widgets_work_with_colabs_ipywidgets(tmp_path):
    """The three apps, built and moved with ipywidgets 7.7.1 (Colab's) in front of the installed 8."""
    target = tmp_path / "iw7"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        COLAB_IPYWIDGETS, "ipython_genutils"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"could not fetch {COLAB_IPYWIDGETS} (no package index?): {r.stderr[-500:]}")
    probe = textwrap.dedent("""
        import ipywidgets
        assert ipywidgets.__version__ == "7.7.1", ipywidgets.__version__
        from minipaged import widgets
        from minipaged.bench.simulate import sample_requests, simulate, simulate_static
        R = sample_requests(12, seed=1)
        t, s = simulate(R, num_blocks=48, block_size=8, max_num_seqs=4), simulate_static(R, batch_size=4)
        calc = widgets.memory_calculator()
        assert not calc.static and calc.result["paged_seqs"] == 60
        calc.seq_len.value = 1000
        assert calc.result["paged_seqs"] == 18 and "paged fits 18" in calc.readout.value
        calc.model.value = "custom"
        assert not calc.custom_layers.disabled
        calc.set(model="Llama-2-7B", device_gib=12)
        assert calc.result["gain"] is None and "does not fit" in calc.readout.value
        tl = widgets.batching_timeline(s, t)
        tl.tick.value = 0
        assert tl.result["static"]["computing"] == 4 and tl.tick.label == "0 steps"
        assert tl.link.target == (tl.tick, "index")
        pt = widgets.page_table_explorer(t)
        pt.step.value = 0
        assert pt.result["step"] == 0 and "step 0:" in pt.readout.value
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    env.pop("MINIPAGED_STATIC", None)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def _copy_package(dest: Path) -> Path:
    """Only what `pip install <dir>` needs, so no build output lands in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.py", "setup.cfg", "MANIFEST.in"):
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "minipaged", dest / "minipaged", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


PROBE = textwrap.dedent("""
    import json, sys, importlib.util
    out = {}
    for name in ("torch", "triton", "ipywidgets"):
        if importlib.util.find_spec(name):
            m = __import__(name)
            out[name] = [m.__version__, m.__file__]
    if importlib.util.find_spec("minipaged"):
        import minipaged, minipaged.model
        p = minipaged.model.default_model_path()
        out["minipaged"] = [minipaged.__version__, minipaged.__file__, str(p), p.is_file()]
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_install_cell_on_a_fake_colab(tmp_path):
    import torch

    venv = tmp_path / "colab-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    # TRITON_INTERPRET may be set by earlier tests in this process; the "Colab" probe must not inherit it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "TRITON_INTERPRET")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(args, env=env, **kw):
        r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, **kw)
        assert r.returncode == 0, f"{' '.join(map(str, args))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    # The "Colab image": torch (the release this checkout is tested with), triton and Colab's
    # ipywidgets 7.7.1 (the course extra asks for >= 8, which the install cell must not bring in).
    spec = f"torch=={torch.__version__.split('+')[0]}"
    run([py, "-m", "pip", "install", "-q", spec, "triton", COLAB_IPYWIDGETS], timeout=420)
    before = json.loads(run([py, "-c", PROBE]).strip().splitlines()[-1])
    assert "torch" in before and "minipaged" not in before

    # Colab: google.colab is imported in every kernel.
    fake = tmp_path / "fake_colab"
    (fake / "google" / "colab").mkdir(parents=True)
    (fake / "google" / "__init__.py").write_text("")
    (fake / "google" / "colab" / "__init__.py").write_text("IN_COLAB = True\n")

    source = _copy_package(tmp_path / "checkout")
    driver = tmp_path / "kernel.py"
    driver.write_text(
        f"import sys\nsys.path.insert(0, {str(fake)!r})\nimport google.colab\n"
        f"exec(compile({install_cell_source()!r}, '<install cell>', 'exec'), {{'__name__': '__main__'}})\n"
    )
    out = run([py, str(driver)], timeout=420, env={**env, "MINIPAGED_WHEEL": str(source)})  # the override, never an edit
    assert "ready" in out

    after = json.loads(run([py, "-c", PROBE]).strip().splitlines()[-1])
    assert before["ipywidgets"][0] == COLAB_IPYWIDGETS.split("==")[1]
    for name in ("torch", "triton", "ipywidgets"):
        assert after.get(name) == before.get(name), f"the install cell replaced {name}: {before.get(name)} -> {after.get(name)}"
    version, init, model_path, exists = after["minipaged"]
    assert Path(init).resolve().is_relative_to(venv.resolve()), f"minipaged was imported from {init}, not the venv"
    assert exists, f"the default model is not where minipaged looks for it: {model_path}"


def _fake_missing(monkeypatch, module="xgrammar"):
    """``module`` looks uninstalled (and not yet imported); pip calls are recorded, not run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: calls.append(args) or subprocess.CompletedProcess(args, 1, "", "no network"))
    return calls


def test_require_installs_a_missing_optional_module_where_the_install_cell_installs(monkeypatch, capsys):
    """Colab ships no xgrammar: lesson 13 and workbook 11 get it through minipaged.colab.require, which
    pip-installs it there (or with $MINIPAGED_WHEEL set) and says so; a failed install says what to run."""
    from minipaged.colab import require

    calls = _fake_missing(monkeypatch)
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    with pytest.raises(ModuleNotFoundError, match=r"pip install xgrammar>=0.2` failed \(no network\)"):
        require("xgrammar")
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "xgrammar>=0.2"]]
    assert "installing xgrammar>=0.2 for structured outputs" in capsys.readouterr().out


def test_require_elsewhere_names_the_command_and_installs_nothing(monkeypatch):
    from minipaged.colab import require

    calls = _fake_missing(monkeypatch)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("MINIPAGED_WHEEL", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'xgrammar>=0.2'.*make setup") as e:
        require("xgrammar")
    assert calls == [] and e.value.name == "xgrammar"
    with pytest.raises(ValueError, match="not a module the course installs"):
        require("numpy_but_not")


def test_the_lessons_import_xgrammar_only_through_require():
    """An `import xgrammar` in a lesson or workbook fails on Colab before require can install it."""
    found = []
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
                if cell["cell_type"] == "code" and any(l.strip().startswith(("import xgrammar", "from xgrammar"))
                                                       for l in "".join(cell["source"]).splitlines()):
                    found.append(path.name)
    assert not found, f"use `xgr = minipaged.colab.require('xgrammar')` instead in {sorted(set(found))}"
    assert 'require("xgrammar")' in (ROOT / "minipaged" / "structured_output.py").read_text(encoding="utf-8")
