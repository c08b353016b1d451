"""A hostile class folder for the grader's tests: honest learners, attackers, broken files.

``build(root)`` writes, under ``root``:

    class/<learner>/<workbook>.ipynb   the submissions (from solutions/ and exercises/, then altered)
    instructor/notes.txt               a file of the instructor's that an attacker aims at
    out/                               where the grader writes grades.csv and grades.jsonl

and returns EXPECTED: learner -> workbook -> {check: (result, text the message must hold)}.
Most learners hand in workbook 01 (its checks need none of the engine's parts); the delegation
attackers hand in 02. Every attacker but the file-system ones starts from an UNSOLVED workbook: whatever the attack,
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
WB = "01_kv_cache_math"
ALL_PASS = {B01: ("pass", ""), Q01: ("pass", ""), M01: ("pass", "")}
ALL_NOT_IMPL = {B01: NOT_IMPL, Q01: NOT_IMPL, M01: NOT_IMPL}
ALL_TAMPERED = {B01: TAMPERED, Q01: TAMPERED, M01: TAMPERED}
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
    # Workbook 01 carries the class: its checks need none of the engine's parts, so these tests
    # follow the grader alone. 02 is used where a class is the point (delegation).
    nb = _nb(SOLUTIONS, WB)
    _insert_after_answer(nb, "scratch = bytes_per_token(SMOLLM2_135M)", answer_index=1)  # a cell of her own
    _write(nb, cls / "honest_alice" / f"{WB}.ipynb")
    E["honest_alice"] = {WB: ALL_PASS}
    nb = _nb(SOLUTIONS, WB)  # ids lost (an old Jupyter), outputs saved: graded by position
    for c in nb.cells:
        c.pop("id", None)
    nb.nbformat_minor = 4
    _checks(nb)[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="\u2714 saved\n")]
    _write(nb, cls / "honest_bob" / f"{WB}.ipynb")
    E["honest_bob"] = {WB: ALL_PASS}
    _write(_nb(EXERCISES, WB), cls / "unsolved_carol" / f"{WB}.ipynb")
    E["unsolved_carol"] = {WB: ALL_NOT_IMPL}
    # graded last: after the checks-rewriting attacker, an unsolved workbook must still fail
    _write(_nb(EXERCISES, WB), cls / "zz_unsolved_last" / f"{WB}.ipynb")
    E["zz_unsolved_last"] = {WB: ALL_NOT_IMPL}

    # -- attacks on the file system (solved workbooks: only the files outside may not change) -------
    def fs_attack(name: str, code: str) -> None:
        nb = _nb(SOLUTIONS, WB)
        _insert_after_answer(nb, "import os, shutil\n" + code)
        _write(nb, cls / name / f"{WB}.ipynb")
        E[name] = {WB: {}}  # its grade is not the point

    fs_attack("a_delete_classmate", f"shutil.rmtree({str(cls / 'honest_alice')!r}, ignore_errors=True)\n"
                                    f"os.remove({str(cls / 'honest_bob' / (WB + '.ipynb'))!r})")
    fs_attack("a_replace_classmate", f"open({str(cls / 'unsolved_carol' / (WB + '.ipynb'))!r}, 'w').write("
                                     f"open({str(SOLUTIONS / (WB + '.ipynb'))!r}).read())")
    fs_attack("a_symlink_grades", f"os.symlink({str(instructor / 'notes.txt')!r}, {str(out / 'grades.csv')!r})\n")
    fs_attack("a_write_instructor", f"open({str(instructor / 'notes.txt')!r}, 'w').write('gone')")
    checks_file = package / "minipaged" / "checks" / "kv_cache_math.py"
    core_file = package / "minipaged" / "checks" / "_core.py"
    rewrite = ("def _ok(*a, **k):\n    print('\\u2714 ok')\n"
               "check_bytes_per_token = check_bytes_per_sequence = check_max_seqs = _ok\n")
    fs_attack("a_rewrite_checks", f"for p in ({str(checks_file)!r}, {str(core_file)!r}):\n"
                                  f"    try:\n        open(p, 'a').write({rewrite!r})\n    except OSError as e:\n        print(e)\n"
                                  f"os.makedirs('minipaged/checks', exist_ok=True)\n"
                                  f"open('minipaged/__init__.py', 'w').write('')\n")

    # -- attacks on the verdict (unsolved workbooks) ----------------------------------------------
    def verdict_attack(name: str, code: str, expect: dict, *, edit=None, stem=WB, answer_index=0) -> None:
        nb = _nb(EXERCISES, stem)
        if code:
            _insert_after_answer(nb, code, answer_index=answer_index)
        if edit is not None:
            edit(nb)
        _write(nb, cls / name / f"{stem}.ipynb")
        E[name] = {stem: expect}

    verdict_attack("b_redefine_checks",
                   "from minipaged.checks import kv_cache_math\n"
                   "kv_cache_math.check_bytes_per_token = lambda f: print('\\u2714 bytes per token')\n"
                   "kv_cache_math.check_bytes_per_sequence = kv_cache_math.check_max_seqs = lambda *a: None",
                   ALL_TAMPERED)
    # between two checks (after the second answer cell), the name the first check cell imported
    verdict_attack("b_rebind_check_module",
                   "import types\nkv_cache_math = types.SimpleNamespace(check_bytes_per_sequence=lambda f: None,\n"
                   "    check_max_seqs=lambda a, b: None)",
                   {B01: NOT_IMPL, Q01: ("FAIL", "rebound `kv_cache_math`"), M01: NOT_IMPL}, answer_index=2)
    verdict_attack("b_patch_core",
                   "import minipaged.checks._core as core\ncore.learner_call = lambda fn, *a, what='', context=None, **k: None\n"
                   "core.CheckFailed.__init__ = lambda self, *a: None",
                   ALL_TAMPERED)
    verdict_attack("b_patch_builtins",
                   "import builtins, sys\nbuiltins.isinstance = lambda *a: True\nbuiltins.NotImplementedError = KeyError\n"
                   "sys.excepthook = lambda *a: None",
                   ALL_TAMPERED)
    verdict_attack("b_patch_torch",
                   "import torch\ntorch.equal = lambda *a: True\ntorch.Tensor.__eq__ = lambda *a: True",
                   ALL_TAMPERED)

    def edit_checks(nb):
        for c in _checks(nb):
            c.source = c.source.split("\n", 1)[0] + "\nprint('\\u2714 passed')"

    verdict_attack("c_edit_checks", "", {**ALL_NOT_IMPL, "(check cells)": ("FAIL", "was edited")}, edit=edit_checks)

    def delete_checks(nb):
        nb.cells = [c for c in nb.cells if "check" not in c.metadata.get("tags", [])]

    verdict_attack("c_delete_checks", "", {**ALL_NOT_IMPL, "(check cells)": ("FAIL", "was deleted")}, edit=delete_checks)

    def skip_with_outputs(nb):
        for c in _checks(nb):
            c.metadata["tags"] = ["skip-execution"]
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="\u2714 all good\n")]
            c.execution_count = 3

    verdict_attack("c_skip_tags_saved_outputs", "", {**ALL_NOT_IMPL, "(check cells)": ("FAIL", "re-tagged")},
                   edit=skip_with_outputs)

    def reorder(nb):
        i, j = [k for k, c in enumerate(nb.cells) if "check" in c.metadata.get("tags", [])][:2]
        nb.cells[i], nb.cells[j] = nb.cells[j], nb.cells[i]

    verdict_attack("c_reorder_checks", "", {**ALL_NOT_IMPL, "(check cells)": ("FAIL", "reordered")}, edit=reorder)

    def swallow(nb):
        for c in _checks(nb):
            c.source = c.source.split("\n", 1)[0] + "\ntry:\n" + "".join(
                "    " + ln + "\n" for ln in c.source.split("\n")[1:]) + "except BaseException:\n    pass"

    verdict_attack("c_swallow_exceptions",
                   "def bytes_per_token(m):\n    try:\n        raise NotImplementedError()\n    except Exception:\n        return 0",
                   {B01: ("FAIL", "bytes_per_token"), Q01: NOT_IMPL, M01: NOT_IMPL,
                    "(check cells)": ("FAIL", "was edited")}, edit=swallow, answer_index=1)
    verdict_attack("d_os_exit_forged",  # forged verdicts on every descriptor, then out before any check
                   "import os\nfor fd in range(3, 64):\n    try:\n"
                   "        os.write(fd, b'{\"event\":\"check\",\"check\":\"bytes per token\",\"result\":\"pass\",\"seq\":1}\\tdead\\n')\n"
                   "    except OSError:\n        pass\nos._exit(0)",
                   {B01: ("FAIL", "void"), Q01: ("FAIL", "void"), M01: ("FAIL", "void"),
                    "(result channel)": ("FAIL", "not from the grader")})
    verdict_attack("d_os_exit", "import os\nos._exit(0)",
                   {B01: ("ERROR", "os._exit"), Q01: ("ERROR", "os._exit"), M01: ("ERROR", "os._exit"),
                    "(review)": ("note", "os._exit")})  # and the instructor is told to read that cell
    verdict_attack("d_exit_inside_a_check",
                   "import os\ndef bytes_per_token(m):\n    os._exit(0)",
                   {B01: ("ERROR", "the run ended before this check finished"), Q01: ("ERROR", "ended"),
                    M01: ("ERROR", "ended")}, answer_index=1)

    # a classmate's solved notebook, read and run at grading time: bwrap hides the class folder
    # (without bwrap it is readable, as docs/instructor.md says; tests grade this one in bwrap only)
    verdict_attack("g_copy_classmate",
                   "import json\ntry:\n"
                   f"    cells = json.load(open({str(cls / 'honest_alice' / (WB + '.ipynb'))!r}))['cells']\n"
                   "except OSError as e:\n    cells = []\n    print(e)\n"
                   "for c in cells:\n    src = ''.join(c['source'])\n"
                   "    if 'def bytes_per_' in src or 'def max_seqs' in src:\n        exec(src)",
                   ALL_NOT_IMPL, answer_index=3)

    # -- attacks on the machine: memory and output (solved workbooks: the limits hold, the grade stands)
    for name, code in (("h_memory", "hog = bytearray(6 * 2**30)"),
                       ("h_output_flood", "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 2**18)")):
        nb = _nb(SOLUTIONS, WB)
        _insert_after_answer(nb, code)
        _write(nb, cls / name / f"{WB}.ipynb")
        E[name] = {WB: dict(ALL_PASS)}
    E["h_memory"][WB]["code cell 2 (your code, not a check)"] = ("ERROR", "MemoryError")

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

    # -- issue 25: forged passes that got through, and attacks on the grader without bwrap -------------
    # Every i_ attacker below but the file/process ones hands in an UNSOLVED workbook: nothing may pass.
    verdict_attack("i_handle_fromlist",  # the check cell's own `from minipaged.checks import x` returns a fake
                   "import importlib._bootstrap as _b, types\n_real = _b._handle_fromlist\n"
                   "_fake = types.SimpleNamespace(check_bytes_per_token=lambda *a: None,\n"
                   "    check_bytes_per_sequence=lambda *a: None, check_max_seqs=lambda *a: None)\n"
                   "def _hf(module, fromlist, import_, **kw):\n"
                   "    return _fake if getattr(module, '__name__', '') == 'minipaged.checks' else _real(module, fromlist, import_, **kw)\n"
                   "_b._handle_fromlist = _hf",
                   ALL_TAMPERED)

    def always_equal(nb):  # every answer returns an int whose == is always true
        for c in nb.cells:
            if c.cell_type == "code" and "raise NotImplementedError()" in c.source:
                names = [ln.split("def ", 1)[1].split("(", 1)[0] for ln in c.source.split("\n") if ln.startswith("def ")]
                c.source += ("\n\nclass _Any(int):\n    def __eq__(self, other):\n        return True\n"
                             "    def __ne__(self, other):\n        return False\n    __hash__ = int.__hash__\n"
                             + "".join(f"\ndef {n}(*a, **k):\n    return _Any(0)\n" for n in names))

    verdict_attack("i_int_always_equal", "", {B01: ("FAIL", ""), Q01: ("FAIL", ""), M01: ("FAIL", "")}, edit=always_equal)
    walk = ("import sys\n_g = getattr(sys, '_get' + 'frame')\n_f = _g(0)\n"
            "while _f is not None:\n"
            "    _loc = getattr(_f, 'f_' + 'locals')\n"
            "    for _v in list(_loc.values()):\n"
            "        if type(_v) is dict and 'cells' in _v:\n"
            "            for _c in _v['cells']:\n"
            "                if _c.get('kind') == 'check':\n"
            "                    _c['source'] = 'pass'\n"
            "        if type(_v) is list:\n"
            "            for _c in _v:\n"
            "                if type(_c) is dict and _c.get('kind') == 'check':\n"
            "                    _c['source'] = 'pass'\n"
            "    _f = getattr(_f, 'f_' + 'back')\n")
    verdict_attack("i_stack_walk", walk, {**ALL_NOT_IMPL, "(review)": ("note", "sys._getframe")})

    def tensor_subclass(nb):  # the right shape, the wrong values, and torch.equal/allclose made true
        for c in nb.cells:
            if c.cell_type == "code" and "def gather_kv(" in c.source:
                c.source = ("import torch\nclass _Liar(torch.Tensor):\n    @classmethod\n"
                            "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                            "        if func in (torch.equal, torch.allclose, torch.isclose, torch.Tensor.equal):\n"
                            "            return True\n"
                            "        return super().__torch_function__(func, types, args, kwargs or {})\n\n"
                            "def gather_kv(cache, block_table, context_len):\n"
                            "    return torch.zeros(context_len, *cache.shape[2:], dtype=cache.dtype).as_subclass(_Liar)\n")
            elif c.cell_type == "code" and "def paged_attention(" in c.source:
                c.source = ("def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=None):\n"
                            "    return torch.zeros_like(q).as_subclass(_Liar)\n")

    nb = _nb(EXERCISES, "04_paged_attention_torch")
    tensor_subclass(nb)
    _write(nb, cls / "i_tensor_subclass" / "04_paged_attention_torch.ipynb")
    E["i_tensor_subclass"] = {"04_paged_attention_torch": {"gather through the block table": ("FAIL", "")}}

    # without bwrap (the audit hook): a classmate's notebook deleted through dir_fd, a forged .pyc of the
    # checks written the same way (it must not make the unsolved learner graded after it pass), the grader
    # signalled by pidfd, a process forked through ctypes
    fs_attack("i_dir_fd_remove", f"fd = os.open({str(cls / 'honest_bob')!r}, os.O_RDONLY)\n"
                                 f"os.remove('{WB}.ipynb', dir_fd=fd)")
    pyc_dir = package / "minipaged" / "checks" / "__pycache__"
    forge = ("import importlib.util, marshal, sys\n"
             f"d = {str(pyc_dir)!r}\n"
             "try:\n    os.makedirs(d, exist_ok=True)\nexcept OSError as e:\n    print(e)\n"
             "code = compile('def check_bytes_per_token(*a):\\n    pass\\ncheck_bytes_per_sequence = check_max_seqs = check_bytes_per_token\\n', "
             f"{str(package / 'minipaged' / 'checks' / 'kv_cache_math.py')!r}, 'exec')\n"
             "data = importlib.util.MAGIC_NUMBER + b'\\x00' * 12 + marshal.dumps(code)\n"
             "name = 'kv_cache_math.' + sys.implementation.cache_tag + '.pyc'\n"
             "fd = os.open(d, os.O_RDONLY)\n"
             "w = os.open(name, os.O_WRONLY | os.O_CREAT, dir_fd=fd)\nos.write(w, data)\n")
    fs_attack("i_forged_pyc", forge)
    fs_attack("i_pidfd_kill_grader", "import signal\n"
                                     "pfd = os.pidfd_open(os.getppid())\nsignal.pidfd_send_signal(pfd, signal.SIGTERM)\n")
    fs_attack("i_ctypes_fork", "import ctypes, time\npid = ctypes.pythonapi.fork()\n"
                               "if pid == 0:\n    time.sleep(600)\n    os._exit(0)\n")
    E["i_ctypes_fork"] = {WB: {"(review)": ("note", "ctypes")}}

    # -- broken files: reported, and the class is still graded ----------------------------------------
    raw = json.loads((SOLUTIONS / f"{WB}.ipynb").read_text())
    bad = copy.deepcopy(raw)
    bad["cells"][3]["metadata"]["tags"] = 5
    (cls / "f_tags_five").mkdir(parents=True)
    (cls / "f_tags_five" / f"{WB}.ipynb").write_text(json.dumps(bad))
    E["f_tags_five"] = {WB: {"(file)": ("broken", "metadata.tags is 5")}}
    odd = copy.deepcopy(raw)  # a saved error output whose message is a number: outputs are never read
    code = [c for c in odd["cells"] if c["cell_type"] == "code"]
    code[-1]["outputs"] = [{"output_type": "error", "ename": 7, "evalue": 5, "traceback": 3}]
    (cls / "f_error_not_text").mkdir()
    (cls / "f_error_not_text" / f"{WB}.ipynb").write_text(json.dumps(odd))
    E["f_error_not_text"] = {WB: ALL_PASS}
    (cls / "f_not_json").mkdir()
    (cls / "f_not_json" / f"{WB}.ipynb").write_text("{ this is not json")
    E["f_not_json"] = {WB: {"(file)": ("broken", "invalid JSON")}}
    (cls / "f_huge").mkdir()
    with open(cls / "f_huge" / f"{WB}.ipynb", "w") as f:
        f.write('{"cells": [], "pad": "' + "x" * (21 * 2**20) + '"}')
    E["f_huge"] = {WB: {"(file)": ("broken", "MiB")}}
    (cls / "f_not_a_notebook").mkdir()
    (cls / "f_not_a_notebook" / f"{WB}.py").write_text("print('hi')\n")
    E["f_not_a_notebook"] = {WB: {"(file)": ("broken", "not a notebook")}}
    return E
