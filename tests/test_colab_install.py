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
    for name in ("torch", "triton"):
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

    def run(args, **kw):
        r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, **kw)
        assert r.returncode == 0, f"{' '.join(map(str, args))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    # The "Colab image": torch (the release this checkout is tested with) and triton, nothing of ours.
    spec = f"torch=={torch.__version__.split('+')[0]}"
    run([py, "-m", "pip", "install", "-q", spec, "triton"], timeout=420)
    before = json.loads(run([py, "-c", PROBE]).strip().splitlines()[-1])
    assert "torch" in before and "minipaged" not in before

    # Colab: google.colab is imported in every kernel.
    fake = tmp_path / "fake_colab"
    (fake / "google" / "colab").mkdir(parents=True)
    (fake / "google" / "__init__.py").write_text("")
    (fake / "google" / "colab" / "__init__.py").write_text("IN_COLAB = True\n")

    source = _copy_package(tmp_path / "checkout")
    cell = install_cell_source()
    local = cell.replace(repr(install_commands()), repr(install_commands(source=str(source))))
    assert local != cell
    driver = tmp_path / "kernel.py"
    driver.write_text(
        f"import sys\nsys.path.insert(0, {str(fake)!r})\nimport google.colab\n"
        f"exec(compile({local!r}, '<install cell>', 'exec'), {{'__name__': '__main__'}})\n"
    )
    out = run([py, str(driver)], timeout=420)
    assert "ready" in out

    after = json.loads(run([py, "-c", PROBE]).strip().splitlines()[-1])
    for name in ("torch", "triton"):
        assert after.get(name) == before.get(name), f"the install cell replaced {name}: {before.get(name)} -> {after.get(name)}"
    version, init, model_path, exists = after["minipaged"]
    assert Path(init).resolve().is_relative_to(venv.resolve()), f"minipaged was imported from {init}, not the venv"
    assert exists, f"the default model is not where minipaged looks for it: {model_path}"
