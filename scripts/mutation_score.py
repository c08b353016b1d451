#!/usr/bin/env python
"""Mutation score of the workbook checks: how many small bugs in the solved workbooks the checks catch.

For each workbook, every solution block (between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in
solutions/NN_*.ipynb) is mutated one change at a time by a small AST mutator:

    binop       an arithmetic operator replaced (+ -, * //, // /, % //, ...)
    swap-operands   a - b -> b - a (and /, //, %)
    augassign   += <-> -=
    compare     < <=, > >=, == !=, is / is not, in / not in
    boolop      and <-> or
    not         `not x` -> x, `-x` -> x
    const       an int constant n -> n+1 and n-1, True <-> False, 0.0 <-> 1.0
    name        min <-> max
    attr        popleft <-> pop, append <-> appendleft
    drop        a statement replaced by `pass`
    return      `return` inserted before a statement of a function's body
    swap-args   two neighbouring positional arguments of a call swapped
    drop-kwarg  a keyword argument of a call dropped

and, for the inputs a learner's code meets in serving (issue 40), one mutant of each shortcut that
passes small cases only:

    narrowed    token ids narrowed to 16 bits on the way in (a uint16 array, `& 0xFFFF`): id 70,000
                becomes 4,464, which another token already is
    window      a bounded window: only the last 1,024 token ids looked at, or a length capped at 1,024
                (SmolLM2-135M's max_model_len is 8,192)
    memo        a memo keyed by id(): the answer for an object handed in before is returned again, even
                when that object changed in place, or a new object took a freed one's id

and, for the delegation watch (issue 40), one mutant of each way around it:

    unlisted    a function of the block first calls package code no workbook hands over (a check's helper)
    thread      the cell starts a thread of the learner's that is still running when the checks call the answer
    recompiled  the answer is minipaged's own reference, its module's source compiled again under another file name

Each mutant is graded as the grader grades a submission (minipaged.checks.canonical.build_plan: the
mutated workbook's answer cells, then the exercise's own check cells, in order), without bubblewrap:
a forked child of a process that imported torch and the checks once, in its own temporary folder,
with a time limit. A mutant is killed when a check cell fails or errors, an answer cell raises, or
the run crashes or times out. Surviving mutants that cannot be told apart from the solution by any
input are listed in tests/mutation_equivalent.txt, one per line with why; the score is

    killed / (mutants - listed equivalent)

and must be at least 95% for every workbook (the exit status is 1 otherwise, or when a survivor
is not listed, or a listed one is killed or gone: the list stays exact).

    python scripts/mutation_score.py                    every workbook
    python scripts/mutation_score.py 02 06 -j 2         some, two mutants at a time
    python scripts/mutation_score.py 06 --list          the mutants, without running them
    python scripts/mutation_score.py 06 --only 06:3:42:7:compare:Lt>LtE   one mutant, its check output shown
    python scripts/mutation_score.py --family narrowed,window,memo      one family or more, every workbook
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import json
import linecache
import os
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.txt"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
GOAL = 0.95

sys.path.insert(0, str(ROOT))

BINOP = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.FloorDiv, ast.Add], ast.Div: [ast.Mult, ast.FloorDiv],
         ast.FloorDiv: [ast.Div, ast.Mult], ast.Mod: [ast.FloorDiv]}
CMP = {ast.Lt: [ast.LtE], ast.LtE: [ast.Lt], ast.Gt: [ast.GtE], ast.GtE: [ast.Gt], ast.Eq: [ast.NotEq],
       ast.NotEq: [ast.Eq], ast.Is: [ast.IsNot], ast.IsNot: [ast.Is], ast.In: [ast.NotIn], ast.NotIn: [ast.In]}
NAMES = {"min": "max", "max": "min"}
ATTRS = {"popleft": "pop", "append": "appendleft", "appendleft": "append"}


@dataclass(frozen=True)
class Mutant:
    id: str  # "06:3:42:7:compare:Lt>LtE": workbook, cell, line in the cell, column, operator
    cell: int
    line: int
    before: str  # the original source line
    after: str  # the mutated statement, as ast.unparse writes it
    source: str  # the whole mutated cell


def solution_lines(source: str) -> set[int]:
    """The 1-based line numbers of a cell that lie inside its solution blocks."""
    inside, lines = False, set()
    for n, line in enumerate(source.split("\n"), 1):
        s = line.strip()
        if s == BEGIN:
            inside = True
        elif s == END:
            inside = False
        elif inside:
            lines.add(n)
    return lines


def _inside(node: ast.AST, lines: set[int]) -> bool:
    return hasattr(node, "lineno") and node.lineno in lines and getattr(node, "end_lineno", node.lineno) in lines


def _name(op) -> str:
    return op.__name__ if isinstance(op, type) else type(op).__name__


def _swap_operands(n: ast.BinOp) -> None:
    n.left, n.right = n.right, n.left


def _sites(tree: ast.Module, lines: set[int]):
    """(node index in ast.walk order, operator, detail, apply) for every mutation of a solution block."""
    nodes = list(ast.walk(tree))
    out = []
    for i, node in enumerate(nodes):
        if isinstance(node, ast.BinOp) and _inside(node, lines):
            for new in BINOP.get(type(node.op), []):
                out.append((i, node, "binop", f"{_name(node.op)}>{_name(new)}", lambda n, new=new: setattr(n, "op", new())))
            if isinstance(node.op, (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)):
                out.append((i, node, "swap-operands", _name(node.op),
                            _swap_operands))
        elif isinstance(node, ast.AugAssign) and _inside(node, lines) and type(node.op) in (ast.Add, ast.Sub):
            new = ast.Sub if isinstance(node.op, ast.Add) else ast.Add
            out.append((i, node, "augassign", f"{_name(node.op)}>{_name(new)}", lambda n, new=new: setattr(n, "op", new())))
        elif isinstance(node, ast.Compare) and _inside(node, lines):
            for k, op in enumerate(node.ops):
                for new in CMP.get(type(op), []):
                    out.append((i, node, "compare", f"{k}:{_name(op)}>{_name(new)}",
                                lambda n, k=k, new=new: n.ops.__setitem__(k, new())))
        elif isinstance(node, ast.BoolOp) and _inside(node, lines):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            out.append((i, node, "boolop", f"{_name(node.op)}>{_name(new)}", lambda n, new=new: setattr(n, "op", new())))
        elif isinstance(node, ast.Constant) and _inside(node, lines):
            v = node.value
            if type(v) is bool:
                out.append((i, node, "const", f"{v}>{not v}", lambda n: setattr(n, "value", not n.value)))
            elif type(v) is int:
                for d in (1, -1):
                    out.append((i, node, "const", f"{v}>{v + d}", lambda n, d=d: setattr(n, "value", n.value + d)))
            elif type(v) is float and v in (0.0, 1.0):
                out.append((i, node, "const", f"{v}>{1.0 - v}", lambda n: setattr(n, "value", 1.0 - n.value)))
        elif isinstance(node, ast.Name) and _inside(node, lines) and node.id in NAMES and isinstance(node.ctx, ast.Load):
            out.append((i, node, "name", f"{node.id}>{NAMES[node.id]}", lambda n: setattr(n, "id", NAMES[n.id])))
        elif isinstance(node, ast.Attribute) and _inside(node, lines) and node.attr in ATTRS:
            out.append((i, node, "attr", f"{node.attr}>{ATTRS[node.attr]}", lambda n: setattr(n, "attr", ATTRS[n.attr])))
        elif isinstance(node, ast.Call) and _inside(node, lines):
            args = node.args
            for k in range(len(args) - 1):
                if not isinstance(args[k], ast.Starred) and not isinstance(args[k + 1], ast.Starred):
                    out.append((i, node, "swap-args", f"{k}<>{k + 1}",
                                lambda n, k=k: n.args.__setitem__(slice(k, k + 2), [n.args[k + 1], n.args[k]])))
            for k, kw in enumerate(node.keywords):
                if kw.arg is not None:
                    out.append((i, node, "drop-kwarg", kw.arg, lambda n, k=k: n.keywords.pop(k) and None))
        if isinstance(node, ast.UnaryOp) and _inside(node, lines) and isinstance(node.op, (ast.Not, ast.USub)):
            out.append((i, node, "not", _name(node.op), "unwrap"))
        # statements: drop one, or return before it (in a function's own body)
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for k, st in enumerate(stmts):
                if not isinstance(st, ast.stmt) or not _inside(st, lines):
                    continue
                if k == 0 and isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                    continue  # a docstring
                if not isinstance(st, ast.Pass):
                    out.append((i, st, "drop", f"{field}[{k}]", ("drop", field, k)))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and field == "body" \
                        and not isinstance(st, ast.Return):
                    out.append((i, st, "return", f"{field}[{k}]", ("return", field, k)))
    return out


def solution_cells(nb: dict):
    """(index, source, solution line numbers) of every code cell of ``nb`` that holds a solution block."""
    for c, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and BEGIN in src:
            yield c, src, solution_lines(src)


def mutants(stem: str) -> list[Mutant]:
    nb = json.loads((SOLUTIONS / f"{stem}.ipynb").read_text(encoding="utf-8"))
    found: list[Mutant] = []
    for c, src, lines in solution_cells(nb):
        src_lines = src.split("\n")
        tree = ast.parse(src)
        for idx, node, op, detail, how in _sites(tree, lines):
            t2 = copy.deepcopy(tree)
            target = list(ast.walk(t2))[idx]
            if how == "unwrap":
                # replace the UnaryOp by its operand, wherever it is held
                for parent in ast.walk(t2):
                    for f, v in ast.iter_fields(parent):
                        if v is target:
                            setattr(parent, f, target.operand)
                        elif isinstance(v, list) and any(x is target for x in v):
                            v[[x is target for x in v].index(True)] = target.operand
                changed = target.operand
            elif isinstance(how, tuple):
                kind, field, k = how
                stmts = getattr(target, field)
                st = stmts[k]
                if kind == "drop":
                    stmts[k] = ast.copy_location(ast.Pass(), st)
                    changed = stmts[k]
                else:
                    stmts.insert(k, ast.copy_location(ast.Return(value=None), st))
                    changed = stmts[k]
            else:
                how(target)
                changed = target
            ast.fix_missing_locations(t2)
            try:
                new_src = ast.unparse(t2)
                compile(new_src, "<mutant>", "exec")
            except (SyntaxError, ValueError):
                continue
            after = ast.unparse(changed).split("\n", 1)[0]
            line = node.lineno
            found.append(Mutant(f"{stem[:2]}:{c}:{line}:{node.col_offset}:{op}:{detail}", c, line,
                                src_lines[line - 1].strip(), after, new_src))
    found += input_mutants(stem, nb)
    found += watch_mutants(stem, nb)
    seen, unique = set(), []
    for m in found:  # two operators can give the same program (drop of `return x` and `return` before it)
        if (m.cell, m.source) not in seen:
            seen.add((m.cell, m.source))
            unique.append(m)
    return unique


# -- the watch's families: ways around the delegation watch -------------------------------------------
# The answer to replace by minipaged's own reference, compiled again: workbook -> (answer's name, module, attribute).
# 01's reference is one-line formulas (shorter than what the watch matches); 07 runs 02-06's parts.
RECOMPILE = {"02": ("MyBlockAllocator", "minipaged.block_allocator", "BlockAllocator"),
             "03": ("MyBlockTable", "minipaged.block_table", "BlockTable"),
             "04": ("gather_kv", "minipaged.attention.reference", "gather_kv"),
             "05": ("paged_decode", "minipaged.attention.triton_paged", "paged_decode"),
             "06": ("MyScheduler", "minipaged.scheduler", "Scheduler"),
             "08": ("copy_on_write", "minipaged.prefix_cache", "copy_on_write"),
             "09": ("propose_ngram", "minipaged.spec_decode", "propose_ngram"),
             "11": ("choice_mask", "minipaged.structured_output", "choice_mask"),
             "12": ("MyHostConnector", "minipaged.kv_connector", "HostOffloadConnector")}
UNLISTED_CALL = "__import__('minipaged.checks._core', fromlist=['plain']).plain(0)"
THREAD_START = ("__import__('threading').Thread(target=lambda: __import__('time').sleep(3600), daemon=True, "
                "name='my-worker').start()")
RECOMPILE_SRC = ("import importlib as _il, inspect as _ins, sys as _sys, tempfile as _tf, types as _ty\n"
                 "_m = _il.import_module({module!r})\n"
                 "_p = _tf.mkdtemp() + '/my_copy.py'\n"
                 "open(_p, 'w').write(_ins.getsource(_m))\n"
                 "_c = _ty.ModuleType('my_copy')\n"
                 "_c.__package__, _c.__file__ = _m.__package__, _p\n"
                 "_sys.modules['my_copy'] = _c\n"
                 "exec(compile(open(_p).read(), _p, 'exec'), _c.__dict__)\n"
                 "{name} = _c.{attr}\n")


# -- the input families: shortcuts that pass small cases (ids, lengths, identity) ------------------------
TOKEN_PARAMS = ("token_ids", "stop_token_ids")  # lists of token ids (up to 151,000 in the course's models)
LENGTH_PARAMS = ("num_tokens", "num_new_tokens", "end", "context_len")  # a number of tokens or a position
MEMO_PARAMS = ("token_ids", "seq", "prefix", "choices", "vocab", "parent")  # objects a learner might memoize on
WINDOW = 1024
MEMO_SRC = ("def _memo_by_id(fn):\n"
            "    memo = {}\n"
            "    def wrapper(*a, **k):\n"
            "        key = tuple(x if isinstance(x, (int, float, str, bool, type(None))) else id(x)\n"
            "                    for x in list(a) + sorted(k.items()))\n"
            "        if key not in memo:\n"
            "            memo[key] = fn(*a, **k)\n"
            "        return memo[key]\n"
            "    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__\n"
            "    return wrapper\n")


def _first_body_index(fn: ast.FunctionDef) -> int:
    return 1 if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else 0


def input_mutants(stem: str, nb: dict) -> list[Mutant]:
    """The input families: for every function of a solution block that takes token ids, `narrowed` and
    `window`; that takes a length, `window`; that takes an object a memo could key on, `memo` (the function,
    or the method of its class, wrapped by a memo keyed by the arguments' id())."""
    out: list[Mutant] = []
    for c, src, lines in solution_cells(nb):
        tree = ast.parse(src)
        owners = {id(f): cls for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                  for f in cls.body if isinstance(f, ast.FunctionDef)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef) and any(_inside(st, lines) for st in node.body)):
                continue
            params = [a.arg for a in node.args.args]
            inserts = []
            for p in params:
                if p in TOKEN_PARAMS:
                    inserts.append(("narrowed", p, f"{p} = type({p})(int(t) & 0xFFFF for t in {p}) "
                                                   f"if isinstance({p}, (list, tuple)) else {p}"))
                    if p == "token_ids":  # a sequence's ids (a stop list is short)
                        inserts.append(("window", p, f"{p} = {p}[-{WINDOW}:] if isinstance({p}, (list, tuple)) else {p}"))
                elif p in LENGTH_PARAMS:
                    inserts.append(("window", p, f"{p} = min({p}, {WINDOW}) if isinstance({p}, int) else {p}"))
            for family, p, stmt in inserts:
                t2 = copy.deepcopy(tree)
                target = next(n for n in ast.walk(t2) if isinstance(n, ast.FunctionDef) and n.lineno == node.lineno)
                target.body.insert(_first_body_index(target), ast.parse(stmt).body[0])
                ast.fix_missing_locations(t2)
                out.append(Mutant(f"{stem[:2]}:{c}:{node.lineno}:{node.col_offset}:{family}:{node.name}.{p}", c,
                                  node.lineno, src.split("\n")[node.lineno - 1].strip(), stmt, ast.unparse(t2)))
            answers = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))
            changes_self = any(  # a method that changes its object (self.x = ..., self.queue.append(...)) is no memo's
                isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                and n.value.id == "self" or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Attribute) and isinstance(n.func.value.value, ast.Name)
                and n.func.value.value.id == "self" for n in ast.walk(node))
            if answers and not changes_self and any(p in MEMO_PARAMS for p in params):  # a memo of an answer
                cls = owners.get(id(node))
                name = f"{cls.name}.{node.name}" if cls is not None else node.name
                wrap = f"{name} = _memo_by_id({name})"
                out.append(Mutant(f"{stem[:2]}:{c}:{node.lineno}:{node.col_offset}:memo:{name}", c, node.lineno,
                                  src.split("\n")[node.lineno - 1].strip(), wrap, src + "\n" + MEMO_SRC + wrap + "\n"))
    return out


def watch_mutants(stem: str, nb: dict) -> list[Mutant]:
    """The watch's families: for every function of a solution block, `unlisted` (its body first calls a check's
    helper); for every solution cell, `thread` (a thread of the learner's left running); for the workbook,
    `recompiled` (the answer replaced by the reference's own code from another file)."""
    if stem.startswith("07"):  # 07 runs the parts of 02-06, whose own plants are refused in their workbooks
        return []               # (rules_table.WATCH_PLANTS_NOT_APPLICABLE); build_engine is glue it hands over
    out: list[Mutant] = []
    last_cell = None
    for c, src, lines in solution_cells(nb):
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(_inside(st, lines) for st in node.body):
                t2 = copy.deepcopy(tree)
                target = next(n for n in ast.walk(t2) if isinstance(n, type(node)) and n.lineno == node.lineno)
                k = 1 if isinstance(target.body[0], ast.Expr) and isinstance(target.body[0].value, ast.Constant) else 0
                target.body.insert(k, ast.parse(UNLISTED_CALL).body[0])
                ast.fix_missing_locations(t2)
                out.append(Mutant(f"{stem[:2]}:{c}:{node.lineno}:{node.col_offset}:unlisted:{node.name}", c, node.lineno,
                                  src.split("\n")[node.lineno - 1].strip(), UNLISTED_CALL, ast.unparse(t2)))
        out.append(Mutant(f"{stem[:2]}:{c}:0:0:thread:cell", c, 0, "", THREAD_START, src + "\n" + THREAD_START + "\n"))
        last_cell = (c, src)
    rec = RECOMPILE.get(stem[:2])
    if rec is not None and last_cell is not None:
        c, src = last_cell
        name, module, attr = rec
        add = RECOMPILE_SRC.format(module=module, name=name, attr=attr)
        out.append(Mutant(f"{stem[:2]}:{c}:0:0:recompiled:{module}.{attr}", c, 0, "", f"{name} = <{module}.{attr} compiled again>",
                          src + "\n" + add))
    return out


# -- running one workbook's checks ----------------------------------------------------------------
def _notebook_with(stem: str, cell: int | None, source: str | None, folder: Path) -> Path:
    nb = json.loads((SOLUTIONS / f"{stem}.ipynb").read_text(encoding="utf-8"))
    if cell is not None:
        nb["cells"][cell]["source"] = source
    path = folder / f"{stem}.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


def run_checks(stem: str, notebook: Path) -> tuple[bool, str]:
    """(all checks passed, what failed first): the grader's plan for ``notebook``, run in this process."""
    from minipaged.checks import canonical

    plan = canonical.build_plan(EXERCISES / f"{stem}.ipynb", notebook, stem)
    ns: dict = {"__name__": "__main__"}
    first = ""
    for cell in plan.cells:
        src = "\n".join("pass  # " + ln if ln.lstrip().startswith(("%", "!")) else ln for ln in cell.source.split("\n"))
        filename = f"<{cell.label}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        try:
            exec(compile(src, filename, "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - every way a cell can end
            what = f"{cell.label}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            first = first or what
    return not first, first


def _prepare(stem: str) -> None:
    """Import what every mutant needs once, then run the solution here (it must pass; it fills caches)."""
    import torch

    torch.set_num_threads(1)  # no OpenMP pool in a process that forks
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import minipaged.checks  # noqa: F401
    import pkgutil
    import importlib

    for m in pkgutil.iter_modules(minipaged.checks.__path__):
        importlib.import_module(f"minipaged.checks.{m.name}")
    from minipaged.checks._workbooks import MODEL_WORKBOOKS

    if stem in MODEL_WORKBOOKS:  # the model loads once, here (the solution's run below); the children share it
        importlib.import_module("torch._dynamo")
        importlib.import_module("minipaged.engine")


def _workdir(stem: str) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f"mutant-{stem[:2]}-"))
    if stem == "07_assemble":
        for s in ("02_block_allocator", "03_block_table", "04_paged_attention_torch", "06_scheduler"):
            shutil.copyfile(SOLUTIONS / f"{s}.ipynb", work / f"{s}.ipynb")
    return work


def _child(stem: str, m: Mutant, fd: int, verbose: bool) -> None:
    work = _workdir(stem)
    os.chdir(work)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ok, why = False, "the child did not finish"
    try:
        path = _notebook_with(stem, m.cell, m.source, work)
        sink = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with sink, (contextlib.nullcontext() if verbose else contextlib.redirect_stderr(io.StringIO())):
            ok, why = run_checks(stem, path)
    except BaseException as e:  # noqa: BLE001
        why = f"runner: {type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(BaseException):
            os.write(fd, json.dumps({"ok": ok, "why": why[:300]}).encode())
        shutil.rmtree(work, ignore_errors=True)
        os._exit(0)


def run_mutants(stem: str, todo: list[Mutant], jobs: int, timeout: float, verbose: bool = False):
    """{mutant id: (killed, why)}, running up to ``jobs`` forked children at once."""
    results: dict[str, tuple[bool, str]] = {}
    queue = list(todo)
    running: dict[int, tuple[Mutant, int, float, list[bytes]]] = {}  # pid -> (mutant, read fd, start, chunks)
    while queue or running:
        while queue and len(running) < jobs:
            m = queue.pop(0)
            r, w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                os.setpgid(0, 0)
                _child(stem, m, w, verbose)
            os.close(w)
            running[pid] = (m, r, time.monotonic(), [])
        fds = {v[1]: pid for pid, v in running.items()}
        ready, _, _ = select.select(list(fds), [], [], 0.5)
        for fd in ready:
            chunk = os.read(fd, 65536)
            running[fds[fd]][3].append(chunk)
        now = time.monotonic()
        for pid in list(running):
            m, fd, start, chunks = running[pid]
            done_pid, status = os.waitpid(pid, os.WNOHANG)
            late = now - start > timeout
            if done_pid == 0 and not late:
                continue
            if done_pid == 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                while True:
                    r, _, _ = select.select([fd], [], [], 0)
                    if not r:
                        break
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
            os.close(fd)
            del running[pid]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # anything the mutant left behind
            if done_pid == 0:
                results[m.id] = (True, f"timed out after {timeout:.0f} s")
                continue
            try:
                res = json.loads(b"".join(chunks).decode())
                results[m.id] = (not res["ok"], res["why"])
            except (ValueError, KeyError):
                results[m.id] = (True, f"crashed (status {status})")
    return results


def read_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """Listed equivalent mutants: {id: why}. Lines are `ID  why`; `#` starts a comment line."""
    out = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            mid, _, why = line.partition(" ")
            out[mid] = why.strip()
    return out


def family(m: Mutant) -> str:
    """The operator or family of a mutant: the fifth field of its id ("06:3:42:7:compare:Lt>LtE" -> compare)."""
    return m.id.split(":")[4]


def score(stem: str, jobs: int, timeout: float, equivalent: dict[str, str], out=sys.stdout,
          families: set[str] | None = None) -> tuple[float, list[str]]:
    """Run one workbook's mutants (of ``families`` only, when given); print its lines; return (kill rate, problems)."""
    all_m = [m for m in mutants(stem) if families is None or family(m) in families]
    if not all_m:
        print(f"{stem}: no mutant of {', '.join(sorted(families or []))}", file=out)
        return 1.0, []
    t0 = time.monotonic()
    _prepare(stem)
    work = _workdir(stem)
    cwd = os.getcwd()
    try:
        os.chdir(work)
        with contextlib.redirect_stdout(io.StringIO()):
            ok, why = run_checks(stem, _notebook_with(stem, None, None, work))
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    if not ok:
        print(f"{stem}: the solution itself fails its checks: {why}", file=out)
        return 0.0, [f"{stem}: solution fails"]
    base = time.monotonic() - t0
    results = run_mutants(stem, all_m, jobs, max(timeout, 0.0))
    problems = []
    killed = sum(1 for m in all_m if results[m.id][0])
    listed = [m for m in all_m if m.id in equivalent]
    survivors = [m for m in all_m if not results[m.id][0] and m.id not in equivalent]
    for m in listed:
        if results[m.id][0]:
            problems.append(f"{m.id} is listed as equivalent but was killed ({results[m.id][1]}): take it off the list")
    ids = {m.id for m in all_m}
    for mid in equivalent:
        if families is not None and mid.split(":")[4] not in families:
            continue
        if mid.startswith(stem[:2] + ":") and mid not in ids:
            problems.append(f"{mid} is listed as equivalent but is no mutant of {stem} any more: take it off the list")
    denominator = len(all_m) - len([m for m in listed if not results[m.id][0]])
    rate = killed / denominator if denominator else 1.0
    for m in survivors:
        print(f"  SURVIVED {m.id}\n      {m.before}\n   -> {m.after}", file=out)
    print(f"{stem}: {len(all_m)} mutants, {killed} killed, {len(listed)} listed equivalent, "
          f"{len(survivors)} survived unlisted: kill rate {100 * rate:.1f}% of non-equivalent "
          f"(solution ran in {base:.1f} s)", file=out)
    if survivors:
        problems.append(f"{stem}: {len(survivors)} survivors are not listed in {EQUIVALENT.relative_to(ROOT)}")
    if rate < GOAL:
        problems.append(f"{stem}: kill rate {100 * rate:.1f}% is under {100 * GOAL:.0f}%")
    out.flush()
    return rate, problems


def _stems(args: list[str]) -> list[str]:
    from minipaged.checks._workbooks import WORKBOOKS

    if not args:
        return list(WORKBOOKS)
    return [s for s in WORKBOOKS if any(s.startswith(a) or s == a for a in args)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workbooks", nargs="*", help="workbook numbers or names (default: all)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one mutant may take (default 120)")
    p.add_argument("--list", action="store_true", help="print the mutants and stop")
    p.add_argument("--only", help="run one mutant (its id) with the checks' output shown")
    p.add_argument("--family", help="run only these operators or families, comma-separated (e.g. narrowed,window,memo)")
    args = p.parse_args(argv)
    stems = _stems(args.workbooks)
    if args.list:
        for stem in stems:
            for m in mutants(stem):
                print(f"{m.id}\n    {m.before}\n -> {m.after}")
        return 0
    if args.only:
        stem = _stems([args.only.split(":")[0]])[0]
        m = next((m for m in mutants(stem) if m.id == args.only), None)
        if m is None:
            print(f"no mutant {args.only}")
            return 2
        _prepare(stem)
        print(f"{m.id}\n    {m.before}\n -> {m.after}")
        res = run_mutants(stem, [m], 1, args.timeout, verbose=True)[m.id]
        print("KILLED" if res[0] else "SURVIVED", res[1])
        return 0
    equivalent = read_equivalent()
    problems = []
    for stem in stems:
        try:
            fams = set(args.family.split(",")) if args.family else None
            _, probs = score(stem, args.jobs, args.timeout, equivalent, families=fams)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            probs = [f"{stem}: the run failed"]
        problems += probs
    for line in problems:
        print("PROBLEM:", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
