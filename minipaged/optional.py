"""What a lesson needs beyond the bare install, installed on demand where the install cell installs.

It imports nothing of minipaged, so any module may call :func:`require` (``minipaged.colab``
re-exports it) without an import cycle."""
from __future__ import annotations

# The environment variable the install cell reads: a wheel (or any pip requirement) to install
# instead of the release; set, it also makes require() install outside Colab.
WHEEL_ENV = "MINIPAGED_WHEEL"

# What a lesson needs beyond the bare install, by module: the pip requirement and what needs it.
# Colab ships none of these; `make setup`, environment.yml and the `course`/`serve` extras do.
OPTIONAL = {
    "xgrammar": ("xgrammar>=0.2", "structured outputs (lesson 13, workbook 11)"),
}


def require(module: str):
    """Import ``module`` (one of :data:`OPTIONAL`) and return it. Where the install cell installs
    (on Colab, or with ``$MINIPAGED_WHEEL`` set) a missing module is pip-installed first, as lesson
    09 does for the server; elsewhere a missing one is a ModuleNotFoundError that says the command."""
    import importlib
    import importlib.util
    import os
    import subprocess
    import sys

    if module in sys.modules:
        return sys.modules[module]
    if module not in OPTIONAL:
        raise ValueError(f"require({module!r}): not a module the course installs on demand; one of {sorted(OPTIONAL)}")
    spec, what = OPTIONAL[module]
    if importlib.util.find_spec(module) is None:
        if "google.colab" in sys.modules or os.environ.get(WHEEL_ENV):
            print(f"installing {spec} for {what} (Colab does not ship it; about a minute, once per runtime) ...")
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], capture_output=True, text=True)
            importlib.invalidate_caches()
            if r.returncode != 0:
                why = " / ".join([l.strip() for l in (r.stderr + r.stdout).splitlines() if l.strip()][-3:]) or "nothing"
                raise ModuleNotFoundError(f"{what} needs {module}, and `pip install {spec}` failed ({why}). Run that "
                                          f"command in a new cell, restart the runtime if pip asks, then rerun this cell.",
                                          name=module)
        else:
            raise ModuleNotFoundError(
                f"{what} needs {module}, which is not installed here. Install it with `pip install '{spec}'` "
                f"(or the course's extras: `pip install -e '.[course,serve]'`, as `make setup` and environment.yml do), "
                f"then restart the kernel and rerun this cell.", name=module)
    return importlib.import_module(module)
