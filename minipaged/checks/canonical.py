"""Which cells of a submission the grader runs: the learner's answer cells, placed by the
pristine exercise's cell ids (falling back on position), and the exercise's own check cells.

Owns reading a submitted notebook defensively (it may be huge, malformed or hostile) and
comparing its check cells with the pristine ones. Never runs anything and never reads a
submission's saved outputs: what a notebook claims about itself is not evidence.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._workbooks import CHECK_PREFIX, check_name

MAX_NOTEBOOK_BYTES = 20 * 2**20  # a workbook with its outputs is well under 1 MiB
MAX_CELLS = 2000
SETUP_MARKER = "# minipaged-setup-cell"  # minipaged.colab.CELL_MARKER, kept here so this module imports nothing heavy


class BrokenNotebook(ValueError):
    """The file is not a notebook the grader can read; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Cell:
    kind: str  # "code" (the learner's) or "check" (the pristine exercise's)
    source: str
    label: str  # "check 'allocate and free'" or "cell 3"
    check: str = ""  # the check's name, for kind == "check"


@dataclass
class Plan:
    workbook: str
    cells: list[Cell]
    checks: list[str]  # the pristine check names, in order
    tampering: list[str] = field(default_factory=list)  # what differs in the submission's check cells
    notes: list[str] = field(default_factory=list)  # harmless differences worth a line (missing answer cell, ...)


# -- reading a notebook without trusting it ---------------------------------------------------------
def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return "".join(value)
    raise BrokenNotebook(f"{where} is {type(value).__name__} {_short(value)}, not text: "
                         "re-download the notebook from Jupyter or Colab (File > Download > .ipynb)")


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def read_cells(path: str | Path) -> list[dict]:
    """The notebook's cells as plain dicts {id, cell_type, source, tags}; BrokenNotebook if it cannot be read.

    Only what grading needs is looked at; outputs are ignored whatever they hold."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise BrokenNotebook(f"cannot read the file: {e.strerror}") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise BrokenNotebook(f"the file is {size / 2**20:.0f} MiB, over the grader's {MAX_NOTEBOOK_BYTES // 2**20} MiB: "
                             "clear the outputs (Edit > Clear All Outputs), save, and submit again")
    try:
        raw = path.read_bytes()
        nb = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BrokenNotebook(f"not a notebook: byte {e.start} is not UTF-8 text; submit the .ipynb file") from None
    except json.JSONDecodeError as e:
        raise BrokenNotebook(f"not a notebook: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}); "
                             "submit the .ipynb file as Jupyter saved it") from None
    except RecursionError:
        raise BrokenNotebook("not a notebook: its JSON is nested too deeply") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise BrokenNotebook("not a notebook: no list of cells at the top level (is it an nbformat 4 .ipynb file?)")
    if len(nb["cells"]) > MAX_CELLS:
        raise BrokenNotebook(f"{len(nb['cells'])} cells, over the grader's {MAX_CELLS}")
    cells = []
    for i, c in enumerate(nb["cells"]):
        where = f"cell {i}"
        if not isinstance(c, dict):
            raise BrokenNotebook(f"{where} is {type(c).__name__} {_short(c)}, not a cell")
        ctype = c.get("cell_type")
        if not isinstance(ctype, str):
            raise BrokenNotebook(f"{where}: cell_type is {_short(ctype)}, not a string")
        meta = c.get("metadata", {})
        if not isinstance(meta, dict):
            raise BrokenNotebook(f"{where}: metadata is {_short(meta)}, not an object")
        tags = meta.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BrokenNotebook(f"{where}: metadata.tags is {_short(tags)}, not a list of strings "
                                 "(restore the cell from the exercise)")
        cid = c.get("id")
        cells.append({"id": cid if isinstance(cid, str) else None, "cell_type": ctype,
                      "source": _text(c.get("source", ""), f"{where}: source"), "tags": list(tags)})
    return cells


# -- placing the learner's cells around the pristine checks ---------------------------------------
def _looks_like_check(cell: dict) -> bool:
    return "check" in cell["tags"] or cell["source"].lstrip().startswith(CHECK_PREFIX)


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def build_plan(pristine_path: str | Path, submission_path: str | Path, workbook: str) -> Plan:
    """The cells to run for one submission; BrokenNotebook if the submission cannot be read.

    Code cells of the pristine exercise that are checks run from the exercise itself. The learner's
    other code cells are placed in the segment (before which check) their pristine counterpart sits
    in, found by cell id; a cell the learner added goes with the cell before it. When no id matches
    (a notebook that lost its ids), a learner's cell goes before the next cell that looks like a
    check. The setup (install) cell and cells after the last check are not run."""
    pristine = [c for c in read_cells(pristine_path) if c["cell_type"] == "code"]
    learner = [c for c in read_cells(submission_path) if c["cell_type"] == "code"]
    checks = [i for i, c in enumerate(pristine) if _looks_like_check(c)]
    names = [check_name(pristine[i], i) for i in checks]
    segment_of = {}  # pristine code index -> segment (how many checks come before it)
    seen = 0
    for i, c in enumerate(pristine):
        if i in checks:
            seen += 1
        else:
            segment_of[i] = seen
    by_id = {c["id"]: i for i, c in enumerate(pristine) if c["id"]}
    use_ids = any(c["id"] in by_id for c in learner)
    plan = Plan(workbook, [], names)

    # the submission's counterpart of each pristine check, to say how it was changed
    matched_checks: dict[int, int] = {}  # pristine index -> learner index
    for j, c in enumerate(learner):
        i = by_id.get(c["id"]) if use_ids else None
        if i is None:
            i = next((k for k in checks if _norm(pristine[k]["source"]) == _norm(c["source"]) and k not in matched_checks), None)
        if i in checks and i not in matched_checks:
            matched_checks[i] = j
    for k, i in enumerate(checks):
        name = names[k]
        j = matched_checks.get(i)
        if j is None:
            plan.tampering.append(f"check '{name}' was deleted")
            continue
        mine, theirs = learner[j], pristine[i]
        if _norm(mine["source"]) != _norm(theirs["source"]):
            plan.tampering.append(f"check '{name}' was edited")
        if sorted(mine["tags"]) != sorted(theirs["tags"]):
            plan.tampering.append(f"check '{name}' was re-tagged ({mine['tags']} instead of {theirs['tags']})")
    order = [matched_checks[i] for i in checks if i in matched_checks]
    if order != sorted(order):
        plan.tampering.append("check cells were reordered")

    segments: list[list[tuple[int, dict]]] = [[] for _ in range(len(checks) + 1)]
    check_positions = set(matched_checks.values())
    current = 0
    placed_pristine = set()
    for j, c in enumerate(learner):
        if j in check_positions:
            if not use_ids:
                current = min(len(checks), current + 1)
            continue
        if SETUP_MARKER in c["source"]:
            continue
        i = by_id.get(c["id"]) if use_ids else None
        if i is not None and i in segment_of:
            current = segment_of[i]
            placed_pristine.add(i)
        elif _looks_like_check(c):
            plan.notes.append(f"cell {j}: looks like a check but is none of the exercise's; not run")
            continue
        segments[current].append((j, c))
    if use_ids:
        for i, c in enumerate(pristine):
            if i in segment_of and i not in placed_pristine and SETUP_MARKER not in c["source"]:
                plan.notes.append(f"the exercise's code cell {i} is missing; its definitions are not there")
    for k in range(len(checks)):
        for j, c in segments[k]:
            plan.cells.append(Cell("code", c["source"], f"code cell {j}"))
        plan.cells.append(Cell("check", pristine[checks[k]]["source"], f"check '{names[k]}'", names[k]))
    return plan
