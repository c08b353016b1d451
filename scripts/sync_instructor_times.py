"""Copy each lesson's stored run time (notebooks/timings.md, written by `make notebooks`) into
docs/instructor.md: the run-time column of the lesson table ("| 07 ... | 129 s ...") and the
two-day plan's "[129 s]" slots. `make notebooks` runs it; tests/test_workshop_plan.py checks both."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    timings = (ROOT / "notebooks" / "timings.md").read_text(encoding="utf-8")
    secs = {m.group(1)[:2]: int(m.group(2)) for m in re.finditer(r"^\| `(\d\d_\w+)` \| (\d+) \|", timings, flags=re.M)}
    doc_path = ROOT / "docs" / "instructor.md"
    doc = doc_path.read_text(encoding="utf-8")

    def column(m: re.Match) -> str:
        num = m.group(2)
        return f"{m.group(1)}{secs[num]} s" if num in secs else m.group(0)

    doc = re.sub(r"^(\| (\d\d) [^|]+\| )\d+ s", column, doc, flags=re.M)
    start = doc.index("## Two-day workshop")
    end = doc.index("\n## ", start + 5)
    plan = re.sub(r"(\| (\d\d) [^|\n]*?\[)\d+ s\]", lambda m: f"{m.group(1)}{secs.get(m.group(2), '?')} s]", doc[start:end])
    doc = doc[:start] + plan + doc[end:]
    doc_path.write_text(doc, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
