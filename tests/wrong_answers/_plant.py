"""Shared by the planted wrong answers: each plants one way around the delegation watch
(tests/wrong_answers/NN_*/{unlisted_module,recompiled_reference,prestarted_thread}.py), or one shortcut that passes
small inputs only ({narrowed_ids,bounded_window,id_keyed_memo}.py), into a workbook's solved answer.

- ``with_unlisted_call``: the solved answer, but one method (or the function) first calls a check's own helper
  (minipaged.checks._core.plain), package code no workbook hands the learner;
- ``recompiled``: minipaged's own reference, its module's source compiled again from a file of the learner's;
- ``PreStarted``: a thread of the learner's, started before the check and still running when it calls the answer.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def solved(stem: str) -> dict:
    """The names the solved workbook defines (its code cells run, its checks not)."""
    from minipaged.checks._workbooks import run_workbook_cells

    with contextlib.redirect_stdout(io.StringIO()):
        return run_workbook_cells(ROOT / "solutions" / f"{stem}.ipynb")


def with_unlisted_call(obj, method: str | None = None):
    """``obj`` (a solved function, or a solved class with ``method``) that first calls package code no workbook
    hands over; otherwise it does what the solution does."""
    from minipaged.checks import _core

    if isinstance(obj, type):
        original = getattr(obj, method)

        def wrapped(self, *args, **kwargs):
            _core.plain(0)  # a check's own helper
            return original(self, *args, **kwargs)

        return type(obj.__name__, (obj,), {method: wrapped})

    def fn(*args, **kwargs):
        _core.plain(0)
        return obj(*args, **kwargs)

    fn.__name__ = getattr(obj, "__name__", "fn")
    return fn


def recompiled(module_name: str, attr: str):
    """``module_name``'s source written to a file of the learner's and run from there: its ``attr``, whose code
    is minipaged's, byte for byte, under another file name."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    folder = Path(tempfile.mkdtemp(prefix="my_copy_"))
    path = folder / "my_copy.py"
    path.write_text(source, encoding="utf-8")
    name = f"my_copy_of_{module_name.replace('.', '_')}"
    namespace = {"__name__": name, "__package__": module.__package__, "__file__": str(path)}
    fake = type(sys)(name)
    fake.__dict__.update(namespace)
    sys.modules[name] = fake  # Triton and dataclasses look their function's module up
    exec(compile(source, str(path), "exec"), fake.__dict__)
    return fake.__dict__[attr]


class PreStarted:
    """A thread of the learner's started before the check, looping in the learner's own code (as a worker that
    would run minipaged's reference for the answer, out of the watch's sight), until ``stop()``."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            pass

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="my-worker")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


THREAD_EXPECT = ["a thread your code started earlier is still running", "my-worker", "join it"]
UNLISTED_EXPECT = ["minipaged.checks._core.plain", "does not hand you"]
COPY_EXPECT = ["copy of minipaged's", "compiled again"]


# -- shortcuts that pass small inputs only (issue 40): ids, lengths, identity -------------------------------
def _rebind(fn, change):
    """``fn`` whose arguments pass through ``change(bound arguments)`` first."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        change(bound.arguments)
        return fn(*bound.args, **bound.kwargs)

    return wrapped


def narrowed(fn, param: str):
    """``fn`` that first stores the token ids of ``param`` in 16 bits (a uint16 array, "to save memory"):
    70,000 becomes 4,464."""
    from array import array

    def change(a):
        if isinstance(a[param], (list, tuple)):
            a[param] = type(a[param])(array("H", [int(t) & 0xFFFF for t in a[param]]))

    return _rebind(fn, change)


def windowed(fn, param: str, window: int = 1024):
    """``fn`` that looks only at the last ``window`` token ids of ``param``, or caps a length ``param`` at
    ``window`` ("no prompt is longer than that"): SmolLM2-135M serves 8,192."""
    def change(a):
        if isinstance(a[param], (list, tuple)):
            a[param] = a[param][-window:]
        elif isinstance(a[param], int):
            a[param] = min(a[param], window)

    return _rebind(fn, change)


def memo_by_id(fn):
    """``fn`` with a memo keyed by its arguments' id() (numbers by value): an object changed in place, or a
    new one that took a freed one's id, gets the answer of what was there before."""
    memo: dict = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        key = tuple(x if isinstance(x, (int, float, str, bool, type(None))) else id(x)
                    for x in list(args) + sorted(kwargs.items()))
        if key not in memo:
            memo[key] = fn(*args, **kwargs)
        return memo[key]

    return wrapped


def subclass_with(cls: type, method: str, plant, *args):
    """``cls`` with ``method`` replaced by ``plant(method, *args)``: a learner's class with that shortcut."""
    return type(cls.__name__, (cls,), {method: plant(getattr(cls, method), *args)})
