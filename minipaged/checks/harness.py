"""The process that grades one submission, inside its sandbox: ``python -m minipaged.checks.harness``.

Owns running a plan (minipaged.checks.canonical) in a fresh interpreter: the learner's cells,
then each pristine check cell, and reporting every verdict, signed, on the result channel.
It never reads the submission itself and never writes a file; the grader (grading.py) owns
the sandbox, the limits and the scoreboard.

Why a verdict can be trusted:
- the job (plan and a per-run key) comes on stdin, read and closed before any learner code runs;
  the key never is in the environment, a file or the learner's namespace;
- every check module, the package and the modules checks rely on (builtins, sys, torch, ...) are
  imported first and snapshotted; before and after each check cell the snapshot is compared, so a
  learner's cell that replaced a check function, a builtin or a torch function fails that check;
- a check passes only when it returned normally with everything intact and the harness said so
  on the result channel (a pipe, one line per event, each with an HMAC under the run's key): an
  ``os._exit``, a crash or a time-out leaves the check without a verdict, which counts as failed,
  and a line written by anyone else fails its MAC and marks the run as tampered with.
"""
from __future__ import annotations

import builtins
import gc
import hashlib
import importlib
import json
import json.encoder
import linecache
import os
import pkgutil
import sys
import threading
import types

# The harness's own code must not depend on names a learner's cell can replace: builtins are
# bound here as module globals, the channel uses C functions only (their types cannot be patched).
isinstance, len, list, dict, set, str, int, type, getattr, vars, sorted, any, all, repr, min = (  # noqa: A001
    builtins.isinstance, builtins.len, builtins.list, builtins.dict, builtins.set, builtins.str, builtins.int,
    builtins.type, builtins.getattr, builtins.vars, builtins.sorted, builtins.any, builtins.all, builtins.repr,
    builtins.min)
_exec, _compile, _BaseException = builtins.exec, builtins.compile, builtins.BaseException
_write = os.write
_escape = json.encoder.encode_basestring_ascii
_int_repr = int.__repr__

FAIL_NAMES = {"CheckFailed", "NotImplementedYet", "CheckTimeout", "AssertionError"}
WATCHED = ("builtins", "sys", "os", "os.path", "io", "math", "random", "time", "signal", "traceback", "inspect",
           "functools", "itertools", "operator", "collections", "copy", "types", "gc", "threading", "json", "hmac",
           "re", "contextlib", "dataclasses", "linecache", "numpy", "torch", "torch.nn.functional", "torch.testing")
MAX_MESSAGE = 1500


def _first_line(text: str) -> str:
    text = (text or "").strip()
    return text.split("\n", 1)[0].strip()[:300] if text else ""


def _describe(e: BaseException) -> tuple[str, str]:
    """(result, message) for an exception a check cell raised; never raises itself."""
    name = type(e).__name__
    try:
        msg = str(e)
    except BaseException:  # noqa: BLE001 - a learner's exception whose __str__ raises
        msg = "(its message could not be read)"
    if not isinstance(msg, str):
        msg = "(its message is not text)"
    first = _first_line(msg) or name
    if name in FAIL_NAMES and type(e).__module__.startswith(("minipaged.", "builtins")):
        return "FAIL", first
    return "ERROR", f"{name}: {first}"[:MAX_MESSAGE]


# -- what must not change while the checks run ---------------------------------------------------
class Snapshot:
    """Identity of every attribute of the watched modules, of minipaged's classes and functions."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[types.ModuleType, dict]] = {}
        self.classes: list[tuple[str, type, dict]] = []
        self.functions: list[tuple[str, types.FunctionType, tuple]] = []
        for name, mod in list(sys.modules.items()):
            if not isinstance(mod, types.ModuleType):
                continue
            ours = name == "minipaged" or name.startswith("minipaged.") or mod is sys.modules.get(__name__)
            if ours or name in WATCHED:
                self.modules[name] = (mod, dict(vars(mod)))
                for attr, obj in vars(mod).items():
                    owner = getattr(obj, "__module__", None)
                    owner = owner if isinstance(owner, str) else ""
                    mine = ours and (owner.startswith("minipaged") or owner == __name__)
                    if isinstance(obj, type) and (mine or owner == "torch"):
                        self.classes.append((f"{name}.{attr}", obj, dict(vars(obj))))
                    elif isinstance(obj, types.FunctionType) and mine:
                        self.functions.append((f"{name}.{attr}", obj, self._fn(obj)))
        import torch

        self.classes.append(("torch.Tensor", torch.Tensor, dict(vars(torch.Tensor))))
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.threads = {t.ident for t in threading.enumerate()}
        self.gc_callbacks = list(gc.callbacks)

    @staticmethod
    def _fn(f: types.FunctionType) -> tuple:
        return (f.__code__, f.__defaults__, f.__kwdefaults__, f.__globals__, f.__closure__)

    def changes(self) -> list[str]:
        out = []
        for name, (mod, attrs) in self.modules.items():
            if sys.modules.get(name) is not mod:
                out.append(f"sys.modules[{name!r}] was replaced")
                continue
            now = vars(mod)
            for k, v in attrs.items():
                if k not in now:
                    out.append(f"{name}.{k} was deleted")
                elif now[k] is not v and k not in ("__warningregistry__",):
                    out.append(f"{name}.{k} was replaced")
            if name in ("builtins",) or name.startswith("minipaged"):
                added = [k for k in now if k not in attrs and not k.startswith("__")]
                if name == "builtins" and added:
                    out.append(f"builtins gained {', '.join(sorted(added)[:5])}")
        for name, cls, attrs in self.classes:
            now = vars(cls)
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v and k not in ("__weakref__", "__dict__", "__abstractmethods__", "_abc_impl"):
                    out.append(f"{name}.{k} was replaced")
            added = [k for k in now if k not in attrs and k not in ("__abstractmethods__", "_abc_impl", "__parameters__")]
            if added:
                out.append(f"{name} gained {', '.join(sorted(added)[:5])}")
        for name, f, state in self.functions:
            if any(a is not b for a, b in zip(self._fn(f), state)):  # identity only: == could run a learner's __eq__
                out.append(f"the code of {name} was changed")
        # a library imported later may append a finder (six does); one put in front would intercept minipaged's imports
        if sys.meta_path[: len(self.meta_path)] != self.meta_path or sys.path_hooks[: len(self.path_hooks)] != self.path_hooks:
            out.append("the import system (sys.meta_path or sys.path_hooks) was changed")
        if sys.gettrace() is not None or sys.getprofile() is not None:
            out.append("a trace or profile hook was installed")
        extra = [t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if extra:
            out.append(f"a thread of yours is still running ({', '.join(extra[:3])})")
        if list(gc.callbacks) != self.gc_callbacks:
            out.append("gc.callbacks was changed")
        return out


_MISSING = object()


# -- the guard when there is no bwrap: a Python audit hook, defence in depth only ------------------
def install_guard(workdir: str) -> None:
    """Refuse, from Python, writes and deletions outside ``workdir``, new processes and ctypes.
    Native code gets past an audit hook; bwrap is the sandbox, this is a seat belt without it."""
    root = os.path.realpath(workdir) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fspath, isinstance_ = os.path.realpath, os.fspath, isinstance

    def inside(p) -> bool:
        try:
            if isinstance_(p, int):
                return True  # an already open descriptor
            return (realpath(fspath(p)) + os.sep).startswith(root)
        except Exception:  # noqa: BLE001
            return False

    def refuse(what: str, p) -> None:
        raise PermissionError(f"the grader refuses {what} outside the submission's folder: {p!r}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance_(mode, str) and any(ch in mode for ch in "wax+")) or (
                isinstance_(flags, int) and flags & write_flags)
            if writing and not inside(path):
                refuse("writing", path)
        elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                       "shutil.rmtree", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr"):
            if args and not inside(args[0]):
                refuse(event, args[0])
        elif event in ("os.rename", "os.link", "shutil.copyfile", "shutil.move", "shutil.copytree"):
            for p in args[:2]:
                if not inside(p):
                    refuse(event, p)
        elif event == "os.symlink":
            refuse("making a symbolic link", args[:2])
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                       "os.forkpty", "pty.spawn", "ctypes.dlopen", "os.kill", "os.killpg", "signal.pthread_kill"):
            raise PermissionError(f"the grader refuses {event} in a submission")

    sys.addaudithook(hook)


# -- running the plan ------------------------------------------------------------------------------
def _python_only(source: str) -> str:
    return "\n".join("pass  # " + ln if ln.lstrip().startswith(("%", "!")) else ln for ln in source.split("\n"))


def _bound_names(source: str) -> set[str]:
    """Top-level names a check cell binds (imports and assignments)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def main() -> int:
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    sys.stdin.close()
    fd = int(job["result_fd"])
    key = bytes.fromhex(job.pop("key")).ljust(64, b"\0")
    inner = hashlib.sha256(bytes(x ^ 0x36 for x in key))  # HMAC-SHA256 by hand: only C methods are used later
    outer = hashlib.sha256(bytes(x ^ 0x5C for x in key))
    del key
    seq = [0]

    def emit(**payload) -> None:
        payload["seq"] = seq[0]
        seq[0] += 1
        body = "{" + ",".join(_escape(k) + ":" + (_int_repr(v) if type(v) is int else _escape(v))
                              for k, v in payload.items()) + "}"
        data = body.encode("ascii")
        i = inner.copy()
        i.update(data)
        o = outer.copy()
        o.update(i.digest())
        _write(fd, data + b"\t" + o.hexdigest().encode("ascii") + b"\n")

    if job.get("copy_from"):  # in bwrap: the handed-in files, read-only, copied into the private tmpfs
        import shutil

        for name in sorted(os.listdir(job["copy_from"])):
            if name.endswith(".ipynb"):
                shutil.copyfile(os.path.join(job["copy_from"], name), name)
    # cwd is the submission's folder: nothing in it may shadow a module the checks import later
    here = os.path.realpath(".")
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) != here]
    import minipaged
    import minipaged.checks
    from minipaged.checks import _core

    for m in pkgutil.iter_modules(minipaged.checks.__path__):
        if m.name not in ("harness", "grading", "sandbox"):
            importlib.import_module(f"minipaged.checks.{m.name}")
    for name in job.get("preload", []):  # what a check imports late and that rebinds names it watches
        importlib.import_module(name)
    skips: list[str] = []
    genuine: set = set()
    todo = [f.__code__ for mod in list(sys.modules.values()) if isinstance(mod, types.ModuleType)
            and getattr(mod, "__name__", "").startswith("minipaged.checks.")
            for f in vars(mod).values() if isinstance(f, types.FunctionType)]
    while todo:  # the checks' functions and everything nested in them
        code = todo.pop()
        if code not in genuine:
            genuine.add(code)
            todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    real_skipped = _core.skipped

    def skipped(line: str) -> None:  # a skip counts only when a check itself said it
        caller = sys._getframe(1).f_code
        if caller in genuine:
            skips.append(str(line))
        real_skipped(line)

    for mod in list(sys.modules.values()):
        if isinstance(mod, types.ModuleType) and getattr(mod, "__name__", "").startswith("minipaged.checks") \
                and vars(mod).get("skipped") is real_skipped:
            mod.skipped = skipped
    ns: dict = {"__name__": "__main__", "__builtins__": builtins}
    try:
        from IPython.display import display

        ns["display"] = display
    except ImportError:
        pass
    snap = Snapshot()
    changes, trusted = snap.changes, [(f, f.__code__) for f in (Snapshot.changes, Snapshot._fn, _describe, _first_line,
                                                                   _bound_names, _python_only)]

    def tampered() -> list[str]:
        if any(f.__code__ is not code for f, code in trusted):
            return ["the grader's own code was changed"]
        return changes()

    if job.get("guard"):
        install_guard(job["workdir"])
    emit(event="ready")

    check_bound: dict[str, object] = {}
    sources: dict[str, tuple] = {}
    # parsed now: ast (pure Python) would run on the learner's builtins later
    binds = {idx: _bound_names(c["source"]) for idx, c in enumerate(job["cells"]) if c["kind"] == "check"}
    for idx, cell in enumerate(job["cells"]):
        emit(event="start", cell=idx)
        src = _python_only(cell["source"])
        filename = f"<{cell['label']}>"
        # as IPython does: inspect.getsource (is_stub, the checks' source reading) and tracebacks need the text
        sources[filename] = (len(src), None, src.splitlines(True), filename)
        linecache.cache.update(sources)  # also puts back any entry a learner's cell rewrote
        if cell["kind"] != "check":
            try:
                _exec(_compile(src, filename, "exec"), ns)
            except _BaseException as e:  # noqa: BLE001 - a learner's crash, SystemExit included, is a row
                result, msg = _describe(e)
                emit(event="cell", cell=idx, label=cell["label"], result="ERROR",
                     message=msg if result == "ERROR" else f"{type(e).__name__}: {msg}")
            continue
        try:
            problems = tampered()
            if ns.get("__builtins__") is not builtins:
                problems.append("__builtins__ of the notebook was replaced")
            for k, v in check_bound.items():
                if ns.get(k, _MISSING) is not v:
                    problems.append(f"your code rebound `{k}`, which a check cell set")
                    ns[k] = v
            ns["__builtins__"] = builtins
            del skips[:]
            result, msg = "pass", ""
            if not problems:
                try:
                    _exec(_compile(src, filename, "exec"), ns)
                except _BaseException as e:  # noqa: BLE001 - every way a check can end is a verdict
                    result, msg = _describe(e)
                problems = tampered()
            if problems:
                result = "FAIL"
                msg = ("your code changed what the checks rely on: " + "; ".join(problems[:4])
                       + ". Checks run against minipaged as installed: remove that code.")[:MAX_MESSAGE]
            elif result == "pass" and skips:
                result, msg = "skip", _first_line(skips[0])
            for k in binds[idx]:
                if k in ns:
                    check_bound[k] = ns[k]
        except _BaseException as e:  # noqa: BLE001 - the harness itself broken by what the learner's code did
            result, msg = "FAIL", f"your code broke the checks' environment ({type(e).__name__} in the grader's harness)"
        emit(event="check", cell=idx, check=cell["check"], result=result, message=msg[:MAX_MESSAGE])
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
