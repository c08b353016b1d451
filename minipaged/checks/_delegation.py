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

from ._core import CheckFailed, is_stub, not_implemented, run_with_time_limit

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
           ("minipaged.cpu.attention", None), ("minipaged.cpu.kernels", None),
           # its int8 part: minipaged's int8 page code (quantize, dequantize, the block's scales, copy_blocks) and the
           # checks' own int8 pages and variants
           ("minipaged.kv_quant", None), ("minipaged.checks.kv_int8", "ref_pages"),
           ("minipaged.checks.kv_int8", "variant_quantize"), ("minipaged.checks.kv_int8", "variant_ignores_scales")],
    # 08: minipaged's prefix cache, copy-on-write, fork and beam drop (its ROOT_HASH constant is given)
    "08": [("minipaged.prefix_cache", "PrefixCache"), ("minipaged.prefix_cache", "hash_block"),
           ("minipaged.parts", "fork_table"), ("minipaged.parts", "free_table"),
           ("minipaged.prefix_cache", "block_hashes"), ("minipaged.prefix_cache", "copy_on_write"),
           ("minipaged.prefix_cache", "blocks_to_write"), ("minipaged.prefix_cache", "num_cow_blocks"),
           ("minipaged.prefix_cache", "cache_computed_blocks")],
    # 12: minipaged's host tier (its store, its connector, which blocks a step filled)
    "12": [("minipaged.kv_connector", "HostKVStore"), ("minipaged.kv_connector", "HostOffloadConnector"),
           ("minipaged.kv_connector", "newly_full_blocks")],
    "06": [("minipaged.scheduler", "Scheduler.add_request"), ("minipaged.scheduler", "Scheduler.schedule"),
           ("minipaged.scheduler", "Scheduler._preempt"), ("minipaged.scheduler", "Scheduler._why_never_fits")],
}
_ATTENTION = [w for w in WATCH["04"] if not w[0].startswith(("minipaged.kv_quant", "minipaged.checks.kv_int8"))]
WATCH["05"] = _ATTENTION + [("minipaged.checks.triton_decode", "_no_rescale")]
# Workbook 07 serves with every part at once: nothing of the package's parts may run (its engine's KV write
# reads kv_quant's formats, so 04's int8 part is not watched there).
WATCH["07"] = WATCH["02"] + WATCH["03"] + [w for w in _ATTENTION if not w[0].startswith("minipaged.cpu.")] + WATCH["06"]

# What each workbook hands the learner: the only package code the learner's code may call while a check
# calls it (same form as WATCH: (module, attribute or None for the whole module); "Class.method" names one
# method). Every other call from the learner's code into minipaged is refused: the reference parts, the
# checks and their helpers, parts.py's helpers not given, the bench. Package code called by package code
# (an allowed function's own helpers, the engine serving in 07) is not a call of the learner's. A workbook
# the watch knows (WATCH) must have its list here; tests/test_delegation_allow.py holds them to that.
ALLOW: dict[str, list[tuple[str, str | None]]] = {
    "01": [("minipaged.checks.kv_cache_math", "ModelShape")],  # the shapes the workbook imports (a dataclass)
    "02": [("minipaged.block_allocator", "BlockAllocatorError"), ("minipaged.block_allocator", "OutOfBlocksError")],
    # 03: the pool the check hands over (minipaged's allocator, recorded) and parts.allocate_many
    "03": [("minipaged.block_allocator", None), ("minipaged.parts", "allocate_many"),
           ("minipaged.checks.block_table", "_RecordingPool")],
    # 04: the check's NaN watch (its int8 quantize check runs the learner's code under a torch function mode)
    "04": [("minipaged.checks.kv_int8", "_NaNWatch.__torch_function__")],
    "05": [("minipaged.checks.triton_decode", "setup_triton")],
    # 06: the blocks (minipaged's allocator and table), the sequences and the config the scheduler is given
    "06": [("minipaged.scheduler", "ScheduledSeq"), ("minipaged.scheduler", "SchedulerOutput"),
           ("minipaged.scheduler", "Scheduler.__init__"), ("minipaged.block_allocator", None),
           ("minipaged.block_table", None), ("minipaged.data", None), ("minipaged.sequence", None),
           ("minipaged.sampling", None), ("minipaged.config", "EngineConfig")],
    "07": [],  # below: what 02-06 hand over (their parts run in 07's engine); WATCH["07"] still refuses the parts
    "08": [("minipaged.block_allocator", None), ("minipaged.block_table", None)],
    # 12: the block shape, the store's size in blocks, the hash chain (workbook 08's) and the two copies
    "12": [("minipaged.kv_connector", "KVLayout"), ("minipaged.kv_connector", "host_capacity_blocks"),
           ("minipaged.kv_connector", "full_block_hashes"), ("minipaged.kv_connector", "gather_blocks"),
           ("minipaged.kv_connector", "scatter_blocks"),
           # the requests and steps the connector check hands over (minipaged.data's Sequence and ScheduledSeq fields)
           ("minipaged.checks.kv_connector", "_Seq"), ("minipaged.checks.kv_connector", "_Sch")],
    # 09: the pool its rollback check hands over (minipaged's allocator, recorded), BlockTable to subclass
    "09": [("minipaged.block_allocator", None), ("minipaged.block_table", None),
           ("minipaged.checks.block_table", "_RecordingPool")],
}
ALLOW["07"] = [a for w in ("02", "03", "04", "05", "06") for a in ALLOW[w]]
# Package code any learner call may reach without calling it: the harness's own audit hooks and import finder,
# the checks' time limit (a signal handler runs on top of the learner's frame).
# the checks' own watch resumed as its `with` block ends.
ALWAYS_ALLOWED: list[tuple[str, str | None]] = [("minipaged.checks.harness", None), ("minipaged.checks._core", "_alarm"),
                                                ("minipaged.checks._core", "watching"),
                                                ("minipaged.checks._delegation", "Guard.watching")]


def in_package(code: Any) -> bool:
    """True if ``code`` (a code object) was compiled from one of minipaged's own files."""
    filename = getattr(code, "co_filename", "")
    return bool(filename) and os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _codes_of(obj: Any, label: str, out: dict) -> None:
    if callable(obj) and hasattr(obj, "__wrapped__"):  # @contextmanager, functools.wraps: the function itself
        try:
            obj = inspect.unwrap(obj)
        except ValueError:
            pass
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


def _entries(pairs: Iterable[tuple[str, str | None]]) -> Iterator[tuple[str, str | None, str, str, Any]]:
    """WATCH's and ALLOW's (module, attribute) pairs resolved: (module, its file, None, None, None) for a whole
    module, found by its spec and never imported (importing triton_paged would define its kernels before
    TRITON_INTERPRET may be set); (module, None, owner, method, the owner or None) for "Owner" or "Owner.method".
    A module that cannot be found or imported is skipped."""
    import importlib.util

    for module_name, attr in pairs:
        if attr is None:
            try:
                spec = importlib.util.find_spec(module_name)
            except (ImportError, ValueError):
                continue
            if spec is not None and spec.origin:
                yield module_name, os.path.abspath(spec.origin), None, None, None
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:  # pragma: no cover - every module named with an attribute is core
            continue
        owner, _, method = attr.partition(".")
        yield module_name, None, owner, method, getattr(module, owner, None)


@functools.lru_cache(maxsize=None)
def watched(workbook: str) -> tuple[dict, dict]:
    """(code object -> name, file -> module name) of what workbook ``workbook`` must not call.

    A whole module (attribute None) is watched by its file, so it is never imported here:
    importing triton_paged would define its kernels, before TRITON_INTERPRET may be set.
    """
    codes: dict = {}
    files: dict = {}
    for module_name, path, owner, method, member in _entries(WATCH[workbook]):
        if path is not None:
            files[path] = module_name
            continue
        if member is None:
            continue
        if inspect.isclass(member):
            _class_codes(member, f"minipaged.{owner}", codes, only=method or None)
        else:
            _codes_of(member, f"{module_name}.{owner}", codes)
    return codes, files


def watched_codes(workbook: str) -> dict:
    return watched(workbook)[0]


def _nested(code: Any, out: set) -> None:
    """``code`` and every code object compiled inside it (its lambdas, comprehensions, nested functions)."""
    todo = [code]
    while todo:
        c = todo.pop()
        if c not in out:
            out.add(c)
            todo += [k for k in c.co_consts if isinstance(k, type(c))]


@functools.lru_cache(maxsize=None)
def allowed(workbook: str) -> tuple[frozenset, frozenset] | None:
    """(code objects, files) of the package code workbook ``workbook`` hands the learner (ALLOW, with
    ALWAYS_ALLOWED), or None when the workbook has no list (then only WATCH is refused)."""
    if workbook not in ALLOW:
        return None
    codes: set = set()
    files: set = set()
    for _, path, owner, method, member in _entries(ALWAYS_ALLOWED + ALLOW[workbook]):
        if path is not None:
            files.add(path)
            continue
        found: dict = {}
        if inspect.isclass(member):
            for klass in inspect.getmro(member):  # what it inherits from the package too
                if _is_package_class(klass):
                    _class_codes(klass, owner, found, only=method or None)
            for f in getattr(member, "__dataclass_fields__", {}).values() if not method else ():
                _codes_of(f.default_factory, owner, found)  # a field's default_factory (a lambda in the class body)
        elif member is not None:
            _codes_of(inspect.unwrap(member) if callable(member) else member, owner, found)
        for code in found:
            _nested(code, codes)
    return frozenset(codes), frozenset(files)


# -- the package's code by what it is, not where it lies ----------------------------------------------------
# bytes of bytecode: shorter code (a getter, an __init__ that stores its arguments) is written alike by anyone, and
# so are comprehensions and lambdas: only a function or method this long is matched
_MIN_FINGERPRINTED = 100


def fingerprint(code: Any) -> tuple:
    """What a code object is, without where it came from: its bytecode, its names and variable names, its
    constants (nested code by their own fingerprint; the docstring left out). Compiling minipaged's source under
    another file name, or at other lines, gives the same fingerprint."""
    consts = []
    for i, k in enumerate(code.co_consts):
        if isinstance(k, type(code)):
            consts.append(("<code>",) + fingerprint(k))
        elif i == 0 and isinstance(k, str):
            consts.append("<doc>")
        else:
            consts.append((type(k).__name__, repr(k)))
    return (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
            code.co_kwonlyargcount, tuple(consts))


def _fingerprints_so_far():
    """package_fingerprints, with its cache held in a closure: not module data, which the harness's snapshot
    compares before and after each check (a cache that grows there would read as tampering)."""
    found: dict = {}  # fingerprint -> 'module.qualname'
    done: set = set()  # the modules done

    def package_fingerprints() -> dict:
        """fingerprint -> 'module.qualname' of every function of the package imported so far (the checks import the
        reference of what they check), but for code too short to be anyone's in particular. Grows as modules load."""
        for name, module in list(sys.modules.items()):
            if name in done or not (name == "minipaged" or name.startswith("minipaged.")):
                continue
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                continue  # still being imported (the watch sees code run during an import): its functions later
            done.add(name)
            members: dict = {}
            for attr, member in list(vars(module).items()):
                if getattr(member, "__module__", None) != name:
                    continue  # imported from elsewhere: done with its own module
                if inspect.isclass(member):
                    _class_codes(member, attr, members)
                else:
                    _codes_of(member, attr, members)
            codes: set = set()
            for code in members:
                _nested(code, codes)
            for code in codes:
                if len(code.co_code) >= _MIN_FINGERPRINTED and not code.co_name.startswith("<"):
                    try:
                        found.setdefault(fingerprint(code), f"{name}.{getattr(code, 'co_qualname', code.co_name)}")
                    except TypeError:  # an unhashable constant
                        continue
        return found

    return package_fingerprints


package_fingerprints = _fingerprints_so_far()


def package_copy(code: Any) -> str:
    """'module.qualname' when ``code`` (not the package's own file) is a copy of a package function, else ''."""
    if code is None or in_package(code) or len(getattr(code, "co_code", b"")) < _MIN_FINGERPRINTED \
            or code.co_name.startswith("<"):
        return ""
    try:
        return package_fingerprints().get(fingerprint(code), "")
    except Exception:  # noqa: BLE001 - an unhashable constant: never a copy of ours
        return ""


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
        copy_of = package_copy(code)
        if _is_package_class(klass) or (code is not None and in_package(code)) or copy_of:
            where = (f"inherited from minipaged's {klass.__qualname__}" if _is_package_class(klass)
                     else f"a copy of minipaged's {copy_of}, compiled again under {code.co_filename}" if copy_of
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
    copy_of = package_copy(code)
    if copy_of:
        raise CheckFailed(
            f"{workbook_name}: {what} is a copy of minipaged's own {copy_of} (the same bytecode, names and constants, "
            f"compiled again under {code.co_filename}), not yours. The check refuses minipaged's implementation in your "
            f"place: write {what} yourself in the cell above, run it, then run this check again."
        )
    if code is not None and in_package(code):
        qual = getattr(target, "__qualname__", getattr(target, "__name__", "?"))
        mod = getattr(target, "__module__", "minipaged")
        raise CheckFailed(
            f"{workbook_name}: {what} is minipaged's own {mod}.{qual}, not yours. The check compares your code with "
            f"minipaged's, so it refuses minipaged's own: write {what} yourself in the cell above, run it, then run this check again."
        )


def refuse_reference(fn: Any, ref: Any, workbook_name: str, what: str) -> None:
    """Refuse ``fn`` when it is minipaged's ``ref`` itself (or wraps it); ``what`` names it, with its
    module: ``"copy_on_write (minipaged.prefix_cache)"``."""
    if getattr(fn, "__wrapped__", fn) is ref:
        raise CheckFailed(f"{workbook_name}: this is minipaged's own {what}. Write yours in the cell above, run it, then "
                          "run this check again.")


def refuse_reference_function(fn: Any, ref: Any, workbook_name: str, name: str, module: str) -> None:
    """What a check of the learner's function ``name`` refuses before it runs: a stub (it still raises
    NotImplementedError), minipaged's ``ref`` (from ``module``) itself, or any other function of minipaged's."""
    if is_stub(fn):
        raise not_implemented(getattr(fn, "__name__", name))
    refuse_reference(fn, ref, workbook_name, f"{name} ({module})")
    refuse_package_function(fn, workbook_name, name)


# -- the dynamic refusal ---------------------------------------------------------------------------
_BASELINE_THREADS = frozenset(threading._active)  # alive when the checks were imported (the kernel's, the harness's)
_LIBRARY_ROOTS = tuple({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
# code made by the interpreter or a library rather than written in a file: <frozen importlib._bootstrap>, <string>
# (a dataclass's or namedtuple's generated methods), torch.fx's and dynamo's generated forwards
_GENERATED = ("<frozen", "<string>", "<eval_with_key", "<torch", "<dynamo", "<__array_function__")


def _pool_submit_codes() -> frozenset:
    """The methods that hand work to a pool's threads (which run whatever they are handed)."""
    import concurrent.futures.thread as cft
    import multiprocessing.pool as mpp

    out = {cft.ThreadPoolExecutor.submit.__code__}
    for name in ("apply_async", "map_async", "imap", "imap_unordered", "starmap_async", "_map_async"):
        fn = getattr(mpp.Pool, name, None)
        if fn is not None and hasattr(fn, "__code__"):
            out.add(fn.__code__)
    return frozenset(out)


_POOL_SUBMIT = _pool_submit_codes()


def _kind_of_file(filename: str) -> str:
    """'package', 'library' (the interpreter's, site-packages, frozen, generated) or 'learner' (a notebook cell)."""
    if filename.startswith(_GENERATED):
        return "library"
    if filename.startswith("<"):
        return "learner"  # a notebook's cell, as the harness and run_workbook_cells name them
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_DIR + os.sep):
        return "package"
    if path.startswith(_LIBRARY_ROOTS):
        return "library"
    return "learner"


def _first_caller(frame):
    """The first frame below ``frame`` that is not a library's (torch's decorators, a dataclass's __init__,
    Executor.map): whose code made the call."""
    caller = frame.f_back
    while caller is not None and _kind_of_file(caller.f_code.co_filename) == "library":
        caller = caller.f_back
    return caller


class Guard:
    """Watches the learner's calls while a check calls them. Refused: a call into minipaged's implementations of
    workbook ``workbook`` (WATCH) anywhere; a call from the learner's code into any package code the workbook does
    not hand over (ALLOW); code that is a copy of the package's (:func:`fingerprint`); a thread of the learner's
    still running when the check calls the learner (the watch cannot see into a thread started before it)."""

    def __init__(self, workbook: str, workbook_name: str, max_calls: int | None = None) -> None:
        self.codes, self.files = watched(workbook)
        self.workbook = workbook
        allow = allowed(workbook)
        self.allow_codes, self.allow_files = allow if allow is not None else (frozenset(), frozenset())
        self.strict = allow is not None  # the allow rule is on for the workbooks that have a list
        self._names: dict = {}  # code object -> name, for the watched files
        self._verdict: dict = {}  # code object -> "" (may run), "package" or "copy:<name>"
        self.max_calls = max_calls  # watch only the first calls (Triton's interpreter runs 3x slower under the hook)
        self.workbook_name = workbook_name
        self.allowed: list = []  # objects the check handed over (e.g. a reference pool): their methods may run
        self.hit: str | None = None
        self.hit_in: str = ""
        self.hit_why: str = ""  # set for a refused builtin: why it may not be called (not delegation)
        self.hit_kind: str = ""  # "watched", "unlisted", "copy"
        self.refused: tuple = ()  # ((builtin function, name, why), ...): C functions the learner's code may not call
        self._hook_fn = self._hook  # one bound method, so that sys.getprofile() can be compared with it
        self._thread_hook_fn = self._thread_hook
        self._watched_threads: set = set()  # threads started while watched: the hook sees their calls
        self._alive_before: frozenset = frozenset()  # the threads alive when the current watched call began

    def allow(self, obj: Any) -> Any:
        self.allowed.append(obj)
        return obj

    def refuse(self, fn: Any, name: str, why: str) -> None:
        """Fail the check when the learner's code calls the C function ``fn`` (e.g. builtins.hash), saying ``why``."""
        self.refused = self.refused + ((fn, name, why),)

    def _verdict_of(self, code) -> str:
        v = self._verdict.get(code)
        if v is None:
            if in_package(code):
                ok = (code in self.allow_codes or code.co_name == "<module>"
                      or os.path.abspath(code.co_filename) in self.allow_files)
                v = "" if ok else "package"
            else:
                copy_of = package_copy(code)
                v = f"copy:{copy_of}" if copy_of else ""
            self._verdict[code] = v
        return v

    def _thread_hook(self, frame, event, arg):
        """The profile of a thread started while watched: it is known from then on, and watched."""
        self._watched_threads.add(threading.get_ident())
        sys.setprofile(self._hook_fn)
        return self._hook_fn(frame, event, arg)

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
        if code in _POOL_SUBMIT and self.strict:  # work handed to a pool started before the watch: it cannot see there
            caller = _first_caller(frame)
            if caller is not None and _kind_of_file(caller.f_code.co_filename) == "learner":
                pool = self._pool_of_unwatched_threads(frame)
                if pool:
                    self.hit, self.hit_kind = pool, "thread"
                    self.hit_in = f"{caller.f_code.co_name}(), line {caller.f_lineno}"
            return
        label = self.codes.get(code)
        if label is None:
            label = self._names.get(code)
            if label is None:
                module = self.files.get(code.co_filename) or self.files.get(os.path.abspath(code.co_filename))
                if module is not None and code.co_name != "<module>":  # importing a module is not calling it
                    label = self._names[code] = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
        kind = "watched"
        if label is not None and not in_package(code) and label.startswith("minipaged"):
            kind = "copy"  # code objects compare equal whatever their file: minipaged's own, compiled again
            # (a library watched by its files, workbook 11's xgrammar, runs that library's own code)
        if label is None:
            verdict = self._verdict_of(code)
            if not verdict:
                return
            if verdict == "package":
                if not self.strict:
                    return
                caller = _first_caller(frame)
                if caller is not None and in_package(caller.f_code):
                    return  # the package calling itself (an allowed function's helpers, the engine serving in 07)
                kind = "unlisted"
                label = (f"{os.path.relpath(code.co_filename, os.path.dirname(_PACKAGE_DIR))[:-3].replace(os.sep, '.')}"
                         f".{getattr(code, 'co_qualname', code.co_name)}")
            else:
                kind, label = "copy", verdict[5:]
        if self.allowed:
            me = frame.f_locals.get("self")
            if me is not None and any(me is a for a in self.allowed):
                return
        self.hit, self.hit_kind = label, kind
        if kind == "copy":
            self.hit_in = f"compiled again under {code.co_filename}"
            return
        caller = frame.f_back
        mine = caller is not None and not os.path.abspath(caller.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)
        self.hit_in = f"{caller.f_code.co_name}(), line {caller.f_lineno}" if mine else ""

    def _running_threads(self) -> str:
        """Why a thread of the learner's that the watch cannot see is running now ('' when none is)."""
        frames = sys._current_frames()
        if len(frames) <= 1:
            return ""
        me = threading.get_ident()
        threads = {t.ident: t for t in threading.enumerate()}
        for ident, frame in frames.items():
            if ident == me or ident in self._watched_threads or ident in _BASELINE_THREADS:
                continue
            t = threads.get(ident)
            name = t.name if t is not None else f"thread {ident}"
            if name.startswith("minipaged-check-"):
                continue  # a check's own time-limit worker
            f, where = frame, ""
            while f is not None:  # the learner's code, or minipaged's reference, anywhere on its stack
                code = f.f_code
                if _kind_of_file(code.co_filename) == "learner":
                    where = f"{code.co_name}() (your code, line {f.f_lineno})"
                elif code in self.codes or os.path.abspath(code.co_filename) in self.files:
                    where = f"{code.co_name}() (minipaged's reference, line {f.f_lineno})"
                f = f.f_back
            target = getattr(t, "_target", None)
            tcode = getattr(getattr(target, "func", target), "__code__", None)
            if not where and tcode is not None and _kind_of_file(tcode.co_filename) == "learner":
                where = f"{tcode.co_name}() (your code)"
            if where:
                return f"{name!r}, in {where}"
        return ""

    def _pool_of_unwatched_threads(self, frame) -> str:
        """When the learner's code hands work to a thread pool whose threads were started before the watch: which."""
        pool = frame.f_locals.get("self")
        threads = getattr(pool, "_threads", None) or getattr(pool, "_pool", None) or ()
        idents = [getattr(t, "ident", None) for t in list(threads)]
        unwatched = [i for i in idents if i is not None and i not in self._watched_threads and i in self._alive_before]
        return f"a {type(pool).__name__} whose {len(unwatched)} thread(s) started before the check" if unwatched else ""

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        if threading.current_thread() is not self._thread or self.max_calls == 0:
            yield  # a call from another thread (e.g. a learner's own worker), or past the watched calls
            return
        if self.strict:
            running = self._running_threads()
            if running:
                raise CheckFailed(
                    f"{self.workbook_name}: before {what}, a thread your code started earlier is still running "
                    f"({running}). The check watches your code for calls into minipaged's own implementation, and "
                    "it cannot see into a thread started before it, so it refuses to go on while one runs. Stop that "
                    "thread (let it finish, or join it), or restart the kernel and run your cells again, then run this check.")
        if self.max_calls is not None:
            self.max_calls -= 1
        self._alive_before = frozenset(threading._active)  # a thread started after this is watched from its start
        previous = sys.getprofile()
        previous_threads = threading.getprofile() if hasattr(threading, "getprofile") else getattr(threading, "_profile_hook", None)
        sys.setprofile(self._hook_fn)
        threading.setprofile(self._thread_hook_fn)  # threads the learner's code starts are watched too
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
            if self.hit is not None and self.hit_kind == "thread":
                hit, where = self.hit, self.hit_in
                self.hit = None
                raise CheckFailed(
                    f"{self.workbook_name}: {what} handed work to {hit} (from {where}). The check watches your code "
                    "for calls into minipaged's own implementation, and it cannot see into a thread started before it. "
                    "Do the work in your own call, or start the pool inside it, then run this check again.")
            if self.hit is not None and self.hit_kind == "copy":
                hit, where = self.hit, self.hit_in
                self.hit = None
                raise CheckFailed(
                    f"{self.workbook_name}: {what} ran a copy of minipaged's own {hit} (the same bytecode, names and "
                    f"constants, {where}). The check refuses minipaged's implementation in your place, whatever file it "
                    "is compiled from: write that part yourself, run its cell, then run this check again.")
            if self.hit is not None and self.hit_kind == "unlisted":
                hit, where = self.hit, self.hit_in
                self.hit = None
                given = ", ".join(f"{m}.{a}" if a else f"{m} (all of it)" for m, a in ALLOW.get(self.workbook, [])) or "nothing"
                raise CheckFailed(
                    f"{self.workbook_name}: {what} called {hit}" + (f" (from {where})" if where else "")
                    + f", minipaged's own code that this workbook does not hand you. While a check calls your code, it may "
                      f"call only what the workbook gives you ({given}); the reference parts, the checks and their helpers "
                      "are refused. Write that part yourself, run its cell, then run this check again.")
            if self.hit is not None and not self.hit.startswith("minipaged"):
                hit, where = self.hit, self.hit_in
                self.hit = None
                raise CheckFailed(  # a library the check compares against (workbook 11: xgrammar's matcher)
                    f"{self.workbook_name}: {what} called {hit}" + (f" (from {where})" if where else "")
                    + f", the library the check compares your code against ({hit.split('.')[0]}). The check refuses its "
                      "implementation in your place, as it refuses minipaged's own: write that part yourself, run its "
                      "cell, then run this check again.")
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
        _core.builds("package code in place")  # the watch is on: the case refuses minipaged's code in the learner's place
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


__all__ = ["ALLOW", "ALWAYS_ALLOWED", "WATCH", "Guard", "allowed", "fingerprint", "package_copy", "package_fingerprints", "guarded", "run_guarded", "in_package", "refuse_package_class", "refuse_package_function", "refuse_reference",
           "refuse_reference_function", "watched",
           "watched_codes"]
