"""Plant a bug in a copy of the package and show that the lesson built on that part fails.

A lesson asserts what it shows, so a broken part must break its lesson under nbval. Each case
copies ``minipaged/`` into a temporary folder, rewrites one line of one part (the decode
kernel, the reference attention, the allocator, the scheduler), and runs the matching lesson with that copy first on
PYTHONPATH, so the notebook's kernel imports the broken package. The unplanted copy must
pass (the failures come from the bug, not from the copying). Slow: each runs one lesson.

If a plant's target line is gone (the part was rewritten), the test fails and says which
pattern to update; it never passes by planting nothing.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


@dataclass(frozen=True)
class Plant:
    name: str
    lesson: str
    path: str  # inside minipaged/
    pattern: str  # a regex that must match at least once
    replacement: str
    expect: str  # what the failing run must say (the lesson's own message), or "" for any failure
    needs: str = ""  # a module the lesson needs to exercise the part ("" for none)


PLANTS = [
    # The decode kernel with a doubled softmax scale: the error printed 1.1 instead of 3.6e-7.
    Plant("decode kernel: doubled softmax scale", "05_triton_kernel", "attention/triton_paged.py",
          r"(?m)^(\s+)scale \* LOG2E, tokens_per_split,", r"\g<1>2 * scale * LOG2E, tokens_per_split,",
          "the decode kernel is off the reference", needs="triton"),
    # The reference attention's causal mask hides each token from itself (lesson 04 builds it).
    Plant("reference attention: causal mask off by one", "04_paged_attention_torch", "attention/reference.py",
          r"masked_fill\(k_pos > q_pos,", "masked_fill(k_pos >= q_pos,", "AssertionError"),
    # The allocator hands the most recently freed block out first (a LIFO free list).
    Plant("allocator: freed blocks go to the front", "02_block_allocator", "block_allocator.py",
          r"(self\.\w*free\w*)\.append\(block_id\)", r"\1.appendleft(block_id)",
          "a freed block goes to the END of the free list"),
    # The allocator frees a shared block while another sequence still holds it.
    Plant("allocator: ref counts ignored on free", "02_block_allocator", "block_allocator.py",
          r"(self\._?ref_counts\[block_id\] -= 1\s*\n\s*)if self\._?ref_counts\[block_id\] == 0:", r"\1if True:",
          "a shared block must stay allocated"),
    # The scheduler admits one sequence more than max_num_seqs.
    Plant("scheduler: one seat too many", "06_continuous_batching", "scheduler.py",
          r"seats < (self\.max_num_seqs):(\s*)seq = self\.waiting\[0\](\s*)if seats \+ 1 \+ len\(seq\.forks\) > self\.max_num_seqs:",
          r"seats <= \1:\2seq = self.waiting[0]\3if seats + len(seq.forks) > self.max_num_seqs:", ""),
    # The machine profile's linear layers timed three times too slow (a wrong profile): every lesson that
    # predicts a time from it must miss beyond its tolerance and fail (the fitted overheads cannot go below
    # zero to hide it, and the one retry measures the same wrong profile again).
    *[Plant(f"machine profile: linear layers 3x too slow ({lesson[:2]})", lesson, "machine.py",
            r'LinearProfile\(lp\["rows"\], lower_envelope\(lp\["body_s"\]\)',
            r'LinearProfile(lp["rows"], [3 * t for t in lower_envelope(lp["body_s"])]', "beyond tolerance")
      for lesson in ("07_whole_engine", "12_speculative_decoding")],
    # (A cost model that drops its overheads is planted in tests/test_machine.py against a real engine's step:
    # in a lesson, the plain route's overheads are a third of a batch-1 step or less, within a step's noise of
    # the 25% tolerance, and the fit absorbs a dropped operator term, so such a lesson plant passes by chance.)
]


def planted_copy(dest: Path, plant: Plant | None) -> Path:
    """A copy of minipaged/ under ``dest`` with ``plant`` applied; returns the folder to put on PYTHONPATH."""
    shutil.copytree(ROOT / "minipaged", dest / "minipaged", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if plant is not None:
        f = dest / "minipaged" / plant.path
        text = f.read_text(encoding="utf-8")
        new, n = re.subn(plant.pattern, plant.replacement, text)
        if n == 0:
            pytest.fail(f"planted bug {plant.name!r}: pattern {plant.pattern!r} no longer matches minipaged/{plant.path}; "
                        "update PLANTS in tests/test_planted_bugs.py to the part's new source")
        f.write_text(new, encoding="utf-8")
    return dest


def run_lesson(name: str, pythonpath: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINIPAGED_STATIC="1", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               PYTHONPATH=os.pathsep.join([str(pythonpath)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           "--nbval-cell-timeout=600", f"--nbval-sanitize-with={NOTEBOOKS / 'nbval_sanitize.cfg'}",
           str(NOTEBOOKS / f"{name}.ipynb")]
    # cwd: the notebook runs from notebooks/, which holds no package, so PYTHONPATH decides
    return subprocess.run(cmd, cwd=NOTEBOOKS, env=env, capture_output=True, text=True, timeout=900)


def test_every_plant_matches_the_current_source():
    """Fast: each plant still finds its line and changes it (so the slow tests below plant a real bug)."""
    for plant in PLANTS:
        text = (ROOT / "minipaged" / plant.path).read_text(encoding="utf-8")
        new, n = re.subn(plant.pattern, plant.replacement, text)
        assert n >= 1 and new != text, f"{plant.name}: pattern {plant.pattern!r} matches nothing in minipaged/{plant.path}"
        assert (NOTEBOOKS / f"{plant.lesson}.ipynb").is_file(), plant.lesson


def test_the_decode_kernel_plant_breaks_the_kernel_itself():
    """The kernel plant really changes results (so lesson 05 failing is the lesson noticing, not luck)."""
    pytest.importorskip("triton")
    code = (
        "import os, torch\n"
        "if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'\n"
        "from minipaged.attention import triton_paged\n"
        "from minipaged.attention.reference import paged_attention\n"
        "torch.manual_seed(0)\n"
        "k = torch.randn(8, 16, 2, 32); v = torch.randn_like(k); q = torch.randn(2, 4, 32)\n"
        "bt = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32); cl = torch.tensor([20, 9], dtype=torch.int32)\n"
        "ref = paged_attention(q, k, v, bt, cl, torch.arange(3, dtype=torch.int32), 32 ** -0.5)\n"
        "print((triton_paged.paged_decode(q, k, v, bt, cl, 32 ** -0.5) - ref).abs().max().item())\n"
    )
    errs = {}
    for label, plant in (("clean", None), ("planted", PLANTS[0])):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = planted_copy(Path(d), plant)
            env = dict(os.environ, PYTHONPATH=str(path), PYTHONDONTWRITEBYTECODE="1")
            r = subprocess.run([sys.executable, "-c", code], env=env, cwd=d, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            errs[label] = float(r.stdout.strip().splitlines()[-1])
    assert errs["clean"] < 1e-5 and errs["planted"] > 1e-2, errs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_unplanted_copy_passes(tmp_path):
    """The control: the copying itself breaks nothing, so the failures below are the bugs'."""
    r = run_lesson("02_block_allocator", planted_copy(tmp_path, None))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("plant", PLANTS, ids=[p.name for p in PLANTS])
def test_the_matching_lesson_fails(plant, tmp_path):
    if plant.needs:
        pytest.importorskip(plant.needs)
    r = run_lesson(plant.lesson, planted_copy(tmp_path, plant))
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"{plant.lesson} still passes with the planted bug {plant.name!r}:\n{out[-3000:]}"
    if plant.expect:
        assert plant.expect in out, f"{plant.lesson} failed, but not on the check for {plant.name!r}:\n{out[-4000:]}"
