"""The course's workbooks as files: their names, which file is which learner's, and running
a workbook's code cells (without its checks) to take the definitions out of it.

Used by the grader (minipaged.checks.grading) and by workbook 07, which assembles a learner's
parts from their own earlier workbooks.
"""
from __future__ import annotations

import linecache
import os
import re
from pathlib import Path
from typing import Any

WORKBOOKS = [
    "01_kv_cache_math",
    "02_block_allocator",
    "03_block_table",
    "04_paged_attention_torch",
    "05_triton_decode_kernel",
    "06_scheduler",
    "07_assemble",
    "08_prefix_caching",
    "09_speculative_decoding",
    "10_predict_and_measure",
    "11_structured_outputs",
    "12_kv_connector",
]
# Workbooks whose checks load the model: a grader imports what the model load imports (torch._dynamo, which
# rebinds torch.manual_seed) before it takes its snapshot, and the mutation script loads the model once.
MODEL_WORKBOOKS = ("07_assemble", "09_speculative_decoding", "10_predict_and_measure", "11_structured_outputs",
                   "12_kv_connector")
CHECK_PREFIX = "# CHECK"
_SEPARATORS = " _-.()[]"


def is_check_cell(cell: Any) -> bool:
    if cell.get("cell_type") != "code":
        return False
    tags = cell.get("metadata", {}).get("tags", []) or []
    return "check" in tags or cell.get("source", "").lstrip().startswith(CHECK_PREFIX)


def check_name(cell: Any, index: int) -> str:
    first = cell.get("source", "").lstrip().split("\n", 1)[0]
    if first.startswith(CHECK_PREFIX):
        name = first[len(CHECK_PREFIX):].lstrip(":").strip()
        if name:
            return name
    return f"check in cell {index}"


def identify(filename: str) -> str | None:
    """Which workbook a file is, from its name: '02_block_allocator', or None."""
    low = Path(filename).name.lower()
    for stem in WORKBOOKS:
        if stem in low:
            return stem
    m = re.search(r"(?:^|[^0-9])(0[1-9]|1[0-9])(?:[^0-9]|$)", low)
    if m:
        for stem in WORKBOOKS:
            if stem.startswith(m.group(1) + "_"):
                return stem
    return None


def learner_from_name(filename: str, stem: str | None) -> str:
    """What is left of a file name once the workbook's name is taken out: 'alice' from
    'alice_02_block_allocator.ipynb' or '02_block_allocator (alice).ipynb'; '' if nothing."""
    name = Path(filename).name
    if "." in name:
        name = name[: name.rindex(".")]
    low = name.lower()
    if stem and stem in low:
        i = low.index(stem)
        name = name[:i] + " " + name[i + len(stem):]
    else:
        name = re.sub(r"(?:^|[^0-9])(?:0[1-9]|1[0-9])(?=[^0-9]|$)", " ", name)
    name = re.sub(r"(?i)\bcopy of\b", " ", name)
    name = re.sub(r"(?i)\bsolution(s)?\b", " ", name)
    return name.strip(_SEPARATORS).strip()


def find_workbook(folder: str | os.PathLike, stem: str, learner: str | None = None) -> tuple[Path | None, list[Path]]:
    """The file in ``folder`` that is workbook ``stem`` (of ``learner``, when several are), and all candidates."""
    folder = Path(folder)
    candidates = sorted(p for p in folder.glob("*.ipynb") if identify(p.name) == stem)
    if learner:
        mine = [p for p in candidates if learner_from_name(p.name, stem).lower() == learner.lower()]
        if mine:
            candidates = mine
        else:
            candidates = [p for p in candidates if not learner_from_name(p.name, stem)]
    if not candidates:
        return None, []
    exact = [p for p in candidates if p.name == f"{stem}.ipynb"]
    if exact:
        return exact[0], candidates
    return max(candidates, key=lambda p: p.stat().st_mtime), candidates


def _python_only(source: str) -> str:
    # IPython magics and shell escapes are not Python; a learner's `%time` must not break the import.
    return "\n".join("pass  # " + ln if ln.lstrip().startswith(("%", "!")) else ln for ln in source.split("\n"))


def run_workbook_cells(path: str | os.PathLike, namespace: dict | None = None) -> dict:
    """Execute the code cells of the notebook at ``path`` into a namespace, skipping the
    install cell and the check cells; return the namespace. Errors keep their cell's name."""
    import nbformat

    from ..colab import CELL_MARKER

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    ns = namespace if namespace is not None else {"__name__": f"workbook_{path.stem}"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or is_check_cell(cell) or CELL_MARKER in cell.source:
            continue
        src = _python_only(cell.source)
        filename = f"<{path.name}, cell {i}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), ns)
    return ns
