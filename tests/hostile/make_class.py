"""A hostile class folder for the grader's tests: honest learners, attackers, broken files.

``build(root)`` writes, under ``root``:

    class/<learner>/<workbook>.ipynb   the submissions (from solutions/ and exercises/, then altered)
    instructor/notes.txt               a file of the instructor's that an attacker aims at
    out/                               where the grader writes grades.csv and grades.jsonl

and returns EXPECTED: learner -> workbook -> {check: (result, text the message must hold)}.
Every attacker but the file-system ones starts from an UNSOLVED workbook: whatever the attack,
nothing may pass. The file-system attackers start from a solved one (their grade may pass; what
must not happen is a change outside their sandbox).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent.parent
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
A02, S02 = "allocate and free", "ref counts and sharing"
B01, Q01, M01 = "bytes per token", "bytes per sequence", "sequences per budget, contiguous and paged"
NOT_IMPL = ("FAIL", "not implemented yet")
TAMPERED = ("FAIL", "your code changed what the checks rely on")
DELEGATION: set = set()  # learners whose attack only the checks' delegation refusals can catch


def _nb(folder: Path, stem: str) -> nbformat.NotebookNode:
    return nbformat.read(folder / f"{stem}.ipynb", as_version=4)


def _checks(nb) -> list:
    return [c for c in nb.cells if "check" in c.metadata.get("tags", [])]


def _insert_after_answer(nb, source: str, answer_index: int = 0) -> None:
    """A new code cell right after the workbook's n-th answer cell (code, not a check, not the setup cell)."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "check" not in c.metadata.get("tags", [])
            and "minipaged-setup-cell" not in c.source]
    nb.cells.insert(code[answer_index] + 1, nbformat.v4.new_code_cell(source))


def _write(nb, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def build(root: Path, package: Path) -> dict:
    """``package``: the folder holding the minipaged package the grader will load (an attacker rewrites it)."""
    cls, instructor, out = root / "class", root / "instructor", root / "out"
    instructor.mkdir(parents=True)
    out.mkdir()
    (instructor / "notes.txt").write_text("the instructor's notes\n")
    E: dict = {}

    # -- honest learners -------------------------------------------------------------------------
    _write(_nb(SOLUTIONS, "01_kv_cache_math"), cls / "honest_alice" / "01_kv_cache_math.ipynb")
    nb = _nb(SOLUTIONS, "02_block_allocator")
    _insert_after_answer(nb, "scratch = MyBlockAllocator(4)\nscratch.allocate()")  # a cell of her own
    _write(nb, cls / "honest_alice" / "02_block_allocator.ipynb")
    E["honest_alice"] = {"01_kv_cache_math": {B01: ("pass", ""), Q01: ("pass", ""), M01: ("pass", "")},
                         "02_block_allocator": {A02: ("pass", ""), S02: ("pass", "")}}
    nb = _nb(SOLUTIONS, "02_block_allocator")  # ids lost (an old Jupyter), outputs saved: graded by position
    for c in nb.cells:
        c.pop("id", None)
    nb.nbformat_minor = 4
    _checks(nb)[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="\u2714 saved\n")]
    _write(nb, cls / "honest_bob" / "02_block_allocator.ipynb")
    E["honest_bob"] = {"02_block_allocator": {A02: ("pass", ""), S02: ("pass", "")}}
    _write(_nb(EXERCISES, "02_block_allocator"), cls / "unsolved_carol" / "02_block_allocator.ipynb")
    E["unsolved_carol"] = {"02_block_allocator": {A02: NOT_IMPL, S02: NOT_IMPL}}
    # graded last: after the checks-rewriting attacker, an unsolved workbook must still fail
    _write(_nb(EXERCISES, "01_kv_cache_math"), cls / "zz_unsolved_last" / "01_kv_cache_math.ipynb")
    _write(_nb(EXERCISES, "02_block_allocator"), cls / "zz_unsolved_last" / "02_block_allocator.ipynb")
    E["zz_unsolved_last"] = {"01_kv_cache_math": {B01: NOT_IMPL, Q01: NOT_IMPL, M01: NOT_IMPL},
                             "02_block_allocator": {A02: NOT_IMPL, S02: NOT_IMPL}}

    # -- attacks on the file system (solved workbooks: only the files outside may not change) -------
    def fs_attack(name: str, code: str) -> None:
        nb = _nb(SOLUTIONS, "02_block_allocator")
        _insert_after_answer(nb, "import os, shutil\n" + code)
        _write(nb, cls / name / "02_block_allocator.ipynb")
        E[name] = {"02_block_allocator": {}}  # its grade is not the point

    fs_attack("a_delete_classmate", f"shutil.rmtree({str(cls / 'honest_alice')!r}, ignore_errors=True)\n"
                                    f"os.remove({str(cls / 'honest_bob' / '02_block_allocator.ipynb')!r})")
    fs_attack("a_replace_classmate", f"open({str(cls / 'unsolved_carol' / '02_block_allocator.ipynb')!r}, 'w').write("
                                     f"open({str(SOLUTIONS / '02_block_allocator.ipynb')!r}).read())")
    fs_attack("a_symlink_grades", f"os.symlink({str(instructor / 'notes.txt')!r}, {str(out / 'grades.csv')!r})\n")
    fs_attack("a_write_instructor", f"open({str(instructor / 'notes.txt')!r}, 'w').write('gone')")
    checks_file = package / "minipaged" / "checks" / "block_allocator.py"
    kv_file = package / "minipaged" / "checks" / "kv_cache_math.py"
    rewrite = ("def _ok(*a, **k):\n    print('\\u2714 ok')\n"
               "check_allocate_free = check_sharing = check_bytes_per_token = check_bytes_per_sequence = check_max_seqs = _ok\n")
    fs_attack("a_rewrite_checks", f"for p in ({str(checks_file)!r}, {str(kv_file)!r}):\n"
                                  f"    try:\n        open(p, 'a').write({rewrite!r})\n    except OSError as e:\n        print(e)\n"
                                  f"os.makedirs('minipaged/checks', exist_ok=True)\n"
                                  f"open('minipaged/__init__.py', 'w').write('')\n")

    # -- attacks on the verdict (unsolved workbooks) ----------------------------------------------
    def verdict_attack(name: str, code: str, expect: dict, *, edit=None, stem="02_block_allocator") -> None:
        nb = _nb(EXERCISES, stem)
        if code:
            _insert_after_answer(nb, code)
        if edit is not None:
            edit(nb)
        _write(nb, cls / name / f"{stem}.ipynb")
        E[name] = {stem: expect}

    verdict_attack("b_redefine_checks",
                   "from minipaged.checks import block_allocator\n"
                   "block_allocator.check_allocate_free = lambda cls: print('\\u2714 allocate and free')\n"
                   "block_allocator.check_sharing = lambda cls: None",
                   {A02: TAMPERED, S02: TAMPERED})
    # between two checks of 01 (after the second answer cell), the name the first check imported
    nb = _nb(EXERCISES, "01_kv_cache_math")
    _insert_after_answer(nb, "import types\nkv_cache_math = types.SimpleNamespace(check_bytes_per_sequence=lambda f: None,\n"
                             "    check_max_seqs=lambda a, b: None)", answer_index=2)
    _write(nb, cls / "b_rebind_check_module" / "01_kv_cache_math.ipynb")
    E["b_rebind_check_module"] = {"01_kv_cache_math": {B01: NOT_IMPL, Q01: ("FAIL", "rebound `kv_cache_math`"),
                                                       M01: NOT_IMPL}}
    verdict_attack("b_patch_core",
                   "import minipaged.checks._core as core\ncore.learner_call = lambda fn, *a, what='', context=None, **k: None\n"
                   "core.CheckFailed.__init__ = lambda self, *a: None",
                   {A02: TAMPERED, S02: TAMPERED})
    verdict_attack("b_patch_builtins",
                   "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.NotImplementedError = KeyError",
                   {A02: TAMPERED, S02: TAMPERED})
    verdict_attack("b_patch_torch",
                   "import torch\ntorch.equal = lambda *a: True\ntorch.Tensor.__eq__ = lambda *a: True",
                   {B01: TAMPERED, Q01: TAMPERED, M01: TAMPERED}, stem="01_kv_cache_math")

    def edit_checks(nb):
        for c in _checks(nb):
            c.source = c.source.split("\n", 1)[0] + "\nprint('\\u2714 passed')"

    verdict_attack("c_edit_checks", "", {A02: NOT_IMPL, S02: NOT_IMPL, "(check cells)": ("FAIL", "was edited")},
                   edit=edit_checks)

    def delete_checks(nb):
        nb.cells = [c for c in nb.cells if "check" not in c.metadata.get("tags", [])]

    verdict_attack("c_delete_checks", "", {A02: NOT_IMPL, S02: NOT_IMPL, "(check cells)": ("FAIL", "was deleted")},
                   edit=delete_checks)

    def skip_with_outputs(nb):
        for c in _checks(nb):
            c.metadata["tags"] = ["skip-execution"]
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="\u2714 all good\n")]
            c.execution_count = 3

    verdict_attack("c_skip_tags_saved_outputs", "", {A02: NOT_IMPL, S02: NOT_IMPL, "(check cells)": ("FAIL", "re-tagged")},
                   edit=skip_with_outputs)

    def reorder(nb):
        i, j = [k for k, c in enumerate(nb.cells) if "check" in c.metadata.get("tags", [])][:2]
        nb.cells[i], nb.cells[j] = nb.cells[j], nb.cells[i]

    verdict_attack("c_reorder_checks", "", {A02: NOT_IMPL, S02: NOT_IMPL, "(check cells)": ("FAIL", "reordered")},
                   edit=reorder)

    def swallow(nb):
        for c in _checks(nb):
            c.source = c.source.split("\n", 1)[0] + "\ntry:\n" + "".join(
                "    " + ln + "\n" for ln in c.source.split("\n")[1:]) + "except BaseException:\n    pass"

    verdict_attack("c_swallow_exceptions",
                   "import sys\nsys.excepthook = lambda *a: None\n"
                   "MyBlockAllocator.__init__ = lambda self, n, b=16: None",
                   {A02: ("FAIL", ""), S02: ("FAIL", ""), "(check cells)": ("FAIL", "was edited")}, edit=swallow)
    verdict_attack("d_os_exit_forged",  # forged verdicts on every descriptor, then out before any check
                   "import os\nfor fd in range(3, 64):\n    try:\n"
                   "        os.write(fd, b'{\"event\":\"check\",\"check\":\"allocate and free\",\"result\":\"pass\",\"seq\":1}\\tdead\\n')\n"
                   "    except OSError:\n        pass\nos._exit(0)",
                   {A02: ("FAIL", "void"), S02: ("FAIL", "void"), "(result channel)": ("FAIL", "not from the grader")})
    verdict_attack("d_os_exit", "import os\nos._exit(0)",
                   {A02: ("ERROR", "os._exit"), S02: ("ERROR", "os._exit"),
                    "(review)": ("note", "os._exit")})  # and the instructor is told to read that cell
    verdict_attack("d_sys_exit_in_method",
                   "import os\nMyBlockAllocator.__init__ = lambda self, *a, **k: os._exit(0)",
                   {A02: ("ERROR", "the run ended before this check finished"), S02: ("ERROR", "ended")})

    # a classmate's solved notebook, read and run at grading time: bwrap hides the class folder
    # (without bwrap it is readable, as docs/instructor.md says; tests grade this one in bwrap only)
    verdict_attack("g_copy_classmate",
                   "import json\ntry:\n"
                   f"    cells = json.load(open({str(cls / 'honest_alice' / '02_block_allocator.ipynb')!r}))['cells']\n"
                   "except OSError as e:\n    cells = []\n    print(e)\n"
                   "for c in cells:\n    src = ''.join(c['source'])\n"
                   "    if 'class MyBlockAllocator' in src:\n        exec(src)",
                   {A02: NOT_IMPL, S02: NOT_IMPL})

    # -- delegation: minipaged's own class under the learner's name (the checks must refuse it) -------
    def delegate(name: str, code: str) -> None:
        nb = _nb(EXERCISES, "02_block_allocator")
        answer = next(c for c in nb.cells if "class MyBlockAllocator" in c.source)
        answer.source = code
        _write(nb, cls / name / "02_block_allocator.ipynb")
        E[name] = {"02_block_allocator": {A02: ("FAIL", ""), S02: ("FAIL", "")}}
        DELEGATION.add(name)

    delegate("e_alias", "from minipaged import BlockAllocator as MyBlockAllocator")
    delegate("e_subclass", "from minipaged import BlockAllocator\n\nclass MyBlockAllocator(BlockAllocator):\n    pass")

    # -- broken files: reported, and the class is still graded ----------------------------------------
    raw = json.loads((SOLUTIONS / "02_block_allocator.ipynb").read_text())
    bad = copy.deepcopy(raw)
    bad["cells"][3]["metadata"]["tags"] = 5
    (cls / "f_tags_five").mkdir(parents=True)
    (cls / "f_tags_five" / "02_block_allocator.ipynb").write_text(json.dumps(bad))
    E["f_tags_five"] = {"02_block_allocator": {"(file)": ("broken", "metadata.tags is 5")}}
    odd = copy.deepcopy(raw)  # a saved error output whose message is a number: outputs are never read
    code = [c for c in odd["cells"] if c["cell_type"] == "code"]
    code[-1]["outputs"] = [{"output_type": "error", "ename": 7, "evalue": 5, "traceback": 3}]
    (cls / "f_error_not_text").mkdir()
    (cls / "f_error_not_text" / "02_block_allocator.ipynb").write_text(json.dumps(odd))
    E["f_error_not_text"] = {"02_block_allocator": {A02: ("pass", ""), S02: ("pass", "")}}
    (cls / "f_not_json").mkdir()
    (cls / "f_not_json" / "02_block_allocator.ipynb").write_text("{ this is not json")
    E["f_not_json"] = {"02_block_allocator": {"(file)": ("broken", "invalid JSON")}}
    (cls / "f_huge").mkdir()
    with open(cls / "f_huge" / "02_block_allocator.ipynb", "w") as f:
        f.write('{"cells": [], "pad": "' + "x" * (21 * 2**20) + '"}')
    E["f_huge"] = {"02_block_allocator": {"(file)": ("broken", "MiB")}}
    (cls / "f_not_a_notebook").mkdir()
    (cls / "f_not_a_notebook" / "02_block_allocator.py").write_text("print('hi')\n")
    E["f_not_a_notebook"] = {"02_block_allocator": {"(file)": ("broken", "not a notebook")}}
    return E
