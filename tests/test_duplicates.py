"""The package says a thing once: `duplicates` (a command of the workplace this course is built in,
not a Python package) lists the pairs of places in minipaged/ that share six or more identical or
same-shape lines, and issue 34 brought them down to at most MAX_PAIRS by sharing code (a helper, a
table, a loop over data). A change that writes a piece of logic again shows here, with the pairs.

Where the command is not installed (a learner's machine, most CI runners) the test is skipped.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MAX_PAIRS = 10
PKG = Path(__file__).resolve().parents[1] / "minipaged"


def test_minipaged_repeats_itself_in_at_most_ten_pairs_of_places():
    exe = shutil.which("duplicates")
    if exe is None:
        pytest.skip("the `duplicates` command is not on PATH (a tool of the workplace, not a package)")
    res = subprocess.run([exe, "--most", "200", "--seconds", "120"], cwd=PKG, capture_output=True, text=True,
                         timeout=300)
    report = res.stdout + res.stderr
    if "incomplete:" in report:
        pytest.skip("duplicates did not read or pair the whole package, so its count says nothing:\n" + report)
    first = report.splitlines()[0] if report.strip() else ""
    m = re.match(r"(\d+) pairs? of places", first)
    if m is None and not first.startswith("no duplicates"):
        pytest.skip(f"duplicates answered in a form this test does not know: {first!r}")
    pairs = int(m.group(1)) if m else 0
    assert pairs <= MAX_PAIRS, (f"minipaged/ has {pairs} pairs of places that repeat each other (at most {MAX_PAIRS}): "
                                "share the logic instead of writing it again\n" + report)
