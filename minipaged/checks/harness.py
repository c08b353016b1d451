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
           "re", "contextlib", "dataclasses", "linecache", "numpy", "torch", "torch.nn.functional", "torch.testing",
           # the import system: a check cell's own `from minipaged.checks import x` goes through these
           "importlib", "importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
           "_frozen_importlib_external", "importlib.util", "importlib.machinery", "_imp", "marshal")
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
# In scope: what a learner's code could change to make a check pass. The check modules (every
# attribute, and the plain data they hold), the harness, the modules a check calls into (WATCHED:
# builtins, the import system, torch, ...), and minipaged's public API: the functions and classes
# its modules define. Out of scope by construction: anything under minipaged.cpu, and every other
# module-level value of minipaged that is not a function, class or module (an engine's lazy
# caches, a last plan): those are the engine's own state, which no check relies on.
_ENGINE_STATE = ("minipaged.cpu",)
# a check module's own caches, filled while a check runs (the reference model of 07)
# module data a check writes on purpose (a cache; workbook 10 keeps the learner's passed predictions for the
# measurement cells, which never grade): not compared before and after a check
_CHECK_CACHES = {"minipaged.checks.assemble": ("_MODEL",), "minipaged.checks.predict": ("PREDICTIONS",),
                 "minipaged.checks.structured": ("_STATE",),
                 "minipaged.checks.kv_connector": ("_BASELINES",)}
_PLAIN = (int, float, str, bytes, bool, type(None), complex)


def _in_scope(name: str) -> str:
    """'checks' for the check modules and the harness, 'api' for the rest of minipaged, '' for neither."""
    if name == __name__ or name == "minipaged.checks" or name.startswith("minipaged.checks."):
        return "checks"
    if name == "minipaged" or name.startswith("minipaged."):
        if any(name == p or name.startswith(p + ".") for p in _ENGINE_STATE):
            return ""
        return "api"
    return ""


def _fingerprint(obj, depth: int = 0):
    """The value of plain data (containers of numbers and text, a check's frozen dataclasses), as a tuple
    of exact types and values; anything else by identity. Never calls a learner's method."""
    t = type(obj)
    if t is float:
        return (t, obj.hex())  # NaN equals itself here
    if t in _PLAIN:
        return (t, obj)
    if depth > 6:
        return (t, id(obj))
    if t is list or t is tuple:
        return (t, tuple(_fingerprint(x, depth + 1) for x in obj))
    if t is dict:
        return (t, tuple((_fingerprint(k, depth + 1), _fingerprint(v, depth + 1)) for k, v in obj.items()))
    if t is set or t is frozenset:
        return (t, len(obj), id(obj))
    mod = getattr(t, "__module__", "")
    if isinstance(mod, str) and mod.startswith("minipaged.checks") and hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (t, id(obj), tuple((k, _fingerprint(v, depth + 1)) for k, v in sorted(vars(obj).items())))
    return (t, id(obj))


class Snapshot:
    """Identity of every attribute of the watched modules and of minipaged's functions and classes,
    and the value of the plain data the check modules hold."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[types.ModuleType, dict]] = {}
        self.data: dict[str, tuple] = {}
        self.classes: list[tuple[str, type, dict]] = []
        self.functions: list[tuple[str, types.FunctionType, tuple]] = []
        for name, mod in list(sys.modules.items()):
            if not isinstance(mod, types.ModuleType):
                continue
            scope = _in_scope(name)
            if not scope and name not in WATCHED:
                continue
            attrs = dict(vars(mod))
            if scope == "api":  # the public API only: never a module's values (an engine's caches)
                attrs = {k: v for k, v in attrs.items() if isinstance(v, (type, types.FunctionType, types.ModuleType))}
            self.modules[name] = (mod, attrs)
            if scope == "checks":
                skip = _CHECK_CACHES.get(name, ())
                self.data[name] = tuple((k, _fingerprint(v)) for k, v in sorted(attrs.items())
                                        if k not in skip and not k.startswith("__")
                                        and not isinstance(v, (type, types.FunctionType, types.ModuleType)))
            for attr, obj in attrs.items():
                owner = getattr(obj, "__module__", None)
                owner = owner if isinstance(owner, str) else ""
                mine = scope != "" and bool(_in_scope(owner))
                if isinstance(obj, type) and (mine or owner == "torch"):
                    self.classes.append((f"{name}.{attr}", obj, self._methods(obj), frozenset(vars(obj))))
                elif isinstance(obj, types.FunctionType) and mine:
                    self.functions.append((f"{name}.{attr}", obj, self._fn(obj)))
        import torch

        for name, cls in (("torch.Tensor", torch.Tensor), ("int", int), ("float", float), ("str", str), ("bool", bool),
                          ("list", list), ("tuple", tuple), ("dict", dict), ("object", object), ("type", type)):
            self.classes.append((name, cls, dict(vars(cls)), frozenset(vars(cls))))
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.threads = {t.ident for t in threading.enumerate()}
        self.gc_callbacks = list(gc.callbacks)

    @staticmethod
    def _methods(cls: type) -> dict:
        # what a class does (its functions and descriptors), never its class-level values (a cache)
        return {k: v for k, v in vars(cls).items()
                if isinstance(v, (types.FunctionType, classmethod, staticmethod, property, type))
                or type(v).__name__ in ("method_descriptor", "wrapper_descriptor", "getset_descriptor",
                                         "member_descriptor", "builtin_function_or_method")}

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
            if name == "builtins":
                added = [k for k in now if k not in attrs and not k.startswith("__")]
                if added:
                    out.append(f"builtins gained {', '.join(sorted(added)[:5])}")
        for name, data in self.data.items():
            mod = self.modules[name][0]
            now = tuple((k, _fingerprint(vars(mod).get(k, _MISSING))) for k, _ in data)
            if now != data:
                changed = [a[0] for a, b in zip(data, now) if a != b]
                out.append(f"the data of {name} ({', '.join(changed[:3])}) was changed")
        for name, cls, attrs, keys in self.classes:
            now = vars(cls)
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v and k not in ("__weakref__", "__dict__", "__abstractmethods__", "_abc_impl"):
                    out.append(f"{name}.{k} was replaced")
            added = [k for k in now if k not in keys and k not in ("__abstractmethods__", "_abc_impl", "__parameters__")
                     and (k.startswith("__") or isinstance(now[k], (types.FunctionType, classmethod, staticmethod, property)))]
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


# -- introspection from a learner's cell: reported for review, ctypes refused -------------------------
_INTROSPECTION = frozenset({"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
                            "gc.get_referents", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                            "object.__getattr__", "object.__setattr__", "code.__new__", "function.__new__",
                            "marshal.loads", "cpython.PyInterpreterState_New", "sys._getframemodulename"})
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code", "gi_code", "cr_code",
                          "__code__", "__globals__", "__closure__", "__class__", "__bases__"})
_HELPERS = ("inspect.py", "traceback.py")  # what walks frames for its caller


def install_watch(learner_files: frozenset, workdir: str, current: list, emit) -> None:
    """An audit hook: frame, object-graph and tracing access made by a learner's own code is reported
    on the result channel (the grader flags the cell for review), and ctypes is refused to it.
    Frames are how a cell reaches the harness's state; ctypes is how it changes the interpreter."""
    root = os.path.realpath(workdir) + os.sep
    startswith, getframe, reported, busy = str.startswith, sys._getframe, set(), [False]

    def learner(code) -> bool:
        fn = code.co_filename
        if fn in learner_files or fn == "<string>" or startswith(fn, root):
            return True
        return not (startswith(fn, "/") or startswith(fn, "<frozen") or startswith(fn, "<check"))

    def by_learner() -> bool:
        f = getframe(2)  # 0 this function, 1 the hook, 2 the Python code that made the event
        for _ in range(4):  # through inspect.stack() and traceback.walk_stack() to whoever called them
            if f is None:
                return False
            if learner(f.f_code):
                return True
            if not f.f_code.co_filename.endswith(_HELPERS):
                return False
            f = f.f_back
        return False

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        ctypes_call = startswith(event, "ctypes.")
        if not ctypes_call and event not in _INTROSPECTION:
            return
        if event in ("object.__getattr__", "object.__setattr__") and (len(args) < 2 or args[1] not in _FRAME_ATTRS):
            return
        busy[0] = True
        try:
            mine = by_learner()
        except BaseException:  # noqa: BLE001
            mine = False
        finally:
            busy[0] = False
        if not mine:
            return
        what = event if len(args) < 2 or not isinstance(args[1], str) else f"{event} {args[1]}"
        if (current[0], what) not in reported:
            reported.add((current[0], what))
            emit(event="review", cell=current[0], what=what)
        if ctypes_call:
            raise PermissionError(f"the grader refuses {event} in a submission")

    sys.addaudithook(hook)


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

    isdir = os.path.isdir

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance_(mode, str) and any(ch in mode for ch in "wax+")) or (
                isinstance_(flags, int) and flags & write_flags)
            if writing and not inside(path):
                refuse("writing", path)
            # a folder's descriptor outside is what dir_fd= writes through: never handed out
            if not isinstance_(path, int) and not inside(path) and isdir(path) and not writing:
                refuse("opening a folder", path)
        elif event in _PATHS:
            paths, dir_fds = _PATHS[event]
            for p in args[:paths]:
                if not inside(p):
                    refuse(event, p)
            # a dir_fd names a folder the path no longer shows: refused whatever the path says
            for i in dir_fds:
                if i < len(args) and args[i] is not None and args[i] != -1:
                    refuse(f"{event} with dir_fd", args[:paths])
        elif event in ("os.symlink", "os.listxattr"):
            refuse("making a symbolic link" if event == "os.symlink" else event, args[:2])
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                       "os.forkpty", "pty.spawn", "ctypes.dlopen", "os.kill", "os.killpg", "signal.pthread_kill",
                       "os.setsid", "os.setpgid", "sys.remote_exec"):
            raise PermissionError(f"the grader refuses {event} in a submission")

    sys.addaudithook(hook)


# event: (how many leading arguments are paths, the indices of its dir_fd arguments)
_PATHS = {"os.remove": (1, (1,)), "os.rmdir": (1, (1,)), "os.mkdir": (1, (2,)), "os.chmod": (1, (2,)),
          "os.chown": (1, (3,)), "os.utime": (1, (3,)), "os.truncate": (1, ()), "shutil.rmtree": (1, (1,)),
          "os.chflags": (1, ()), "os.lchflags": (1, ()), "os.setxattr": (1, ()), "os.removexattr": (1, ()),
          "os.rename": (2, (2, 3)), "os.link": (2, (2, 3)), "shutil.copyfile": (2, ()), "shutil.move": (2, ()),
          "shutil.copytree": (2, ()), "shutil.copymode": (2, ()), "shutil.copystat": (2, ()), "shutil.chown": (1, ())}


def drop_unaudited() -> None:
    """Without bwrap: what Python does not audit and reached the grader (a signal by descriptor), removed
    before the snapshot, so that putting it back is a change the checks see."""
    import _signal
    import signal as signal_

    for mod, name in ((os, "pidfd_open"), (signal_, "pidfd_send_signal"), (_signal, "pidfd_send_signal")):
        try:
            delattr(mod, name)
        except AttributeError:
            pass


class _SourceOnly:
    """A finder for minipaged's modules that compiles their source and never reads a __pycache__:
    bytecode there may have been written by a learner's run (without bwrap nothing stops it)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):  # noqa: ARG003
        if name != "minipaged" and not name.startswith("minipaged."):
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _SourceLoader(spec.loader.name, spec.loader.path)
        return spec


def _source_loader_class():
    import importlib.machinery

    class SourceLoader(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):  # noqa: ARG002
            return _compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)

    return SourceLoader


_SourceLoader = _source_loader_class()


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
    mine = os.path.dirname(os.path.realpath(__file__))  # run as a script: its folder is first on sys.path
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.realpath(p) not in (here, mine)]
    sys.meta_path.insert(0, _SourceOnly)
    for name in [n for n in sys.modules if n == "minipaged" or n.startswith("minipaged.")]:
        del sys.modules[name]  # `-m minipaged.checks.harness` imported the package before this ran: again, from source
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
    if job.get("guard"):
        drop_unaudited()
    snap = Snapshot()
    changes, trusted = snap.changes, [(f, f.__code__) for f in (Snapshot.changes, Snapshot._fn, _describe, _first_line,
                                                                   _bound_names, _python_only, _fingerprint)]

    def tampered() -> list[str]:
        if any(f.__code__ is not code for f, code in trusted):
            return ["the grader's own code was changed"]
        return changes()

    # Everything the loop needs, made before any learner code runs and held in immutable objects: a
    # learner who reaches this frame (its locals are readable) can change none of it. The check cells
    # are compiled here, so no text of theirs is left to blank.
    plan = []
    for idx, cell in enumerate(job["cells"]):
        src = _python_only(cell["source"])
        filename = f"<{cell['label']}>"
        code = _compile(src, filename, "exec") if cell["kind"] == "check" else None
        binds_ = tuple(sorted(_bound_names(cell["source"]))) if cell["kind"] == "check" else ()
        plan.append((cell["kind"], cell["label"], cell.get("check", ""), src, filename, code, binds_))
    plan = tuple(plan)
    guard = bool(job.get("guard"))
    workdir = str(job["workdir"])
    del job
    learner_files = frozenset(p[4] for p in plan if p[0] != "check")
    current = [-1]  # the cell running now, for the review events
    install_watch(learner_files, workdir, current, emit)
    if guard:
        install_guard(workdir)
    emit(event="ready")

    check_bound: dict[str, object] = {}
    sources: dict[str, tuple] = {}
    for idx, (kind, label, check, src, filename, code, binds_) in enumerate(plan):
        current[0] = idx
        emit(event="start", cell=idx)
        # as IPython does: inspect.getsource (is_stub, the checks' source reading) and tracebacks need the text
        sources[filename] = (len(src), None, src.splitlines(True), filename)
        linecache.cache.update(sources)  # also puts back any entry a learner's cell rewrote
        if kind != "check":
            try:
                _exec(_compile(src, filename, "exec"), ns)
            except _BaseException as e:  # noqa: BLE001 - a learner's crash, SystemExit included, is a row
                result, msg = _describe(e)
                emit(event="cell", cell=idx, label=label, result="ERROR",
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
                    _exec(code, ns)
                except _BaseException as e:  # noqa: BLE001 - every way a check can end is a verdict
                    result, msg = _describe(e)
                problems = tampered()
            if problems:
                result = "FAIL"
                msg = ("your code changed what the checks rely on: " + "; ".join(problems[:4])
                       + ". Checks run against minipaged as installed: remove that code.")[:MAX_MESSAGE]
            elif result == "pass" and skips:
                result, msg = "skip", _first_line(skips[0])
            for k in binds_:
                if k in ns:
                    check_bound[k] = ns[k]
        except _BaseException as e:  # noqa: BLE001 - the harness itself broken by what the learner's code did
            result, msg = "FAIL", f"your code broke the checks' environment ({type(e).__name__} in the grader's harness)"
        emit(event="check", cell=idx, check=check, result=result, message=msg[:MAX_MESSAGE])
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
