"""What every check shares: the failure types, the time limit, and calling a learner's code.

Owns how a learner's exception, stub or endless loop becomes a message they can act on.
The per-workbook modules (block_allocator.py, ...) own what is compared and the hints.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

DEFAULT_TIMEOUT_S = 60.0


class CheckFailed(AssertionError):
    """Your code disagreed with the reference. The message says what was done, what was
    expected, what came, and where to look. nbval marks the cell that raised it."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through the checker's own frames, which
        # tell a learner nothing; a crash in the learner's code keeps its own frames.
        lines = []
        cause = self.__cause__
        if cause is not None and not isinstance(cause, CheckFailed):
            frames = _learner_frames(cause.__traceback__)
            if frames:
                lines.append("Traceback of your code (most recent call last):")
                lines += [ln.rstrip("\n") for ln in traceback.format_list(frames)]
                lines.append(f"{type(cause).__name__}: {cause}")
                lines.append("")
        red, reset = "\x1b[0;31m", "\x1b[0m"
        lines.append(f"{red}{type(self).__name__}{reset}: {self}")
        return lines


class NotImplementedYet(CheckFailed):
    """A stub still raises NotImplementedError: the message names the function."""


class CheckTimeout(CheckFailed):
    """Your code ran past the check's time limit (an endless loop, most likely)."""


class _Deadline(BaseException):
    # A BaseException so that a learner's `except Exception:` cannot swallow the time limit.
    pass


# -- time limit -------------------------------------------------------------------------------
@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def on_alarm(signum, frame):  # noqa: ARG001
        raise _Deadline()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_with_time_limit(fn: Callable[[], Any], seconds: float, name: str, where: Callable[[], str]) -> Any:
    """Run ``fn()``; after ``seconds`` stop it and raise CheckTimeout naming ``where()``.

    On Unix's main thread (Jupyter, Colab, pytest) a SIGALRM interrupts the learner's loop
    itself. Elsewhere (Windows, a worker thread) the check runs in a daemon thread that we
    stop waiting for; its loop keeps running until the kernel restarts, and the message says so.
    """
    started = time.monotonic()

    def timeout_error(stopped: bool, tb=None) -> CheckTimeout:
        at = ""
        frames = _learner_frames(tb) if tb is not None else []
        if frames:
            f = frames[-1]
            at = f"\nIt was stopped in {f.name}(), line {f.lineno}" + (f": `{f.line.strip()}`" if f.line else "")
        tail = "" if stopped else (
            "\nYour loop may still be running in the background: restart the kernel (Kernel > Restart) before running again."
        )
        return CheckTimeout(
            f"{name}: stopped after {seconds:.0f} s (the check's time limit); the reference needs well under a second.\n"
            f"It was running: {where()}{at}\n"
            "Hint: look for a loop that never ends: a `while` whose condition never changes, or a loop "
            "that never moves its index or pointer forward." + tail
        )

    use_alarm = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and os.environ.get("MINIPAGED_CHECK_NO_ALARM") != "1"
    )
    if use_alarm and signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return fn()  # an outer time limit (another check's, pytest-timeout's) is running and covers this one
    if use_alarm:
        try:
            with _alarm(seconds):
                return fn()
        except _Deadline as e:
            raise timeout_error(stopped=True, tb=e.__traceback__) from None

    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name=f"minipaged-check-{name}")
    worker.start()
    worker.join(max(0.0, seconds - (time.monotonic() - started)))
    if worker.is_alive():
        raise timeout_error(stopped=False)
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- calling a learner's code -----------------------------------------------------------------
_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))


def _learner_frames(tb) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(tb)
    return [f for f in frames if not os.path.abspath(f.filename).startswith(_CHECKS_DIR)]


def _qualname(tb) -> str:
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return "?"
    code = last.tb_frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def not_implemented(function: str, where: str = "") -> NotImplementedYet:
    place = f" (in {where})" if where else ""
    return NotImplementedYet(
        f"not implemented yet: {function}{place}. It still raises NotImplementedError.\n"
        "Replace `# YOUR CODE HERE` and `raise NotImplementedError()` in its cell with your code, "
        "run that cell (Shift+Enter), then run this check again."
    )


def describe_exception(e: BaseException) -> str:
    """'TypeError: ... (at cell line N: `code`)' with the last frame that is not the checker's."""
    frames = _learner_frames(e.__traceback__)
    loc = ""
    if frames:
        f = frames[-1]
        code = f" `{f.line.strip()}`" if f.line else ""
        loc = f"\n    raised in {f.name}(), line {f.lineno}:{code}"
    msg = str(e).strip() or "(no message)"
    return f"{type(e).__name__}: {msg}{loc}"


def _wrapped_not_implemented(e: BaseException) -> BaseException | None:
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, NotImplementedError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


# The delegation guards (see _delegation.py) of the checks now running, innermost last.
_GUARDS: list = []


@contextmanager
def watching(what: str) -> Iterator[None]:
    """Around a call of the learner's code: the running check's delegation guard watches it."""
    if not _GUARDS:
        yield
        return
    with _GUARDS[-1].watching(what):
        yield


def learner_call(fn: Callable, *args, what: str, context: Callable[[], str] = lambda: "", **kwargs):
    """Call the learner's ``fn``; a stub becomes NotImplementedYet, any other crash CheckFailed.

    ``what`` is the call as the learner would type it (``a.allocate()``); ``context`` gives the
    story so far for the message. While a check's delegation guard is on, a call into
    minipaged's own implementation from ``fn`` fails the check (see _delegation.py).
    """
    try:
        with watching(what):
            got = fn(*args, **kwargs)
        return plain(got, what)
    except CheckFailed:
        raise
    except NotImplementedError as e:
        raise not_implemented(_qualname(e.__traceback__)) from None
    except _Deadline:
        raise
    except Exception as e:
        inner = _wrapped_not_implemented(e)
        if inner is not None:  # e.g. Triton's interpreter wraps the kernel's exception in its own
            raise not_implemented(_qualname(inner.__traceback__)) from None
        ctx = context()
        raise CheckFailed(
            f"{what} crashed with {describe_exception(e)}\n"
            + (f"\n{ctx}\n" if ctx else "")
            + "\nThe reference does not raise here. Read the error above, fix that line, re-run its cell and this check."
        ) from e


def plain(value: Any, what: str = "your code", depth: int = 0) -> Any:
    """``value`` as the checks compare it: numbers, text and containers of exact built-in types, tensors
    copied into plain ``torch.Tensor``s. A subclass's ``==``, ``__torch_function__`` or ``__iter__`` is
    never what decides a check: an ``int`` subclass becomes the ``int`` it holds, a tensor subclass its data.
    Other objects (a learner's class) are returned as they are; their methods are called through learner_call."""
    t = type(value)
    if t in (int, float, str, bytes, bool, type(None)) or depth > 8:
        return value
    if isinstance(value, bool):
        return bool(int.__index__(value))
    if isinstance(value, int):
        return int.__index__(value)  # the value itself, whatever __eq__ or __int__ the subclass defines
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return bytes(memoryview(value))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _plain_tensor(torch, value, what)
    if t is list or (isinstance(value, list) and _overrides(t, list)):
        return [plain(x, what, depth + 1) for x in list.__iter__(value)]
    if t is tuple or (isinstance(value, tuple) and _overrides(t, tuple)):
        return tuple(plain(x, what, depth + 1) for x in tuple.__iter__(value))
    if t is dict or (isinstance(value, dict) and _overrides(t, dict)):
        return {plain(k, what, depth + 1): plain(v, what, depth + 1) for k, v in dict.items(value)}
    if t is set or t is frozenset or (isinstance(value, (set, frozenset)) and _overrides(t, set, frozenset)):
        base = frozenset if isinstance(value, frozenset) else set
        return base(plain(x, what, depth + 1) for x in base.__iter__(value))
    return value  # a learner's object, or a subclass that compares as its base does


_COMPARE = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__iter__", "__len__",
            "__getitem__", "__contains__", "__bool__", "__index__", "__int__", "__float__", "__str__", "__iter__",
            "keys", "values", "items", "get", "copy", "count", "index")


def _overrides(t: type, *bases: type) -> bool:
    """True when the subclass ``t`` defines a comparison, iteration or conversion of its own."""
    return any(getattr(t, name, None) is not getattr(bases[0], name, None) for name in _COMPARE)


def _plain_tensor(torch, value, what: str):
    keys = torch._C._dispatch_keys(value)
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter) and (
            keys.has(torch._C.DispatchKey.Python) or type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__):
        raise CheckFailed(f"{what} returned a {type(value).__name__}, a subclass of torch.Tensor that overrides how "
                          "torch runs on it. Return a plain torch.Tensor (the reference does).")
    with torch._C.DisableTorchFunction():  # a subclass's __torch_function__ never runs here
        return value.detach().clone()


def passed(line: str) -> None:
    print(f"\u2714 {line}")


def skipped(line: str) -> None:
    print(f"SKIPPED: {line}")


def plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def fmt_list(xs, limit: int = 24) -> str:
    xs = list(xs)
    if len(xs) <= limit:
        return "[" + ", ".join(str(x) for x in xs) + "]"
    return "[" + ", ".join(str(x) for x in xs[:limit]) + f", ... ({len(xs)} in all)]"


def table(rows: list[list[str]], indent: str = "    ") -> str:
    """Rows of cells as aligned text; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(max(len(r) for r in rows))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(widths[i + 1]) for i, c in enumerate(r[1:])]
        out.append(indent + "  ".join(cells).rstrip())
    return "\n".join(out)


class Log:
    """The operations done so far, written as code a learner can paste into a cell to replay."""

    def __init__(self, header: list[str] | None = None, keep: int = 30) -> None:
        self.header = list(header or [])
        self.lines: list[str] = []
        self.keep = keep

    def add(self, line: str) -> None:
        self.lines.append(line)

    def render(self, title: str = "What was done (paste into a cell to replay it):") -> str:
        lines = self.lines
        body = list(self.header)
        if len(lines) > self.keep:
            body.append(f"# ... {len(lines) - self.keep} earlier operations left out ...")
            shown = lines[-self.keep:]
        else:
            shown = lines
        body += shown
        return title + "\n" + "\n".join("    " + ln for ln in body)

    def full(self) -> str:
        return "\n".join(self.header + self.lines)


def failure(title: str, *, done: str = "", expected: str = "", got: str = "", picture: str = "", hint: str = "") -> CheckFailed:
    parts = [title]
    if done:
        parts.append(done)
    pair = []
    if expected:
        pair.append("Expected: " + expected)
    if got:
        pair.append("Got:      " + got)
    if pair:
        parts.append("\n".join(pair))
    if picture:
        parts.append(picture)
    if hint:
        parts.append("Hint: " + hint)
    return CheckFailed("\n\n".join(p.rstrip() for p in parts if p))

class Story:
    """One story a check plays on the reference and on the learner's part side by side: ``label``
    (which story), ``log`` (the operations so far, as code to replay), ``stats`` (the check's shared
    progress) and the check's ``check_name`` are set by the subclass."""

    check_name = ""
    label: str
    log: Log
    stats: dict

    def story(self) -> str:
        return f"Run: {self.label}.\n" + self.log.render()

    def call(self, fn, *args, what: str):
        self.stats["current"] = f"{what}  ({self.label})"
        return learner_call(fn, *args, what=what, context=self.story)

    def fail(self, title: str, **kw) -> CheckFailed:
        return failure(f"{self.check_name}: {title}", done=self.story(), **kw)



def is_stub(fn: Any) -> bool:
    """True if ``fn``'s source still holds the generated `raise NotImplementedError()` line."""
    import inspect

    target = getattr(fn, "fn", fn)  # a @triton.jit kernel keeps the Python function in .fn
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        return False
    return "raise NotImplementedError" in src


# -- situations: what a check's cases build ------------------------------------------------------
# A rule of a workbook names situations (a block boundary, a forked table, a named exception, ids
# past 16 bits, ...). Each check says, as it builds a case, which situations that case puts the
# learner's code in; tests/rules_table.py lists each rule's situations, and tests/test_rules.py runs
# every check on the solution while recording, so a situation no case builds fails there.
SITUATIONS = {
    "block boundary": "a length exactly at a multiple of the block size",
    "just below a boundary": "a length one short of a multiple of the block size",
    "just above a boundary": "a length one past a multiple of the block size",
    "max_model_len": "a sequence at a context limit, past any window a learner might cap at (2,048 or more; SmolLM2-135M serves 8,192)",
    "empty": "nothing: zero tokens, an empty list, no blocks",
    "forked table": "a table whose state was set from outside its own methods (parts.fork_table) before its next call",
    "shared block": "a block held by more than one owner (ref count above 1)",
    "full pool": "a pool with no free block left",
    "misuse": "a call the rules forbid (a double free, a block out of range, a count outside the table)",
    "out-of-order blocks": "a table whose physical blocks are not in logical order",
    "ids past 16 bits": "token ids above 65,535 beside the ids they alias in 16 bits (up to 151,000: Qwen's vocabulary)",
    "reused object": "an object freed or changed in place and handed in again, so id() or identity meets new contents",
    "evicted middle block": "a cached prefix whose middle block was evicted",
    "different part class": "an injected part whose class differs from the reference's",
    "preemption": "a step that preempts a running sequence",
    "random stories": "random sequences of calls against the reference, side by side",
    "numerical edge": "values at the edge of a format: all-zero, beyond the range, ties in rounding",
    "exception type": "a rule's named exception type, checked exactly (a parent class does not do)",
    "learner's parts": "the learner's parts of earlier workbooks run together, with the reference where absent",
    "measured": "a figure measured on this machine beside the prediction",
    "each dtype": "every element size the rule covers (4, 2 and 1 bytes)",
    "distinct factors": "a shape whose factors all differ, so each missing factor shows alone",
    "budget remainder": "a budget that is not a whole multiple of what one unit takes",
    "package code in place": "minipaged's own implementation in the learner's place (under another name, subclassed, "
                             "or called from inside theirs), refused while the check watches every call",
}
_RECORDERS: list[set] = []


def length_situations(lengths: int | Any, block_size: int, max_model_len: int | None = None) -> list[str]:
    """The SITUATIONS lengths (one, or several: a batch's) put a learner's code in, against blocks of
    ``block_size`` tokens and the model's ``max_model_len`` (with blocks of 1 every length is a boundary)."""
    out: list[str] = []
    for n in ([lengths] if isinstance(lengths, int) else list(lengths)):
        found = []
        if n <= 0:
            found.append("empty")
        elif n % block_size == 0:
            found.append("block boundary")
        if n > 0 and block_size > 1 and n % block_size == block_size - 1:
            found.append("just below a boundary")
        if block_size > 1 and n > block_size and n % block_size == 1:
            found.append("just above a boundary")
        if max_model_len is not None and n >= max_model_len:
            found.append("max_model_len")
        out += [s for s in found if s not in out]
    return out


def builds(*situations: str) -> None:
    """Say that the case being built puts the learner's code in ``situations`` (names of SITUATIONS).
    Costs nothing unless a test is recording."""
    unknown = [s for s in situations if s not in SITUATIONS]
    if unknown:
        raise KeyError(f"unknown situation(s) {unknown}: add them to minipaged.checks._core.SITUATIONS")
    for rec in _RECORDERS:
        rec.update(situations)


@contextmanager
def recording_situations() -> Iterator[set]:
    """Collect the situations the checks run inside the block build (for tests/test_rules.py)."""
    got: set = set()
    _RECORDERS.append(got)
    try:
        yield got
    finally:
        _RECORDERS.remove(got)
