"""Refusing minipaged's own implementation in the learner's place.

Owns two tests. The static one looks at the part before it runs: minipaged's class or function
itself (also under another name), a copy of one of its functions, or a subclass whose members
the learner must write all come from the package. The dynamic one watches the learner's code
while a check calls it: a profile hook sees every Python call, and a call into one of the
package's implementations (its code objects, however they were reached: an import, an alias,
``super()``, a wrapper, a copied method) fails the check with the name of what was called.
It never changes the learner's objects; the hook is set only around the learner's own calls.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from ._core import CheckFailed, run_with_time_limit

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))

# What each workbook must not delegate to: (module, attribute or None for every function and class
# the module defines). Classes contribute all their methods; "Class.method" names one method.
WATCH: dict[str, list[tuple[str, str | None]]] = {
    "01": [("minipaged.memory", None), ("minipaged.kv_cache", None), ("minipaged.checks.kv_cache_math", "ref_bytes_per_token"),
           ("minipaged.checks.kv_cache_math", "ref_bytes_per_sequence"),
           ("minipaged.checks.kv_cache_math", "ref_max_seqs_contiguous"),
           ("minipaged.checks.kv_cache_math", "ref_max_seqs_paged")],
    "02": [("minipaged.block_allocator", "BlockAllocator")],
    "03": [("minipaged.block_table", "BlockTable")],
    "04": [("minipaged.attention.reference", None), ("minipaged.attention.torch_sdpa", None),
           ("minipaged.attention.triton_paged", None), ("minipaged.checks.paged_attention", "variant_attention"),
           # the CPU backend and its C kernels' Python faces: attention too (not watched in 07, whose engine runs them)
           ("minipaged.cpu.attention", None), ("minipaged.cpu.kernels", None)],
    # 08: minipaged's prefix cache and copy-on-write (its ROOT_HASH constant is given; fork_table is the check's)
    "08": [("minipaged.prefix_cache", "PrefixCache"), ("minipaged.prefix_cache", "hash_block"),
           ("minipaged.prefix_cache", "block_hashes"), ("minipaged.prefix_cache", "copy_on_write"),
           ("minipaged.prefix_cache", "blocks_to_write"), ("minipaged.prefix_cache", "num_cow_blocks"),
           ("minipaged.prefix_cache", "cache_computed_blocks")],
    "06": [("minipaged.scheduler", "Scheduler.add_request"), ("minipaged.scheduler", "Scheduler.schedule"),
           ("minipaged.scheduler", "Scheduler._preempt"), ("minipaged.scheduler", "Scheduler._why_never_fits")],
}
WATCH["05"] = WATCH["04"] + [("minipaged.checks.triton_decode", "_no_rescale")]
# Workbook 07 serves with every part at once: nothing of the package's parts may run.
WATCH["07"] = WATCH["02"] + WATCH["03"] + [w for w in WATCH["04"] if not w[0].startswith("minipaged.cpu.")] + WATCH["06"]


def in_package(code: Any) -> bool:
    """True if ``code`` (a code object) was compiled from one of minipaged's own files."""
    filename = getattr(code, "co_filename", "")
    return bool(filename) and os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _codes_of(obj: Any, label: str, out: dict) -> None:
    fn = getattr(obj, "fn", None)  # a @triton.jit kernel keeps its Python function in .fn
    if fn is not None and hasattr(fn, "__code__"):
        obj = fn
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset):
            if f is not None:
                out[f.__code__] = label
        return
    code = getattr(obj, "__code__", None)
    if code is not None and in_package(code):
        out[code] = label


def _class_codes(cls: type, label: str, out: dict, only: str | None = None) -> None:
    for name, member in vars(cls).items():
        if only is not None and name != only:
            continue
        _codes_of(member, f"{label}.{name}", out)


@functools.lru_cache(maxsize=None)
def watched(workbook: str) -> tuple[dict, dict]:
    """(code object -> name, file -> module name) of what workbook ``workbook`` must not call.

    A whole module (attribute None) is watched by its file, so it is never imported here:
    importing triton_paged would define its kernels, before TRITON_INTERPRET may be set.
    """
    import importlib.util

    codes: dict = {}
    files: dict = {}
    for module_name, attr in WATCH[workbook]:
        if attr is None:
            try:
                spec = importlib.util.find_spec(module_name)
            except (ImportError, ValueError):
                continue
            if spec is not None and spec.origin:
                files[os.path.abspath(spec.origin)] = module_name
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:  # pragma: no cover - every module named with an attribute is core
            continue
        owner, _, method = attr.partition(".")
        member = getattr(module, owner, None)
        if member is None:
            continue
        if inspect.isclass(member):
            _class_codes(member, f"minipaged.{owner}", codes, only=method or None)
        else:
            _codes_of(member, f"{module_name}.{owner}", codes)
    return codes, files


def watched_codes(workbook: str) -> dict:
    return watched(workbook)[0]


# -- the static refusal ----------------------------------------------------------------------------
def _is_package_class(klass: type) -> bool:
    return getattr(klass, "__module__", "").split(".")[0] == "minipaged"


def _member_code(member: Any):
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    return getattr(member, "__code__", None)


def refuse_package_class(cls: Any, must_write: Iterable[str], workbook_name: str, role: str) -> None:
    """Refuse ``cls`` when it is (an alias of) a minipaged class, or when one of the members the
    learner must write is minipaged's own: inherited from a minipaged class, or a copy of its code."""
    if not inspect.isclass(cls):
        return
    name = getattr(cls, "__name__", "your class")
    if _is_package_class(cls):
        raise CheckFailed(
            f"{workbook_name}: {name} is minipaged's own {cls.__module__}.{cls.__qualname__} (imported under the name you "
            f"passed), not your {role}. The check compares your code with minipaged's, so it refuses minipaged's own: "
            f"write the class yourself in the cell above (the workbook gives its skeleton), run it, then run this check again."
        )
    for member in must_write:
        for klass in inspect.getmro(cls):
            if member in vars(klass):
                break
        else:
            continue  # missing members are the Protocol check's business
        code = _member_code(vars(klass)[member])
        if _is_package_class(klass) or (code is not None and in_package(code)):
            where = (f"inherited from minipaged's {klass.__qualname__}" if _is_package_class(klass)
                     else f"a copy of minipaged's code ({os.path.basename(code.co_filename)})")
            raise CheckFailed(
                f"{workbook_name}: {name}.{member} is minipaged's own ({where}), not yours. The check refuses "
                f"minipaged's implementation in your place: write {member} in your class, run the cell, then run this check again."
            )


def refuse_package_function(fn: Any, workbook_name: str, what: str) -> None:
    """Refuse ``fn`` when it is minipaged's own function (or a partial or copy of one)."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "fn", target)  # a @triton.jit kernel
    code = getattr(target, "__code__", None)
    if code is None and callable(target):
        code = getattr(getattr(target, "__call__", None), "__code__", None)
    if code is not None and in_package(code):
        qual = getattr(target, "__qualname__", getattr(target, "__name__", "?"))
        mod = getattr(target, "__module__", "minipaged")
        raise CheckFailed(
            f"{workbook_name}: {what} is minipaged's own {mod}.{qual}, not yours. The check compares your code with "
            f"minipaged's, so it refuses minipaged's own: write {what} yourself in the cell above, run it, then run this check again."
        )


# -- the dynamic refusal ---------------------------------------------------------------------------
class Guard:
    """Watches the learner's calls for calls into minipaged's implementations of workbook ``workbook``."""

    def __init__(self, workbook: str, workbook_name: str, max_calls: int | None = None) -> None:
        self.codes, self.files = watched(workbook)
        self._names: dict = {}  # code object -> name, for the watched files
        self.max_calls = max_calls  # watch only the first calls (Triton's interpreter runs 3x slower under the hook)
        self.workbook_name = workbook_name
        self.allowed: list = []  # objects the check handed over (e.g. a reference pool): their methods may run
        self.hit: str | None = None
        self.hit_in: str = ""
        self.hit_why: str = ""  # set for a refused builtin: why it may not be called (not delegation)
        self.refused: tuple = ()  # ((builtin function, name, why), ...): C functions the learner's code may not call
        self._hook_fn = self._hook  # one bound method, so that sys.getprofile() can be compared with it

    def allow(self, obj: Any) -> Any:
        self.allowed.append(obj)
        return obj

    def refuse(self, fn: Any, name: str, why: str) -> None:
        """Fail the check when the learner's code calls the C function ``fn`` (e.g. builtins.hash), saying ``why``."""
        self.refused = self.refused + ((fn, name, why),)

    def _hook(self, frame, event, arg):  # noqa: ARG002
        if event == "c_call" and self.refused and self.hit is None:
            for fn, name, why in self.refused:
                if arg is fn:
                    self.hit, self.hit_why = name, why
                    self.hit_in = f"{frame.f_code.co_name}(), line {frame.f_lineno}"
            return
        if event != "call" or self.hit is not None:
            return
        code = frame.f_code
        label = self.codes.get(code)
        if label is None:
            label = self._names.get(code)
            if label is None:
                module = self.files.get(code.co_filename) or self.files.get(os.path.abspath(code.co_filename))
                if module is None or code.co_name == "<module>":  # importing a module is not calling it
                    return
                label = self._names[code] = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
        if self.allowed:
            me = frame.f_locals.get("self")
            if me is not None and any(me is a for a in self.allowed):
                return
        self.hit = label
        caller = frame.f_back
        mine = caller is not None and not os.path.abspath(caller.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)
        self.hit_in = f"{caller.f_code.co_name}(), line {caller.f_lineno}" if mine else ""

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        if threading.current_thread() is not self._thread or self.max_calls == 0:
            yield  # a call from another thread (e.g. a learner's own worker), or past the watched calls
            return
        if self.max_calls is not None:
            self.max_calls -= 1
        previous = sys.getprofile()
        previous_threads = threading.getprofile() if hasattr(threading, "getprofile") else getattr(threading, "_profile_hook", None)
        sys.setprofile(self._hook_fn)
        threading.setprofile(self._hook_fn)  # threads the learner's code starts are watched too
        try:
            yield
        finally:
            tampered = sys.getprofile() is not self._hook_fn
            sys.setprofile(previous)
            threading.setprofile(previous_threads)
            if tampered:
                self.hit = None
                raise CheckFailed(
                    f"{self.workbook_name}: {what} changed sys.setprofile, which the check uses to see that your code "
                    "does not call minipaged's own implementation. Leave the profiler alone in your part."
                )
            if self.hit is not None and self.hit_why:
                hit, where, why = self.hit, self.hit_in, self.hit_why
                self.hit, self.hit_why = None, ""
                raise CheckFailed(f"{self.workbook_name}: {what} called {hit}" + (f" (from {where})" if where else "")
                                  + f": {why}")
            if self.hit is not None:
                hit, where = self.hit, self.hit_in
                self.hit = None
                raise CheckFailed(
                    f"{self.workbook_name}: {what} called {hit}, minipaged's own implementation"
                    + (f" (from {where})" if where else "")
                    + ". The check refuses minipaged's implementation in your place, whether it is imported, inherited, "
                      "reached through super() or wrapped in a function: write that part yourself, run its cell, then run "
                      "this check again."
                )

    def __enter__(self) -> "Guard":
        self._thread = threading.current_thread()
        from . import _core

        _core._GUARDS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        from . import _core

        if self in _core._GUARDS:
            _core._GUARDS.remove(self)


def guarded(workbook: str, workbook_name: str, max_calls: int | None = None):
    """``with guarded("02", NAME) as g:`` every learner_call inside is watched (the first ``max_calls``)."""
    return Guard(workbook, workbook_name, max_calls)


def run_guarded(workbook: str, workbook_name: str, body: Any, timeout: float, state: dict,
                max_calls: int | None = None) -> Any:
    """Run a check's ``body()`` with every learner call inside watched (:func:`guarded`), within
    ``timeout`` seconds; stopped, it names ``state["current"]``, what the check was doing."""
    def watched_body() -> Any:
        with guarded(workbook, workbook_name, max_calls):
            return body()

    return run_with_time_limit(watched_body, timeout, workbook_name, lambda: state["current"])


__all__ = ["WATCH", "Guard", "guarded", "run_guarded", "in_package", "refuse_package_class", "refuse_package_function", "watched",
           "watched_codes"]
