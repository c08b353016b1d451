"""Grade a class: every submitted workbook in its own sandbox, scored by the exercise's own checks.

    minipaged grade PATH... [--csv FILE] [--jsonl FILE] [--resume | --overwrite] [--jobs N]
                            [--timeout S] [--memory GIB] [--exercises DIR] [--no-sandbox]

A PATH is a workbook (``02_block_allocator.ipynb``), or a folder of a class's submissions:
either one sub-folder per learner (``class/alice/02_block_allocator.ipynb``) or files named
by learner (``class/alice_02_block_allocator.ipynb``, ``02_block_allocator (bob).ipynb``).

For each submission the grader builds a plan (minipaged.checks.canonical): the learner's code
cells, placed by the pristine exercise's cell ids, and the **check cells of the pristine
exercise**, never the notebook's own; saved outputs are never read. The plan runs in a fresh
interpreter (minipaged.checks.harness) on a private copy of the learner's workbooks, under
bubblewrap when the machine has it and under resource limits always (minipaged.checks.sandbox).
Each check's verdict comes back on a pipe, signed with a key made for that run; a check without
a genuine verdict has not passed. One scoreboard line per learner, workbook and check:

    pass    the check returned, with the checks and builtins as installed
    FAIL    the check raised CheckFailed / NotImplementedYet / CheckTimeout, your code changed what
            the checks rely on, the check cells were changed, or the run hit its time limit
    skip    the check said it cannot run here (Triton missing on macOS)
    ERROR   the check crashed otherwise, or the run ended before it (os._exit, a crash, memory)
    broken  a file that is not a readable workbook (the others are still graded)
    missing a workbook a classmate handed in and this learner did not
    note    something worth a look that does not change the grade

After each submission the rows are appended to the CSV and JSON-lines files (default
``grades.csv`` and ``grades.jsonl``), each rewritten atomically; ``--resume`` continues a run
from the JSON-lines file; Ctrl-C (SIGINT) or SIGTERM stops at once: every run in progress is killed
with its whole process tree, what is done is kept, and the last line says how to continue. Exit
status: 0 when every check passed (or skipped), 1 otherwise, 2 when nothing could be graded, 3 when
the grader stopped because the installed checks changed, 130 after SIGINT, 143 after SIGTERM.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import hashlib
import hmac
import io
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import canonical, sandbox
from ._workbooks import MODEL_WORKBOOKS, WORKBOOKS, identify, learner_from_name

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# escape sequences (CSI, OSC such as OSC 52, which writes the clipboard), then every control character
# left, C0, C1 and the bidirectional overrides: learner text never drives the instructor's terminal
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[PX^_][^\x1b]*(\x1b\\)?|.)?|\x9b[0-?]*[ -/]*[@-~]")
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def clean(text: str) -> str:
    """``text`` safe to print on a terminal: escape sequences removed, other control characters as '?'."""
    return _CONTROLS.sub("?", _ESCAPES.sub("", str(text)))
_PACKAGE = Path(__file__).resolve().parent.parent
FIELDS = ["learner", "workbook", "check", "result", "message", "file", "sha256"]
# What a learner's cells rarely hold unless they aim at the grader: worth the instructor's eyes.
SUSPICIOUS = ("_getframe", "f_back", "f_locals", "gc.get_objects", "gc.get_referrers", "ctypes", "/proc/",
              "os._exit", "os.write(", "os.dup2", "__code__", "sys.modules", "addaudithook", "harness",
              "settrace", "setprofile", "builtins.", "__builtins__")


@dataclass
class Submission:
    learner: str
    workbook: str  # a known workbook name, or the file's stem
    path: Path


@dataclass
class Row:
    learner: str
    workbook: str
    check: str
    result: str  # pass, FAIL, skip, ERROR, broken, missing, note
    message: str
    file: str
    sha256: str = ""

    @property
    def ok(self) -> bool:
        return self.result in ("pass", "skip", "note")


# docs/instructor.md, "Without bubblewrap", says the same: keep the two alike.
NO_SANDBOX_PROTECTS = (
    "resource limits, and a Python audit hook in each run that refuses writes and deletions outside the "
    "learner's copy (dir_fd included), folders opened outside it, new processes, signals and ctypes from "
    "learners' code; the installed package is verified before and after each learner and never loaded "
    "from bytecode; the grader ignores signals sent from a learner's run, and kills each run's process group "
    "when it ends, and, as the runs' subreaper, every process a run started whatever its parent or session; "
    "grades.csv and grades.jsonl stay mode 0000 while runs go on, and a seccomp filter refuses the runs chmod, "
    "ACLs, user namespaces and tracing (a root grader's runs keep no capability), so they cannot read them. "
    "NOT protected: a learner's code can READ every other file you can (classmates' notebooks "
    "included), use the network, and native code (a compiled extension) gets past the audit hook. "
    "Install bubblewrap for a class you do not trust.")


class GradingError(Exception):
    """The grader cannot go on (an output path that is a symlink, the checks changed); the message says what to do."""


# -- finding the submissions ------------------------------------------------------------------
def _learner(path: Path, root: Path | None, stem: str | None) -> str:
    from_name = learner_from_name(path.name, stem)
    if root is not None:
        rel = path.relative_to(root)
        if len(rel.parts) > 1:
            return rel.parts[0] if not from_name else f"{rel.parts[0]}/{from_name}"
        if from_name:
            return from_name
        return root.name
    return from_name or path.parent.resolve().name


def discover(paths: list[str]) -> tuple[list[Submission], list[Row]]:
    subs: list[Submission] = []
    rows: list[Row] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            rows.append(Row("?", path.name, "(file)", "broken", f"{p} does not exist", str(path)))
            continue
        if path.is_file():
            stem = identify(path.name)
            learner = _learner(path, None, stem)
            if path.suffix != ".ipynb":
                rows.append(Row(learner, stem or path.stem, "(file)", "broken",
                                f"not a notebook ({path.suffix or 'no extension'}): submit the .ipynb file "
                                "(File > Download > .ipynb)", str(path)))
                continue
            subs.append(Submission(learner, stem or path.stem, path))
            continue
        for f in sorted(path.rglob("*")):
            rel = f.relative_to(path)
            if any(part.startswith(".") for part in rel.parts):
                continue
            stem = identify(f.name)
            if f.is_symlink():  # it could point anywhere, a classmate's file or the instructor's
                if f.suffix == ".ipynb" or stem is not None:
                    rows.append(Row(_learner(f, path, stem), stem or f.stem, "(file)", "broken",
                                    "a symbolic link, not a file: put the notebook itself in the folder", str(f)))
                continue
            if not f.is_file():
                continue
            if f.suffix == ".ipynb":
                subs.append(Submission(_learner(f, path, stem), stem or f.stem, f))
            elif stem is not None:  # named like a workbook, but not a notebook
                rows.append(Row(_learner(f, path, stem), stem or f.stem, "(file)", "broken",
                                f"not a notebook ({f.suffix or 'no extension'}): submit the .ipynb file", str(f)))
    return _unambiguous(subs, rows, paths)


def _unambiguous(subs: list[Submission], rows: list[Row], paths: list[str]) -> tuple[list[Submission], list[Row]]:
    """One learner, one source: a name given both by a folder (``alice/``) and by files named for a learner
    (``alice_02_....ipynb`` beside it) is reported, never merged; neither can then pull the other's score."""
    by_folder: dict[str, set] = {}
    for s in subs:
        root = next((Path(x) for x in paths if Path(x).is_dir() and Path(x) in s.path.parents), None)
        kind = "folder" if root is not None and len(s.path.relative_to(root).parts) > 1 else "file"
        by_folder.setdefault(s.learner, set()).add(kind)
    clash = {name for name, kinds in by_folder.items() if len(kinds) > 1}
    if not clash:
        return subs, rows
    keep = []
    for s in subs:
        root = next((Path(x) for x in paths if Path(x).is_dir() and Path(x) in s.path.parents), None)
        loose = root is None or len(s.path.relative_to(root).parts) == 1
        if s.learner in clash and loose:
            rows.append(Row(s.learner, s.workbook, "(file)", "broken",
                            f"ambiguous: this file's name makes it {s.learner}'s, and a folder {s.learner}/ holds "
                            f"{s.learner}'s workbooks too; not graded and not merged. Move it into the right folder.",
                            str(s.path)))
        else:
            keep.append(s)
    return keep, rows


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """One sha256 over every file under ``root`` (names and contents), bytecode in __pycache__ included:
    the installed package. A .pyc written there could change any later run that loads it."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            h.update(str(p.relative_to(root)).encode() + b"\0symlink")
        elif p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + _sha256(p).encode())
    return h.hexdigest()


def default_exercises() -> Path | None:
    here = _PACKAGE.parent / "exercises"
    return here if here.is_dir() else None


# -- grading one submission ---------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    exercises: Path
    limits: sandbox.Limits
    use_bwrap: bool
    hide: tuple[str, ...] = ()
    scratch: Path | None = None  # where the private copies go (a fresh temporary folder each)


def _first_line(text: str) -> str:
    text = _ESCAPES.sub("", text or "").strip()
    return text.split("\n", 1)[0].strip()[:300] if text else ""


def _verify(lines: list[bytes], key: bytes) -> tuple[list[dict], list[str]]:
    """The channel's events whose MAC and sequence number are right, and what was wrong with the others."""
    events, bad = [], []
    for raw in lines:
        if not raw.strip():
            continue
        body, sep, mac = raw.rpartition(b"\t")
        want = hmac.new(key, body, "sha256").hexdigest().encode()
        if not sep or not hmac.compare_digest(mac.strip(), want):
            bad.append(f"a line the grader did not write: {raw[:60]!r}")
            continue
        try:
            ev = json.loads(body)
        except ValueError:
            bad.append("an unreadable signed line")
            continue
        if ev.get("seq") != len(events):
            bad.append(f"a signed line out of order (#{ev.get('seq')} where #{len(events)} was due)")
            continue
        events.append(ev)
    return events, bad


# What the review reads in a learner's cells, by the parsed code (a name split in two, a getattr with a
# computed name, an import of a module under another name are all seen): frames, the object graph,
# the import system, the interpreter's memory, the grader.
_REVIEW_NAMES = frozenset({
    "_getframe", "f_back", "f_locals", "f_globals", "f_code", "f_builtins", "tb_frame", "gi_frame", "cr_frame",
    "ag_frame", "get_objects", "get_referrers", "get_referents", "_current_frames", "settrace", "setprofile",
    "addaudithook", "pythonapi", "__code__", "__globals__", "__closure__", "__builtins__", "__import__",
    "__subclasses__", "__getattribute__", "_handle_fromlist", "_bootstrap", "_bootstrap_external", "modules",
    "meta_path", "path_hooks", "_exit", "dup2", "pidfd_send_signal", "pidfd_open", "dir_fd", "eval", "exec",
    "compile", "globals", "vars", "__torch_function__", "__torch_dispatch__", "_make_subclass", "interrupt_main",
    "setrecursionlimit", "breakpoint"})
_REVIEW_MODULES = frozenset({"ctypes", "gc", "inspect", "importlib", "builtins", "marshal", "signal", "_signal",
                             "traceback", "dis", "types", "pty", "subprocess", "multiprocessing", "_thread",
                             "_frozen_importlib", "_frozen_importlib_external", "_imp", "runpy", "pickle",
                             "mmap", "resource"})
_REVIEW_TEXT = ("/proc/", "harness", "__pycache__", "_getframe", "f_back", "grades.", ".pyc")


def _review_hits(source: str) -> set:
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {s for s in SUSPICIOUS if s in source}
    hits: set = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _REVIEW_NAMES:
            hits.add(f"{node.value.id}.{node.attr}" if isinstance(node.value, ast.Name) else node.attr)
        elif isinstance(node, ast.Name) and node.id in _REVIEW_NAMES:
            hits.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                if n in _REVIEW_MODULES or n.split(".")[0] in _REVIEW_MODULES:
                    hits.add(f"import {n}")
            if isinstance(node, ast.ImportFrom):
                hits |= {a.name for a in node.names if a.name in _REVIEW_NAMES}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                hits.add(f"{node.func.id} with a computed name")
            elif name.value in _REVIEW_NAMES or name.value.startswith("__"):
                hits.add(f"{node.func.id}(..., {name.value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            hits |= {t for t in _REVIEW_TEXT if t in node.value}
    return hits


def _suspicious(plan: canonical.Plan) -> list[str]:
    found = []
    for cell in plan.cells:
        if cell.kind == "code":
            hits = sorted(_review_hits(cell.source))
            if hits:
                found.append(f"{cell.label}: {', '.join(hits)}")
    return found


def _private_copy(sub: Submission, siblings: list[Submission], scratch: Path | None) -> Path:
    """A fresh folder holding this learner's workbooks under their plain names (07 reads 02-06 there)."""
    work = Path(tempfile.mkdtemp(prefix="minipaged-grade-", dir=scratch))
    os.chmod(work, 0o700)
    newest: dict[str, Submission] = {}
    for s in siblings:
        if s.learner == sub.learner and s.workbook in WORKBOOKS and s.path != sub.path:
            old = newest.get(s.workbook)
            if old is None or s.path.stat().st_mtime > old.path.stat().st_mtime:
                newest[s.workbook] = s
    newest[sub.workbook] = sub
    for stem, s in newest.items():
        shutil.copyfile(s.path, work / f"{stem}.ipynb")
    return work


def grade_submission(sub: Submission, settings: Settings, siblings: list[Submission] = (),
                     stop: threading.Event | None = None) -> list[Row]:
    """Grade one workbook in its own sandbox; one row per check, plus rows for what went wrong."""
    digest = _sha256(sub.path)

    def row(check: str, result: str, message: str) -> Row:
        return Row(sub.learner, sub.workbook, check, result, message, str(sub.path), digest)

    if stop is not None and stop.is_set():  # picked up while the grader stops: never started
        return [row("(run)", "FAIL", "not graded: the grader was interrupted (run again with --resume)")]
    if sub.workbook not in WORKBOOKS:
        return [row("(file)", "broken", f"not one of the course's workbooks ({', '.join(WORKBOOKS)}): rename the file "
                                        "so that its name holds the workbook's, e.g. 02_block_allocator.ipynb")]
    pristine = settings.exercises / f"{sub.workbook}.ipynb"
    try:
        plan = canonical.build_plan(pristine, sub.path, sub.workbook)
    except canonical.BrokenNotebook as e:
        return [row("(file)", "broken", str(e))]
    if not plan.checks:
        return [row("(file)", "broken", f"the exercise {pristine.name} has no check cells: is --exercises the course's folder?")]
    key = secrets.token_bytes(32)
    work = _private_copy(sub, list(siblings), settings.scratch)
    inner = sandbox.SANDBOX_DIR if settings.use_bwrap else str(work)
    # torch._dynamo, imported while the model loads, rebinds torch.manual_seed: import it before the snapshot
    preload = ["torch._dynamo", "minipaged.engine"] if sub.workbook in MODEL_WORKBOOKS else []  # the model imports dynamo, which replaces torch.manual_seed
    job = json.dumps({"result_fd": -1, "key": key.hex(), "workdir": inner, "guard": not settings.use_bwrap,
                      "preload": preload, "copy_from": sandbox.SUBMITTED_DIR if settings.use_bwrap else "",
                      "cells": [asdict(c) for c in plan.cells]}).encode()
    try:
        out = sandbox.run(job, work, use_bwrap=settings.use_bwrap, limits=settings.limits,
                          hide=list(settings.hide), stop=stop)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    events, bad = _verify(out.lines, key)
    rows: list[Row] = []
    if plan.tampering:
        rows.append(row("(check cells)", "FAIL", "; ".join(plan.tampering)
                        + ". The grader ran the exercise's own check cells; restore them (copy them from the exercise) to clear this."))
    if bad:
        rows.append(row("(result channel)", "FAIL", f"{len(bad)} line(s) not from the grader ({bad[0]}): "
                                                    "every verdict of this run is void"))
    started = any(e.get("event") == "ready" for e in events)
    done = any(e.get("event") == "done" for e in events)
    last = next((plan.cells[e["cell"]].label for e in reversed(events)
                 if e.get("event") == "start" and isinstance(e.get("cell"), int) and e["cell"] < len(plan.cells)), "")
    if out.timed_out and stop is not None and stop.is_set():
        why = ("FAIL", "not graded: the grader was interrupted (run again with --resume)")
    elif out.timed_out:
        why = ("FAIL", f"stopped: the workbook ran past the grader's limit of {settings.limits.wall_s:.0f} s"
                       + (f" (in {last})" if last else ""))
    elif not started:
        tail = _first_line(out.output.strip().splitlines()[-1]) if out.output.strip() else ""
        why = ("ERROR", f"the grader could not start this run (exit status {out.returncode}): {tail or 'no output'}")
    else:
        code = out.returncode
        how = "os._exit() or a crash in your code" if code is not None and code >= 0 else f"signal {-code}"
        if out.extra.get("over_memory"):
            how = ("killed: your run's processes together held more than the grader's %.1f GiB of memory"
                   % (out.extra.get("tree_memory_bytes", settings.limits.memory_bytes) / 2**30))
        elif code is not None and code < 0 and -code == 9:
            how = "killed (out of memory, most likely: the limit is %.0f GiB)" % (settings.limits.memory_bytes / 2**30)
        why = ("ERROR", f"the run ended before this check finished (exit status {code}: {how}"
                        + (f"; last in {last})" if last else ")"))
    verdicts = {e["check"]: e for e in events if e.get("event") == "check" and isinstance(e.get("check"), str)}
    seen_review = []
    for e in events:
        if e.get("event") == "review" and isinstance(e.get("cell"), int) and 0 <= e["cell"] < len(plan.cells):
            item = f"{plan.cells[e['cell']].label}: {e.get('what', '')}"
            if item not in seen_review:
                seen_review.append(item)
    for e in events:
        if e.get("event") == "cell":
            rows.append(row(f"{e.get('label', 'a cell')} (your code, not a check)", "ERROR", str(e.get("message", ""))))
    for name in plan.checks:
        v = verdicts.get(name)
        if bad:
            rows.append(row(name, "FAIL", "void: something other than the grader wrote on its result channel"))
        elif v is None:
            rows.append(row(name, *why))
        else:
            rows.append(row(name, str(v.get("result")), _first_line(str(v.get("message", "")))))
    if started and not done and all(name in verdicts for name in plan.checks) and not out.timed_out:
        rows.append(row("(run)", "note", f"the run ended early (exit status {out.returncode}) after its last check"))
    for n in plan.notes:
        rows.append(row("(notebook)", "note", n))
    hits = _suspicious(plan)
    if hits or seen_review:  # one row: what the code says (read before the run) and what it did (seen while it ran)
        parts = []
        if seen_review:
            parts.append("while it ran, code of yours looked at the interpreter's frames, objects or memory "
                         "(what a forged pass needs): " + "; ".join(seen_review))
        if hits:
            parts.append("code that reaches into the grader or the interpreter; read it: " + "; ".join(hits))
        rows.append(row("(review)", "note", " | ".join(parts)[:900]))
    return rows


# -- where the results go -----------------------------------------------------------------------
def _escape_formula(value: str) -> str:
    # A spreadsheet runs a cell that starts with one of these as a formula.
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r", "|", "%") else value


class Store:
    """The CSV and JSON-lines files: rewritten whole after each submission, through a temp file and a rename."""

    def __init__(self, csv_path: Path | None, jsonl_path: Path | None, *, resume: bool, overwrite: bool) -> None:
        self.csv_path, self.jsonl_path = csv_path, jsonl_path
        self.rows: list[Row] = []
        self.sealed = False
        for p in (csv_path, jsonl_path):
            if p is None:
                continue
            if p.is_symlink():
                raise GradingError(f"{p} is a symbolic link; the grader never writes through one. Give a plain file path.")
            if p.exists() and not p.is_file():
                raise GradingError(f"{p} exists and is not a file. Give a file path.")
            if not p.parent.is_dir():
                raise GradingError(f"the folder of {p} does not exist: create it, or give another path")
            if p.exists() and p.stat().st_mode & 0o777 == 0 and p.stat().st_uid == os.geteuid():
                os.chmod(p, OPEN_MODE)  # sealed by an earlier grader that was killed before it could open them
        if resume:
            if jsonl_path is None or not jsonl_path.exists():
                raise GradingError(f"--resume continues from {jsonl_path}, which does not exist: run without --resume first")
            for n, line in enumerate(jsonl_path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    self.rows.append(Row(**{k: str(d.get(k, "")) for k in FIELDS}))
                except (ValueError, TypeError) as e:
                    raise GradingError(f"{jsonl_path}, line {n}: not a row of this grader ({e}); "
                                       "give the file of an earlier `minipaged grade`, or start again with --overwrite") from None
        elif not overwrite:
            existing = [str(p) for p in (csv_path, jsonl_path) if p is not None and p.exists()]
            if existing:
                raise GradingError(f"{' and '.join(existing)} already exist: add --resume to continue that run, "
                                   "or --overwrite to start again")

    def done(self) -> set[tuple[str, str]]:
        """(file, sha256) of every submission graded already: a file changed since is graded again."""
        return {(r.file, r.sha256) for r in self.rows if r.file}

    def append(self, rows: list[Row]) -> None:
        self.rows.extend(rows)
        self.flush()

    def seal(self) -> None:
        """While runs go on, the files exist with mode 0000: no run can read them (a run without bwrap is the
        grader's own user, but sandbox.seal_program refuses it chmod, ACLs and user namespaces, and a root grader's
        runs hold no capability). Written now, so that they exist from the start."""
        self.sealed = True
        self.flush()

    def unseal(self) -> None:
        """The files get their usual mode (0600) back: the runs are over."""
        self.sealed = False
        for p in (self.csv_path, self.jsonl_path):
            if p is not None and p.is_file() and not p.is_symlink():
                os.chmod(p, OPEN_MODE)

    def flush(self) -> None:
        if self.csv_path is not None:
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(FIELDS)
            for r in self.rows:
                w.writerow([_escape_formula(getattr(r, k)) for k in FIELDS])
            _atomic_write(self.csv_path, buf.getvalue(), SEALED_MODE if self.sealed else OPEN_MODE)
        if self.jsonl_path is not None:
            _atomic_write(self.jsonl_path, "".join(json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in self.rows),
                          SEALED_MODE if self.sealed else OPEN_MODE)


OPEN_MODE, SEALED_MODE = 0o600, 0o000


def _atomic_write(path: Path, text: str, mode: int = OPEN_MODE) -> None:
    """Write ``text`` to a new file beside ``path`` created with ``mode`` (never readable by anyone else, not
    for an instant), then rename it over ``path``."""
    if path.is_symlink():
        raise GradingError(f"{path} became a symbolic link while grading; the grader never writes through one. "
                           "Nothing was written to it; the rows so far are in the other results file.")
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise GradingError(f"could not create a temporary file beside {path}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a name, never follows it
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- the scoreboard -------------------------------------------------------------------------------
def _missing_rows(subs: list[Submission], file_rows: list[Row], by_folder: bool) -> list[Row]:
    """In a class folder, the workbooks someone submitted that a learner did not."""
    if not by_folder:
        return []
    seen: dict[str, set] = {}
    for s in subs:
        seen.setdefault(s.learner, set()).add(s.workbook)
    for r in file_rows:  # a broken file still counts as handed in
        seen.setdefault(r.learner, set()).add(r.workbook)
    all_wb = sorted({w for ws in seen.values() for w in ws if w in WORKBOOKS})
    rows = []
    for learner, ws in sorted(seen.items()):
        for w in all_wb:
            if w not in ws:
                rows.append(Row(learner, w, "(file)", "missing", "no submission for this workbook", ""))
    return rows


def print_scoreboard(rows: list[Row], out=sys.stdout) -> None:
    if not rows:
        print("nothing was graded", file=out)
        return
    head = ["learner", "workbook", "check", "result", "message"]
    table = [[clean(r.learner), clean(r.workbook), clean(r.check), clean(r.result), clean(r.message)] for r in rows]
    width = [min(max(len(x[i]) for x in table + [head]), cap) for i, cap in enumerate((20, 26, 48, 7, 10_000))]

    def fmt(cells):
        cut = [c if len(c) <= width[i] else c[: width[i] - 1] + "\u2026" for i, c in enumerate(cells)]
        return "  ".join(c.ljust(width[i]) for i, c in enumerate(cut[:4])) + "  " + cut[4]

    print(fmt(head).rstrip(), file=out)
    print("-" * min(150, sum(width[:4]) + 8 + 20), file=out)
    last = None
    for cells in table:
        if last is not None and cells[0] != last:
            print("", file=out)
        print(fmt(cells).rstrip(), file=out)
        last = cells[0]
    print("", file=out)
    learners: dict[str, list[Row]] = {}
    for r in rows:
        learners.setdefault(r.learner, []).append(r)
    for learner, rs in learners.items():
        checks = [r for r in rs if r.result in ("pass", "FAIL", "skip", "ERROR") and not r.check.startswith(("cell ", "code cell ", "("))]
        passed_n = sum(r.result == "pass" for r in checks)
        extra = []
        skipped = sum(r.result == "skip" for r in checks)
        if skipped:
            extra.append(f"{skipped} skipped")
        bad_files = [r for r in rs if r.result in ("broken", "missing")]
        if bad_files:
            extra.append(f"{len(bad_files)} file(s) broken or missing")
        flagged = [r for r in rs if r.check in ("(check cells)", "(result channel)")]
        if flagged:
            extra.append("check cells or results tampered with")
        review = [r for r in rs if r.check == "(review)"]
        if review:
            extra.append("flagged for review: read the cells the (review) rows name")
        print(clean(f"{learner}: {passed_n}/{len(checks)} checks passed" + (f" ({', '.join(extra)})" if extra else "")), file=out)


class Progress:
    """One line per graded submission, with a bar and the time left (a live bar on a terminal)."""

    def __init__(self, total: int, out=sys.stderr) -> None:
        self.total, self.done, self.out, self.t0 = total, 0, out, time.monotonic()
        self.live = hasattr(out, "isatty") and out.isatty()

    def update(self, sub: Submission, rows: list[Row], wall: float) -> None:
        self.done += 1
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done)
        checks = [r for r in rows if not r.check.startswith("(") and "(your code" not in r.check]
        ok = sum(r.ok for r in checks)
        n = 24
        fill = int(n * self.done / max(1, self.total))
        bar = "#" * fill + "." * (n - fill)
        line = (f"[{bar}] {self.done}/{self.total}  {clean(sub.learner)} {clean(sub.workbook)}: {ok}/{len(checks)} ok "
                f"({wall:.0f} s)  elapsed {_clock(el)}, about {_clock(eta)} left")
        print(("\r\x1b[K" if self.live else "") + line, end="" if self.live else "\n", file=self.out, flush=True)

    def close(self) -> None:
        if self.live and self.done:
            print(file=self.out)


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``minipaged grade`` (the CLI's parser, or main's own)."""
    p.add_argument("paths", nargs="+", metavar="PATH", help="a workbook .ipynb, or a folder of submissions")
    p.add_argument("--csv", metavar="FILE", default="grades.csv", help="the scoreboard as CSV (default grades.csv)")
    p.add_argument("--jsonl", metavar="FILE", help="the scoreboard as JSON lines (default: the CSV's name with .jsonl)")
    p.add_argument("--resume", action="store_true", help="continue the run recorded in the JSON-lines file")
    p.add_argument("--overwrite", action="store_true", help="start again, replacing existing result files")
    p.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="submissions graded at once (default: the number of cores)")
    p.add_argument("--timeout", type=float, default=900, metavar="S", help="wall-clock limit per workbook in seconds (default 900)")
    p.add_argument("--memory", type=float, default=4, metavar="GIB", help="address-space limit per workbook (default 4 GiB)")
    p.add_argument("--exercises", metavar="DIR", help="the course's pristine exercises/ folder (default: the one beside the package)")
    p.add_argument("--no-sandbox", action="store_true", help="do not use bwrap even where it is installed (resource limits only)")
    p.epilog = "Results are appended to the CSV and JSON-lines files after each submission."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minipaged grade", description="Grade workbooks in a sandbox with the exercises' own checks.")
    add_arguments(p)
    args = p.parse_args(argv)
    args._parser = p
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Grade what ``args`` names (see add_arguments); the exit status of ``minipaged grade``."""
    p = getattr(args, "_parser", None) or argparse.ArgumentParser(prog="minipaged grade")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite contradict each other: choose one")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.timeout <= 0 or args.memory <= 0:
        p.error("--timeout and --memory must be positive")
    signals = _Signals()
    signals.install()  # from here a kill from the terminal stops the grader cleanly; one from a learner's run is ignored
    try:
        return _run(args, p, signals)
    finally:
        signals.uninstall()


def _run(args: argparse.Namespace, p: argparse.ArgumentParser, signals: "_Signals") -> int:
    exercises = Path(args.exercises) if args.exercises else default_exercises()
    if exercises is None or not all((exercises / f"{w}.ipynb").is_file() for w in WORKBOOKS):
        print(f"minipaged grade: error: the pristine exercises are not at {exercises or '(no folder found)'}: give "
              "--exercises DIR, the course's exercises/ folder (the grader runs its check cells, never the notebooks' own)",
              file=sys.stderr)
        return 2
    csv_path = Path(args.csv)
    jsonl_path = Path(args.jsonl) if args.jsonl else csv_path.with_suffix(".jsonl")
    try:
        store = Store(csv_path, jsonl_path, resume=args.resume, overwrite=args.overwrite)
    except GradingError as e:
        print(f"minipaged grade: error: {e}", file=sys.stderr)
        return 2
    adopting = sandbox.adopt_orphans()  # every process a run starts is the grader's to kill, whoever its parent was
    try:
        return _grade_class(args, signals, exercises, store, csv_path, jsonl_path)
    finally:
        sandbox.stop_adopting(adopting)
        if store.sealed:
            store.unseal()


def _grade_class(args: argparse.Namespace, signals: "_Signals", exercises: Path, store: "Store", csv_path: Path,
                 jsonl_path: Path) -> int:
    subs, file_rows = discover(args.paths)
    by_folder = any(Path(x).is_dir() for x in args.paths)
    if not subs and not file_rows:
        print("no workbooks found in " + ", ".join(args.paths), file=sys.stderr)
        return 2
    use_bwrap = not args.no_sandbox and sandbox.bwrap_path() is not None
    sys.dont_write_bytecode = True  # the grader's own lazy imports leave the package's digest as it was
    if not use_bwrap:
        print("warning: learners' code is NOT sandboxed (bubblewrap "
              + ("disabled by --no-sandbox" if args.no_sandbox else "is not installed: apt-get install bubblewrap")
              + "): " + NO_SANDBOX_PROTECTS, file=sys.stderr)
    hide = sorted({str(Path(x).resolve()) for x in args.paths if Path(x).is_dir()}
                  | {str(Path(x).resolve().parent) for x in args.paths if Path(x).is_file()}
                  | {str(p.resolve().parent) for p in (csv_path, jsonl_path)})  # the grades are never readable inside
    limits = sandbox.Limits(wall_s=args.timeout, memory_bytes=int(args.memory * 2**30))
    settings = Settings(exercises=exercises.resolve(), limits=limits, use_bwrap=use_bwrap, hide=tuple(hide))
    order = {w: i for i, w in enumerate(WORKBOOKS)}
    subs.sort(key=lambda s: (s.learner, order.get(s.workbook, 99), s.workbook, s.path.name))
    counts: dict = {}
    for s in subs:
        counts[(s.learner, s.workbook)] = counts.get((s.learner, s.workbook), 0) + 1
    siblings = list(subs)  # 07 reads a learner's 02-06: for a file given alone, the ones beside it
    for x in args.paths:
        if Path(x).is_file():
            for f in sorted(Path(x).parent.glob("*.ipynb")):
                stem = identify(f.name)
                if stem and f.resolve() != Path(x).resolve() and _learner(f, None, stem) == _learner(Path(x), None, identify(x)):
                    siblings.append(Submission(_learner(f, None, stem), stem, f))
    done = store.done()
    todo = [s for s in subs if (str(s.path), _sha256(s.path)) not in done]
    if args.resume:
        print(f"resuming: {len(subs) - len(todo)} submission(s) graded already, {len(todo)} to go", file=sys.stderr)
    recorded = {r.file for r in store.rows}
    new_file_rows = [r for r in file_rows if r.file not in recorded]
    if new_file_rows:
        store.append(new_file_rows)
    print(f"grading {len(todo)} submission(s), {args.jobs} at a time, "
          + ("in bwrap sandboxes" if use_bwrap else "without a sandbox") + f" ({sandbox.resource_summary(limits)})",
          file=sys.stderr)
    if use_bwrap and hasattr(os, "geteuid") and os.geteuid() == 0 and not sandbox.drops_root(True):
        print(f"warning: learner code runs as root inside the sandbox ({sandbox.why_root()}); install setpriv "
              "(util-linux) and a Python that every user can read to run learners unprivileged", file=sys.stderr)
    store.seal()  # mode 0000 until the runs are over: no run reads the grades (see Store.seal)
    package_digest = tree_digest(_PACKAGE)
    stop = threading.Event()
    progress = Progress(len(todo))
    aborted = ""
    pool = cf.ThreadPoolExecutor(max_workers=args.jobs)
    try:
        futures = {}
        if signals.poll(0) is None:  # a signal while the grader was starting: start no run
            for s in todo:
                futures[pool.submit(_timed, grade_submission, s, settings, siblings, stop)] = s
        for fut in _completed(futures, signals):
            s = futures[fut]
            try:
                graded, wall = fut.result()
            except Exception as e:  # noqa: BLE001 - one submission must not stop the class
                graded, wall = [Row(s.learner, s.workbook, "(run)", "ERROR", f"the grader failed on this file: "
                                    f"{type(e).__name__}: {_first_line(str(e))}", str(s.path), _sha256(s.path))], 0.0
            if stop.is_set() and any("interrupted" in r.message for r in graded):
                continue  # half graded: --resume grades it again
            if counts[(s.learner, s.workbook)] > 1:  # two files of one workbook: say which is which
                for r in graded:
                    r.check = f"{r.check} [{s.path.name}]"
            if tree_digest(_PACKAGE) != package_digest:
                aborted = (f"the installed package changed while {s.learner}'s {s.workbook} (or a run beside it) was "
                           f"graded: reinstall minipaged, then grade again with bwrap installed. Rows after this one are not trustworthy.")
                graded.append(Row(s.learner, s.workbook, "(run)", "FAIL", "the installed checks changed during this run", str(s.path), _sha256(s.path)))
                store.append(graded)
                stop.set()
                break
            store.append(graded)
            progress.update(s, graded, wall)
    except (_Interrupted, KeyboardInterrupt) as e:  # KeyboardInterrupt: Ctrl-C where signals are not waited for
        stop.set()  # each run in progress is killed with its whole tree within a fraction of a second
        pool.shutdown(wait=False, cancel_futures=True)  # the ones not started never start
        progress.close()
        signum = getattr(e, "signum", signal.SIGINT)
        name = signal.Signals(signum).name
        print(f"\n{name} received: stopping the runs in progress ...", file=sys.stderr, flush=True)
        pool.shutdown(wait=True)
        print(f"interrupted by {name}: {progress.done} of {len(todo)} submission(s) graded this time, kept in "
              f"{csv_path} and {jsonl_path}; the others were not graded. Continue with: {_resume_command(args)}",
              file=sys.stderr, flush=True)
        return 128 + signum
    except GradingError as e:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        print(f"minipaged grade: error: {e}", file=sys.stderr)
        return 2
    pool.shutdown(wait=True, cancel_futures=True)
    progress.close()
    if aborted:
        print(f"minipaged grade: stopped: {aborted}", file=sys.stderr)
        return 3
    rows = list(store.rows)
    missing = [r for r in _missing_rows(subs, file_rows, by_folder) if (r.learner, r.workbook) not in
               {(x.learner, x.workbook) for x in rows}]
    if missing:
        store.append(missing)
        rows += missing
    rows.sort(key=lambda r: (r.learner, order.get(r.workbook, 99), r.workbook))
    print_scoreboard(rows)
    print(f"\nwrote {csv_path} and {jsonl_path}")
    return 0 if all(r.ok for r in rows) else 1


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _completed(futures, signals: "_Signals"):
    """cf.as_completed, that raises _Interrupted when SIGINT or SIGTERM came from outside the runs."""
    pending = set(futures)
    while True:
        signum = signals.poll(0.2 if pending else 0)
        if signum is not None:
            raise _Interrupted(signum)
        if not pending:
            return
        done, pending = cf.wait(pending, timeout=0 if signals.waits else 0.2, return_when=cf.FIRST_COMPLETED)
        yield from done


_STOPPING = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """SIGINT and SIGTERM while grading, read with their sender where the kernel says who sent them.

    The main thread blocks both (every thread it starts inherits that) and waits for them with sigtimedwait
    between results: the kernel gives a process's signal to its main thread first when that thread waits for
    it, so the sender is known. One sent by a learner's run (its session, alive or gone) is reported and
    ignored; any other (Ctrl-C, `kill`, a CI job's SIGTERM) stops the grader. Threads started before the
    grader ran (numpy's OpenBLAS starts one when minipaged is imported) do not block them: a signal that the
    kernel hands to one of those, while the main thread is busy, reaches the handler installed here, with no
    sender; it stops the grader too, never kills it half way."""

    def __init__(self) -> None:
        self.waits = False  # the main thread blocks them and waits for them (Linux)
        self._signum: int | None = None
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # graded from another thread (a test): its caller handles signals
        for s in _STOPPING:
            self._old[s] = signal.signal(s, self._caught)
        if hasattr(signal, "sigtimedwait") and hasattr(signal, "pthread_sigmask"):  # not on macOS: handlers only
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
            self.waits = True

    def uninstall(self) -> None:
        if self.waits:
            self.waits = False
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPPING)  # a second Ctrl-C still pending lands in _caught
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._old = {}

    def _caught(self, signum, frame) -> None:
        if self._signum is None:
            self._signum = signum

    def poll(self, timeout: float) -> int | None:
        """The signal that stops the grader, waiting for it up to ``timeout`` seconds; None when none came."""
        if self._signum is not None or not self.waits:
            return self._signum
        deadline = time.monotonic() + timeout
        while self._signum is None:
            info = signal.sigtimedwait(_STOPPING, max(0.0, deadline - time.monotonic()))
            if info is None:
                break
            if info.si_pid and sandbox.sent_by_a_run(info.si_pid):
                print(f"\nignored signal {info.si_signo} sent by a learner's run (process {info.si_pid})", file=sys.stderr)
                continue
            self._signum = info.si_signo
        return self._signum


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run (the same files and options, with --resume)."""
    import shlex

    cmd = ["minipaged", "grade", *args.paths, "--csv", str(args.csv)]
    if args.jsonl:
        cmd += ["--jsonl", str(args.jsonl)]
    if args.exercises:
        cmd += ["--exercises", str(args.exercises)]
    if args.timeout != 900:
        cmd += ["--timeout", f"{args.timeout:g}"]
    if args.memory != 4:
        cmd += ["--memory", f"{args.memory:g}"]
    if args.no_sandbox:
        cmd.append("--no-sandbox")
    return shlex.join(cmd + ["--resume"])


def _timed(fn, *args):
    t = time.monotonic()
    rows = fn(*args)
    return rows, time.monotonic() - t


if __name__ == "__main__":
    sys.exit(main())
