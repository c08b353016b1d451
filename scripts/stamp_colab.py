"""Write minipaged.colab.install_cell_source() as the first code cell of every lesson and workbook.

    python scripts/stamp_colab.py            # notebooks/ and solutions/ (the defaults)
    python scripts/stamp_colab.py --check    # change nothing; exit 1 if a notebook is out of step
    python scripts/stamp_colab.py PATH...    # only these notebooks or folders

Idempotent, and it touches nothing but that one cell: if the first code cell carries
``minipaged.colab.CELL_MARKER`` its source is replaced (its outputs kept only if they are the
one "minipaged ... ready" line a cell that had nothing to install prints), otherwise a new cell is put before the first code cell. A notebook whose cell is
already right is not rewritten at all. Files are written the way nbformat writes them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipaged.colab import CELL_MARKER, install_cell_source  # noqa: E402

DEFAULT_DIRS = ("notebooks", "solutions")
CELL_ID = "minipaged-setup"


def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)  # nbformat's on-disk form: a list of lines


def _only_the_ready_line(outputs: list) -> bool:
    """Outputs an install cell that did not need to install prints, whatever its source: one
    "minipaged <version> ready; ..." line (the version is the one the notebook was run with)."""
    texts = ["".join(o.get("text", "")) for o in outputs]
    return (len(outputs) == 1 and outputs[0].get("output_type") == "stream"
            and outputs[0].get("name") == "stdout" and texts[0].startswith("minipaged ") and " ready;" in texts[0])


def stamp(nb: dict) -> bool:
    """Make the first code cell of ``nb`` (a notebook as JSON) the install cell; True if changed."""
    want = install_cell_source()
    cells = nb.setdefault("cells", [])
    first = next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"), None)
    if first is not None and _source(cells[first]) == want:
        return False
    if first is not None and CELL_MARKER in _source(cells[first]):
        cell = cells[first]
        cell["source"] = _lines(want)
        if not _only_the_ready_line(cell.get("outputs", [])):
            cell["outputs"] = []  # they came from another source
            cell["execution_count"] = None
        return True
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": _lines(want)}
    if (nb.get("nbformat", 4), nb.get("nbformat_minor", 0)) >= (4, 5):
        ids = {c.get("id") for c in cells}
        cid, k = CELL_ID, 1
        while cid in ids:
            k += 1
            cid = f"{CELL_ID}-{k}"
        cell = {"cell_type": "code", "execution_count": None, "id": cid, "metadata": {}, "outputs": [], "source": _lines(want)}
    cells.insert(len(cells) if first is None else first, cell)
    return True


def dumps(nb: dict) -> str:
    # What nbformat.write produces, so a stamped file differs from the original only in the cell.
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False, separators=(",", ": ")) + "\n"


def notebooks(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.glob("*.ipynb") if not q.name.startswith("."))
        elif p.suffix == ".ipynb" and p.is_file():
            found.append(p)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/ and solutions/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if any notebook would change")
    a = ap.parse_args(argv)
    paths = a.paths or [str(ROOT / d) for d in DEFAULT_DIRS]
    stale = []
    for path in notebooks(paths):
        nb = json.loads(path.read_text(encoding="utf-8"))
        if stamp(nb):
            stale.append(path)
            if not a.check:
                path.write_text(dumps(nb), encoding="utf-8")
    verb = "out of step" if a.check else "stamped"
    for p in stale:
        print(f"{verb}: {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}")
    if not stale:
        print("every notebook already starts with the install cell")
    return 1 if (a.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
