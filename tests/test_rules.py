"""The rule table (tests/rules_table.py): every rule a workbook states -> the check that tests it
-> a wrong answer that breaks only that rule.

Each row names a phrase of the solution workbook's own text (so a rule that is reworded or
dropped shows up here), the check function, and a wrong answer in tests/wrong_answers/. The
tests below hold the table to the files: the phrase is in the workbook, the wrong answer
exists and names the same check, it is rejected by that check with its EXPECT phrases (and
none of its UNEXPECTED ones), and the solution passes that check. Every wrong-answer file is
in the table, and the issue's categories (numerical edges, sharing through forked tables, the
rules of a step that preempts, delegation) each have rows in the workbooks that state them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
from pathlib import Path

import nbformat
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # workbook 05's kernels run in Triton's interpreter

from minipaged.checks import CheckFailed, CheckTimeout, NotImplementedYet  # noqa: E402
from minipaged.checks._core import recording_situations  # noqa: E402
from minipaged.checks._workbooks import run_workbook_cells  # noqa: E402

from rules_table import NOT_A_RULE, RULES, RUN, Rule  # noqa: E402
from test_checks import WRONG, _answer, _load, assert_declared_hint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"


def _id(r: Rule) -> str:
    return f"{r.workbook[:2]}:{r.wrong}"


@functools.lru_cache(maxsize=None)
def _text(stem: str) -> str:
    nb = nbformat.read(SOLUTIONS / f"{stem}.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells)


@pytest.mark.parametrize("rule", RULES, ids=_id)
def test_rule_is_stated_and_its_wrong_answer_names_the_check(rule: Rule) -> None:
    assert rule.rule in _text(rule.workbook), f"solutions/{rule.workbook}.ipynb no longer says {rule.rule!r}: update the table"
    path = WRONG / rule.workbook / f"{rule.wrong}.py"
    assert path.exists(), f"no wrong answer {path.relative_to(ROOT)}"
    mod = _load(path)
    assert mod.CHECK == rule.check, f"{path.name} is checked by {mod.CHECK}, the table says {rule.check}"
    assert mod.EXPECT, f"{path.name}: EXPECT names what the message must say"


def test_every_wrong_answer_is_in_the_table() -> None:
    listed = {f"{r.workbook}/{r.wrong}" for r in RULES} | NOT_A_RULE
    files = {f"{p.parent.name}/{p.stem}" for p in WRONG.glob("*/*.py") if not p.name.startswith("_")}
    assert files <= listed, f"wrong answers missing from the rule table: {sorted(files - listed)}"


def test_the_categories_are_covered() -> None:
    kinds = {(r.workbook[:2], r.kind) for r in RULES}
    for wb in ("01", "02", "03", "04", "05", "06", "07"):
        assert (wb, "delegation") in kinds, f"workbook {wb} has no delegation row"
    for wb in ("01", "03", "04", "05", "09"):
        assert (wb, "numerical") in kinds, f"workbook {wb} has no numerical-edge row"
    assert ("09", "delegation") in kinds and ("09", "sharing") in kinds  # a rollback of a forked table
    for wb in ("02", "03"):  # both say "ref count" / "shares": a forked table must be among their cases
        assert (wb, "sharing") in kinds
    assert sum(1 for r in RULES if r.kind == "preemption" and r.workbook == "06_scheduler") >= 5


# -- running the table (workbook 07's rows need the model: tests/test_checks.py runs those) -------------
_RUN = RUN


@pytest.mark.parametrize("rule", _RUN, ids=_id)
def test_wrong_answer_fails_its_check_with_its_message(rule: Rule) -> None:
    mod = _load(WRONG / rule.workbook / f"{rule.wrong}.py")
    module, fn_name = rule.check.split(":")
    check = getattr(importlib.import_module(module), fn_name)
    with pytest.raises(CheckFailed) as info, contextlib.redirect_stdout(io.StringIO()):
        check(*_answer(mod), **getattr(mod, "KWARGS", {}))
    assert not isinstance(info.value, (NotImplementedYet, CheckTimeout)), str(info.value)
    msg = str(info.value).lower()
    missing = [e for e in mod.EXPECT if e.lower() not in msg]
    assert not missing, f"{rule.wrong}: the message lacks {missing}:\n\n{info.value}"
    unwanted = [e for e in getattr(mod, "UNEXPECTED", []) if e.lower() in msg]
    assert not unwanted, f"{rule.wrong}: the message should not say {unwanted}:\n\n{info.value}"
    assert_declared_hint(WRONG / rule.workbook / f"{rule.wrong}.py", mod, str(info.value))


_SOLUTION_ARGS = {
    "check_bytes_per_token": ("01_kv_cache_math", ["bytes_per_token"]),
    "check_bytes_per_sequence": ("01_kv_cache_math", ["bytes_per_sequence"]),
    "check_max_seqs": ("01_kv_cache_math", ["max_seqs_contiguous", "max_seqs_paged"]),
    "check_allocate_free": ("02_block_allocator", ["MyBlockAllocator"]),
    "check_sharing": ("02_block_allocator", ["MyBlockAllocator"]),
    "check_growth": ("03_block_table", ["MyBlockTable"]),
    "check_slot_mapping": ("03_block_table", ["MyBlockTable"]),
    "check_free": ("03_block_table", ["MyBlockTable"]),
    "check_gather_kv": ("04_paged_attention_torch", ["gather_kv"]),
    "check_paged_attention": ("04_paged_attention_torch", ["paged_attention"]),
    "check_quantize": ("04_paged_attention_torch", ["block_scales", "quantize", "dequantize"]),
    "check_copy_block": ("04_paged_attention_torch", ["copy_block"]),
    "check_gather_kv_int8": ("04_paged_attention_torch", ["gather_kv_int8"]),
    "check_paged_attention_int8": ("04_paged_attention_torch", ["paged_attention_int8"]),
    "check_decode": ("05_triton_decode_kernel", ["paged_decode"]),
    "check_admission": ("06_scheduler", ["MyScheduler"]),
    "check_preemption": ("06_scheduler", ["MyScheduler"]),
    "check_rejection": ("06_scheduler", ["MyScheduler"]),
    "check_hash_chain": ("08_prefix_caching", ["MyPrefixCache"]),
    "check_lookup_and_eviction": ("08_prefix_caching", ["MyPrefixCache"]),
    "check_copy_on_write": ("08_prefix_caching", ["copy_on_write"]),
    "check_beam_search": ("08_prefix_caching", ["fork_table", "free_table", "copy_on_write"]),
    "check_proposer": ("09_speculative_decoding", ["propose_ngram"]),
    "check_truncate": ("09_speculative_decoding", ["MyBlockTable"]),
    # workbook 10's solution functions, checked on the checks' own cases (the profile's case needs the model)
    "check_kv_capacity": ("10_predict_and_measure", ["kv_capacity"]),
    "check_knee": ("10_predict_and_measure", ["predict_knee"]),
    "check_goodput": ("10_predict_and_measure", ["goodput"]),
    "check_gain": ("10_predict_and_measure", ["predict_gain"]),
    "check_tensor_parallel": ("10_predict_and_measure", ["all_reduce_bytes_per_token", "tp_step_time"]),
    "check_break_even": ("10_predict_and_measure", ["break_even"]),
    "check_choice_mask": ("11_structured_outputs", ["choice_mask"]),
    "check_store": ("12_kv_connector", ["MyHostStore"]),
    "check_connector": ("12_kv_connector", ["MyHostConnector"]),
}
# Checks whose solution run needs the model: the solution workbooks pass them under nbval (tests/test_workbooks.py).
_NEEDS_MODEL = {"check_serving", "check_ledger"}  # check_ledger: the solution's ledger is measured (see below)


@pytest.mark.parametrize("check", sorted({r.check for r in _RUN if r.check.split(":")[1] not in _NEEDS_MODEL}))
def test_solution_passes_the_check(check: str) -> None:
    module, fn_name = check.split(":")
    stem, names = _SOLUTION_ARGS[fn_name]
    if stem.startswith("05_"):
        pytest.importorskip("triton")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        ns = _solution_functions(stem)
        with recording_situations() as built:
            getattr(importlib.import_module(module), fn_name)(*[ns[n] for n in names])
    assert "\u2714" in out.getvalue(), out.getvalue()
    # Every situation a row of this check names is built by one of the check's cases (issue 40).
    for rule in (r for r in RULES if r.check == check):
        missing = sorted(set(rule.situations) - built)
        assert not missing, (f"{_id(rule)} names situations {missing} that no case of {fn_name} builds "
                             f"(it built {sorted(built)})")


def test_every_row_lists_its_situations_from_the_vocabulary() -> None:
    """Each row lists the situations its wording covers, by the names of SITUATIONS; a row whose
    wording names an exception type lists 'exception type' (its check tells that type from others)."""
    import re

    import minipaged.checks as checks_pkg
    from minipaged.checks._core import SITUATIONS

    for name in ("block_allocator", "block_table", "kv_cache_math", "paged_attention", "kv_int8", "triton_decode",
                 "scheduler", "assemble", "prefix_cache", "spec_decode", "predict", "structured", "kv_connector"):
        importlib.import_module(f"{checks_pkg.__name__}.{name}")  # their own situations join the vocabulary
    for rule in RULES:
        assert rule.situations, f"{_id(rule)} lists no situation: name what its wording covers"
        unknown = sorted(set(rule.situations) - set(SITUATIONS))
        assert not unknown, f"{_id(rule)}: unknown situations {unknown}"
        if re.search(r"\b\w+Error\b", rule.rule):
            assert "exception type" in rule.situations, f"{_id(rule)} names an exception: list 'exception type'"


def _solution_functions(stem: str) -> dict:
    """The workbook's definitions. Workbook 10's code cells load the model and measure: only its
    solution cells (pure functions) are run for the rule table."""
    if not stem.startswith("10_"):
        return run_workbook_cells(SOLUTIONS / f"{stem}.ipynb")
    ns: dict = {"math": importlib.import_module("math"), "statistics": importlib.import_module("statistics"),
                "pm": importlib.import_module("minipaged.checks.predict")}
    for cell in nbformat.read(SOLUTIONS / f"{stem}.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            exec(compile(cell.source, f"<{stem}>", "exec"), ns)
    return ns


def test_ledger_check_refuses_a_verdict_its_interval_contradicts() -> None:
    """Done-when of issue 33: the ledger check refuses a verdict its own interval contradicts, and
    accepts any verdict (keep, reject or inconclusive) that its interval supports."""
    from minipaged.checks import predict as pm

    ns = _solution_functions("10_predict_and_measure")
    base = _load(WRONG / "10_predict_and_measure" / "_base.py")
    for c, t, want in (([2.0, 2.1, 1.9], [1.0, 1.1, 0.9], "keep"), ([1.0, 1.1, 0.9], [2.0, 2.1, 1.9], "reject"),
                       ([2.0, 2.2, 1.8], [1.9, 2.4, 1.5], "inconclusive")):
        entry = base.entry("prefix caching", *base.pairs(c, t))
        assert entry["verdict"] == want
        other = base.entry("speculative decoding", *base.pairs(c, t, start=10))
        with contextlib.redirect_stdout(io.StringIO()):
            pm.check_ledger([entry, other], ns["speedup_interval"], ns["verdict"])
        for wrong in {"keep", "reject", "inconclusive"} - {want}:
            with pytest.raises(CheckFailed, match="contradicts its interval"):
                pm.check_ledger([dict(entry, verdict=wrong), other], ns["speedup_interval"], ns["verdict"])


def test_the_ledger_rows_situations_are_built() -> None:
    """Issue 40 for workbook 10's ledger rows (their check measures the model in the workbook): the
    ledger check on made-up entries, with the solution's interval and verdict, builds every situation
    those rows name."""
    from minipaged.checks import predict as pm

    ns = _solution_functions("10_predict_and_measure")
    base = _load(WRONG / "10_predict_and_measure" / "_base.py")
    entries = [base.entry("prefix caching", *base.pairs([2.0, 2.1, 1.9], [1.0, 1.1, 0.9])),
               base.entry("speculative decoding", *base.pairs([1.0, 1.1, 0.9], [2.0, 2.1, 1.9], start=10))]
    with recording_situations() as built, contextlib.redirect_stdout(io.StringIO()):
        pm.check_ledger(entries, ns["speedup_interval"], ns["verdict"])
    for rule in (r for r in RULES if r.check.endswith(":check_ledger")):
        missing = sorted(set(rule.situations) - built)
        assert not missing, f"{_id(rule)} names {missing}, which the ledger check did not build ({sorted(built)})"


def test_table_size() -> None:
    # The report quotes this number; it only grows.
    assert len(RULES) >= 55, len(RULES)


# -- the workbooks hold no copied package code: a learner's class has exactly the Protocol's members ---
def _own_members(cls: type) -> set:
    return {n for n in vars(cls) if not n.startswith("__") or n == "__init__"} - {"__init__"}


@pytest.mark.parametrize("stem, name, protocol, extra", [
    ("02_block_allocator", "MyBlockAllocator", "BlockPool", set()),
    ("03_block_table", "MyBlockTable", "BlockTableProtocol", set()),
    ("06_scheduler", "MyScheduler", None, {"add_request", "schedule", "_preempt"}),
    ("09_speculative_decoding", "MyBlockTable", None, {"truncate"}),  # minipaged's BlockTable + the contract's optional member
])
def test_solution_classes_hold_only_what_the_learner_writes(stem: str, name: str, protocol, extra: set) -> None:
    from minipaged import interfaces, parts

    with contextlib.redirect_stdout(io.StringIO()):
        cls = run_workbook_cells(SOLUTIONS / f"{stem}.ipynb")[name]
    if protocol is not None:
        proto = getattr(interfaces, protocol)
        assert _own_members(cls) <= set(interfaces.PROTOCOL_MEMBERS[proto]), (
            f"{name} defines {sorted(_own_members(cls) - set(interfaces.PROTOCOL_MEMBERS[proto]))}, which "
            f"interfaces.{protocol} does not hold: that is pasted package code (use minipaged.parts)")
        assert parts.missing_members(cls, proto) == [], parts.missing_members(cls, proto)
    else:
        assert _own_members(cls) == extra, sorted(_own_members(cls))
    from minipaged.checks._delegation import _member_code, in_package

    for n in _own_members(cls):  # none of it is minipaged's code
        code = _member_code(vars(cls)[n])
        assert code is None or not in_package(code), f"{name}.{n} is minipaged's code"


def test_the_fork_case_alone_catches_the_sharing_rows() -> None:
    """The rows about forked tables: their wrong answers fail in the fork story itself, not only elsewhere."""
    from minipaged.checks import block_allocator

    mod = _load(WRONG / "02_block_allocator" / "shared_block_freed.py")
    stats = {"ops": 0, "runs": 0, "current": ""}
    with pytest.raises(CheckFailed, match="a forked table shares all its blocks"):
        block_allocator._fork_scenario(mod.MyBlockAllocator, stats)
    with contextlib.redirect_stdout(io.StringIO()):
        good = run_workbook_cells(SOLUTIONS / "02_block_allocator.ipynb")["MyBlockAllocator"]
    block_allocator._fork_scenario(good, stats)


def test_a_thread_started_by_the_learner_is_watched() -> None:
    import threading

    from minipaged import BlockAllocator
    from minipaged.checks import block_allocator

    with contextlib.redirect_stdout(io.StringIO()):
        good = run_workbook_cells(SOLUTIONS / "02_block_allocator.ipynb")["MyBlockAllocator"]

    class Threaded(good):
        def allocate(self):
            box = []
            t = threading.Thread(target=lambda: box.append(BlockAllocator(2, 1).allocate()))
            t.start()
            t.join()
            return super().allocate()

    with pytest.raises(CheckFailed, match="minipaged's own implementation"):
        block_allocator.check_allocate_free(Threaded)


def test_the_call_watch_imports_no_kernel_module() -> None:
    """Watching for minipaged's Triton kernels must not import them: that would define the kernels
    before TRITON_INTERPRET is set, and a later lesson on the CPU could not run them."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from minipaged.checks import paged_attention as pa\n"
            "from minipaged.checks._workbooks import run_workbook_cells\n"
            f"ns = run_workbook_cells({str(SOLUTIONS / '04_paged_attention_torch.ipynb')!r})\n"
            "pa.check_paged_attention(ns['paged_attention'])\n"
            "assert 'minipaged.attention.triton_paged' not in sys.modules, 'imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
