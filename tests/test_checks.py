"""The checks in minipaged.checks: the reference passes them, stubs are named, endless loops
are stopped, and every typical wrong answer in tests/wrong_answers/ is rejected with the
message it is meant to get. The checks are called directly (no notebooks): this is fast.

A wrong answer is a small file in tests/wrong_answers/NN_workbook/ with CHECK
("module:function"), EXPECT (phrases the message must contain, case-insensitive), optionally
UNEXPECTED (phrases it must not contain: a hint about the wrong method), and the answer: the names starting with My/my_ (or an ``answer()`` function returning the
arguments). In the workbooks of HINTED, each also declares HINT: a phrase the message's hint (the
text after "Hint: ") must contain, and that no other wrong answer's hint of that workbook may
(a hint names the mistake made, never another), or None for a refusal that carries no hint. Files starting with "_" are shared helpers, not wrong answers. Workbook 07's
wrong answers name a ``build_engine`` and how the learner's folder differs (DROP, EDIT).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WRONG = ROOT / "tests" / "wrong_answers"
SOLUTIONS = ROOT / "solutions"

if not torch.cuda.is_available():
    # The Triton kernels of workbook 05's wrong answers must be defined in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minipaged import BlockAllocator, BlockTable, Scheduler  # noqa: E402
from minipaged.attention.reference import gather_kv, paged_attention  # noqa: E402
from minipaged.checks import CheckFailed, CheckTimeout, NotImplementedYet  # noqa: E402
from minipaged.checks import block_allocator, block_table, kv_cache_math, scheduler  # noqa: E402
from minipaged.checks import paged_attention as pa  # noqa: E402
from minipaged.checks import triton_decode  # noqa: E402
from minipaged.checks import kv_connector as kc  # noqa: E402
from minipaged.kv_connector import HostKVStore, HostOffloadConnector  # noqa: E402
from minipaged.checks._core import run_with_time_limit  # noqa: E402


def _wrong_answer_files(all_files: bool = False) -> list[Path]:
    """The wrong answers; without ``all_files``, those the rule table (tests/test_rules.py) does not run."""
    from rules_table import RUN_FILES

    files = sorted(p for p in WRONG.glob("*/*.py") if not p.name.startswith("_"))
    return files if all_files else [p for p in files if f"{p.parent.name}/{p.stem}" not in RUN_FILES]


def _load(path: Path):
    sys.path.insert(0, str(path.parent))
    try:
        for name in [n for n in sys.modules if n == "_base"]:
            del sys.modules[name]
        spec = importlib.util.spec_from_file_location(f"wrong_{path.parent.name}_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(path.parent))


# Workbooks whose every wrong answer declares the hint it must get (HINT): issue 40, hints that name the cause.
HINTED = ("02_block_allocator", "03_block_table", "08_prefix_caching", "09_speculative_decoding")


def _declared_hints(stem: str) -> dict:
    """{wrong answer: its HINT} for a workbook of HINTED."""
    return {p.stem: _load(p).HINT for p in sorted((WRONG / stem).glob("*.py")) if not p.name.startswith("_")}


def assert_declared_hint(path: Path, mod, msg: str) -> None:
    """The hint the message prints is the one ``path`` declares (HINT), and names no other wrong answer's mistake."""
    if path.parent.name not in HINTED:
        return
    assert hasattr(mod, "HINT"), f"{path.name}: declare HINT, the phrase its hint must contain (None: no hint)"
    found = re.split(r"(?m)^Hint: ", msg, maxsplit=1)
    hint = found[1] if len(found) == 2 else None
    if mod.HINT is None:
        assert hint is None, f"{path.name} declares no hint, but the message gives one:\n\n{msg}"
        return
    assert hint is not None, f"{path.name}: the message has no hint; it should say {mod.HINT!r}:\n\n{msg}"
    assert mod.HINT.lower() in hint.lower(), f"{path.name}: the hint is not the declared one ({mod.HINT!r}):\n\n{hint}"
    if "the rules that could explain it" in hint.lower():
        return  # a list of candidate rules (the wrong state names no single cause): it holds the declared one
    others = {name: h for name, h in _declared_hints(path.parent.name).items()
              if name != path.stem and h and h.lower() not in mod.HINT.lower()}
    named = [f"{name} ({h!r})" for name, h in others.items() if h.lower() in hint.lower()]
    assert not named, f"{path.name}: the hint names another mistake: {named}:\n\n{hint}"


def _answer(mod) -> tuple:
    if hasattr(mod, "answer"):
        return tuple(mod.answer())
    mine = [v for k, v in vars(mod).items() if k.startswith(("My", "my_"))]
    assert len(mine) == 1, f"{mod.__name__}: define exactly one My*/my_* answer or an answer() function"
    return (mine[0],)


@pytest.fixture(scope="module")
def one_thread():
    # Two cores shared with other jobs: two OpenMP threads can make the model 100x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _learner_folder(tmp_path: Path, mod) -> Path:
    folder = tmp_path / "learner"
    folder.mkdir()
    for stem in ("02_block_allocator", "03_block_table", "04_paged_attention_torch", "06_scheduler"):
        if stem in getattr(mod, "DROP", []):
            continue
        text = (SOLUTIONS / f"{stem}.ipynb").read_text(encoding="utf-8")
        if stem in getattr(mod, "EDIT", {}):
            old, new = mod.EDIT[stem]
            import json

            old_j, new_j = json.dumps(old)[1:-1], json.dumps(new)[1:-1]
            assert old_j in text, f"{mod.__name__}: {old!r} is not in solutions/{stem}.ipynb"
            text = text.replace(old_j, new_j)
        (folder / f"{stem}.ipynb").write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize("path", _wrong_answer_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_wrong_answer_is_rejected(path: Path, tmp_path: Path, request) -> None:
    mod = _load(path)
    if getattr(mod, "NEEDS_CONTRACTS", False) and hasattr(BlockTable, "as_tensor"):
        pytest.skip("needs the engine that serves Protocol-only parts (issue 10's contracts, not merged yet)")
    module, fn_name = mod.CHECK.split(":")
    check = getattr(importlib.import_module(module), fn_name)
    kwargs = getattr(mod, "KWARGS", {})
    if path.parent.name.startswith("07_"):
        request.getfixturevalue("one_thread")
        folder = _learner_folder(tmp_path, mod)
        args = (mod.build_engine, folder) if fn_name == "check_engine" else (folder,)
    else:
        args = _answer(mod)
    try:
        with pytest.raises(CheckFailed) as info:
            check(*args, **kwargs)
    finally:
        getattr(mod, "teardown", lambda: None)()  # e.g. a thread the wrong answer started
    msg = str(info.value)
    if hasattr(mod, "ERROR"):
        assert type(info.value).__name__ == mod.ERROR, msg
    else:
        assert not isinstance(info.value, (NotImplementedYet, CheckTimeout)), msg
    missing = [e for e in mod.EXPECT if e.lower() not in msg.lower()]
    assert not missing, f"{path.name}: the message lacks {missing}:\n\n{msg}"
    unwanted = [e for e in getattr(mod, "UNEXPECTED", []) if e.lower() in msg.lower()]
    assert not unwanted, f"{path.name}: the message should not say {unwanted}:\n\n{msg}"
    assert_declared_hint(path, mod, msg)


def test_every_hinted_wrong_answer_declares_its_own_hint() -> None:
    """Issue 40: in 02, 03, 08 and 09 every wrong answer declares the hint it must get (tests/test_rules.py and the test
    above check it is the one printed), and no two declare the same: each names its own mistake."""
    for stem in HINTED:
        hints = _declared_hints(stem)
        for name, h in hints.items():
            assert h is None or (isinstance(h, str) and h.strip()), f"{stem}/{name}.py: HINT is a phrase or None"
        phrases = [h.lower() for h in hints.values() if h]
        dup = sorted({h for h in phrases if phrases.count(h) > 1})
        assert not dup, f"{stem}: two wrong answers declare the same hint {dup}: make each name its own mistake"


def test_every_workbook_has_three_wrong_answers() -> None:
    stems = ["01_kv_cache_math", "02_block_allocator", "03_block_table", "04_paged_attention_torch",
             "05_triton_decode_kernel", "06_scheduler", "07_assemble", "08_prefix_caching", "09_speculative_decoding",
             "10_predict_and_measure", "11_structured_outputs", "12_kv_connector"]
    for stem in stems:
        n = len([p for p in (WRONG / stem).glob("*.py") if not p.name.startswith("_")])
        assert n >= 3, f"tests/wrong_answers/{stem}/ has {n} wrong answers; keep at least 3"


class _RefScheduler(Scheduler):
    """For the replay tests only (replay() compares nothing): the checks themselves refuse it."""

    def add_request(self, seq):
        return super().add_request(seq)

    def schedule(self):
        return super().schedule()


# -- the solutions pass; minipaged's own parts are refused --------------------------------------------
def _solution(stem: str) -> dict:
    from minipaged.checks._workbooks import run_workbook_cells

    with contextlib.redirect_stdout(io.StringIO()):
        return run_workbook_cells(SOLUTIONS / f"{stem}.ipynb")


def test_solutions_pass_every_check(capsys) -> None:
    k = kv_cache_math
    ns = _solution("01_kv_cache_math")
    k.check(ns["bytes_per_token"], ns["bytes_per_sequence"], ns["max_seqs_contiguous"], ns["max_seqs_paged"])
    block_allocator.check(_solution("02_block_allocator")["MyBlockAllocator"])
    block_table.check(_solution("03_block_table")["MyBlockTable"])
    ns = _solution("04_paged_attention_torch")
    pa.check(ns["gather_kv"], ns["paged_attention"])
    scheduler.check(_solution("06_scheduler")["MyScheduler"])
    out = capsys.readouterr().out
    assert out.count("\u2714") == 13, out


@pytest.mark.parametrize("check, part, says", [
    (lambda: block_allocator.check_allocate_free(BlockAllocator), "BlockAllocator", "minipaged's own"),
    (lambda: block_table.check_growth(BlockTable), "BlockTable", "minipaged's own"),
    (lambda: scheduler.check_admission(Scheduler), "Scheduler", "minipaged's own"),
    (lambda: pa.check_gather_kv(gather_kv), "gather_kv", "minipaged's own"),
    (lambda: pa.check_paged_attention(paged_attention), "paged_attention", "minipaged's own"),
    (lambda: kv_cache_math.check_bytes_per_token(kv_cache_math.ref_bytes_per_token), "ref_bytes_per_token", "minipaged's own"),
    (lambda: kc.check_store(HostKVStore), "HostKVStore", "minipaged's own"),
    (lambda: kc.check_connector(HostOffloadConnector), "HostOffloadConnector", "minipaged's own"),
    (lambda: kc.check_serving(HostOffloadConnector), "HostOffloadConnector", "minipaged's own"),  # before the model loads
])
def test_minipaged_own_part_is_refused(check, part, says) -> None:
    with pytest.raises(CheckFailed) as info:
        check()
    assert part in str(info.value) and says in str(info.value), str(info.value)


def test_a_super_call_wrapper_is_refused_for_every_part() -> None:
    class Alloc(BlockAllocator):
        def __init__(self, n, bs=16):
            super().__init__(n, bs)

        num_free_blocks = property(lambda self: BlockAllocator.num_free_blocks.fget(self))

        def allocate(self):
            return super().allocate()

        def free(self, b):
            return super().free(b)

        def incref(self, b):
            return super().incref(b)

        def ref_count(self, b):
            return super().ref_count(b)

    class Sched(Scheduler):
        def add_request(self, seq):
            return super().add_request(seq)

        def schedule(self):
            return super().schedule()

    for check, cls in ((block_allocator.check_sharing, Alloc), (scheduler.check_preemption, Sched)):
        with pytest.raises(CheckFailed, match="minipaged's own implementation"):
            check(cls)


def test_switching_off_the_call_watch_is_refused() -> None:
    ns = _solution("02_block_allocator")

    class Sneaky(ns["MyBlockAllocator"]):
        def allocate(self):
            sys.setprofile(None)
            return super().allocate()

    with pytest.raises(CheckFailed, match="changed sys.setprofile"):
        block_allocator.check_allocate_free(Sneaky)


def test_solution_kernel_passes_in_the_interpreter() -> None:
    sys.path.insert(0, str(WRONG / "05_triton_decode_kernel"))
    try:
        sys.modules.pop("_base", None)
        base = importlib.import_module("_base")
    finally:
        sys.path.pop(0)
    triton_decode.check_decode(base.make())


# -- stubs, crashes, time limits ---------------------------------------------------------------------
class _Stub:
    def __init__(self, num_blocks, block_size=16):
        self.num_blocks = num_blocks

    @property
    def num_free_blocks(self):
        return self.num_blocks

    def allocate(self):
        # YOUR CODE HERE
        raise NotImplementedError()

    def ref_count(self, b):
        return 0

    def free(self, b):
        # YOUR CODE HERE
        raise NotImplementedError()

    def incref(self, b):
        # YOUR CODE HERE
        raise NotImplementedError()


def test_stub_is_named() -> None:
    with pytest.raises(NotImplementedYet, match=r"not implemented yet: _Stub\.allocate") as info:
        block_allocator.check_allocate_free(_Stub)
    assert isinstance(info.value, AssertionError)
    assert "NotImplementedError" in str(info.value)


def test_stub_function_is_named() -> None:
    def bytes_per_token(m):
        raise NotImplementedError()

    with pytest.raises(NotImplementedYet, match="not implemented yet: .*bytes_per_token"):
        kv_cache_math.check_bytes_per_token(bytes_per_token)


def test_stub_kernel_is_named() -> None:
    def paged_decode_kernel():
        # YOUR CODE HERE
        raise NotImplementedError()

    with pytest.raises(NotImplementedYet, match="not implemented yet: paged_decode_kernel"):
        triton_decode.check_decode(lambda *a: None, kernel=paged_decode_kernel)


def test_crash_in_learner_code_names_the_line() -> None:
    class Crashy(_solution("02_block_allocator")["MyBlockAllocator"]):
        def free(self, block_id):
            return self.ref_count[block_id]  # a learner's typo: a method, not the list

    with pytest.raises(CheckFailed) as info:
        block_allocator.check_allocate_free(Crashy)
    msg = str(info.value)
    assert "crashed with TypeError" in msg and "self.ref_count[block_id]" in msg, msg
    assert "minipaged's own" not in msg, msg
    assert isinstance(info.value.__cause__, TypeError)
    rendered = "\n".join(info.value._render_traceback_())
    assert "Traceback of your code" in rendered and "CheckFailed" in rendered


def test_time_limit_without_alarm(monkeypatch) -> None:
    """Off the main thread (or on Windows) the check runs in a worker thread and stops waiting."""
    monkeypatch.setenv("MINIPAGED_CHECK_NO_ALARM", "1")
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    try:
        with pytest.raises(CheckTimeout, match="restart the kernel"):
            run_with_time_limit(spin, 0.5, "test", lambda: "spinning")
    finally:
        stop.set()


def test_triton_missing_skips(monkeypatch, capsys) -> None:
    monkeypatch.setattr(triton_decode, "triton_installed", lambda: False)
    triton, tl = triton_decode.setup_triton()

    @triton.jit
    def kernel(x_ptr, N: tl.constexpr):
        pass

    triton_decode.check_decode(lambda *a: None, kernel=kernel)
    out = capsys.readouterr().out
    assert "Triton is not installed" in out and "SKIPPED" in out


def test_scheduler_replay_gives_both_states() -> None:
    mine, ref = scheduler.replay(_RefScheduler, "the token budget: 3 prompts of 6 with max_num_batched_tokens=8", steps=1)
    assert [s.seq_id for s in mine.running] == [s.seq_id for s in ref.running] == [0, 1]


def test_case_replay_matches() -> None:
    case = pa.case_named("chunk: 3 new tokens over a cached prefix of 6")
    assert torch.allclose(paged_attention(*case.args()), pa.variant_attention(case), atol=1e-5)


def test_engine_mismatch_names_the_part_to_blame(tmp_path, monkeypatch, one_thread) -> None:
    """Parts that pass their own checks but differ inside the engine: the check swaps in
    minipaged's parts one at a time and names the one that makes the answers match."""
    if hasattr(BlockTable, "as_tensor"):
        pytest.skip("needs the engine that serves Protocol-only parts (issue 10's contracts, not merged yet)")
    from minipaged.checks import assemble

    folder = _parts_folder(tmp_path)
    load = assemble.load_parts

    def load_with_drifting_attention(*args, **kwargs):
        parts = load(*args, **kwargs)
        good, calls = parts.paged_attention, [0]

        def paged_attention(q, *rest):  # right for a while, then off: what no single check case sees
            calls[0] += 1
            out = good(q, *rest)
            return out * 1.5 if calls[0] > 100 and q.shape[0] > 1 else out

        parts.paged_attention = paged_attention
        return parts

    monkeypatch.setattr(assemble, "load_parts", load_with_drifting_attention)

    with pytest.raises(CheckFailed, match="differ from the reference engine") as info:
        assemble.check_engine(_build_engine, folder)
    assert "with minipaged's attention (04/05) instead of yours, the answers match" in str(info.value)


# -- the fixes of the review: each proven here ------------------------------------------------------
def _base_module(stem: str):
    sys.path.insert(0, str(WRONG / stem))
    try:
        sys.modules.pop("_base", None)
        return importlib.import_module("_base")
    finally:
        sys.path.pop(0)
        sys.modules.pop("_base", None)


def test_block_table_free_in_any_order_passes(capsys) -> None:
    """The rules ask for every block back, in any order: forward and shuffled frees pass (the
    reference frees last-block-first), and the block ids handed out afterwards are still compared."""
    import random as _random

    good = _base_module("03_block_table").GoodBlockTable  # frees first-to-last

    class Shuffled(good):
        def free(self):
            order = list(self.blocks)
            _random.Random(len(order)).shuffle(order)
            for b in order:
                self.allocator.free(b)
            self.blocks, self.num_tokens = [], 0

    block_table.check_free(good)
    block_table.check(Shuffled)
    assert capsys.readouterr().out.count("\u2714") == 4


def test_block_table_still_compares_blocks_after_a_free() -> None:
    """After free() the learner's pool takes the reference's free-list order, so a table that then
    takes the wrong block is still caught, with the append hint."""
    good = _base_module("03_block_table").GoodBlockTable

    class WrongAfterFree(good):
        def free(self):
            super().free()
            self.freed = True

        def append_tokens(self, num_new_tokens=1):
            if getattr(self, "freed", False) and self.blocks_needed(num_new_tokens) == 1 and self.allocator.num_free_blocks > 1:
                a, b = self.allocator.allocate(), self.allocator.allocate()
                self.allocator.free(a)  # keeps the second block: not the one the pool hands out first
                self.blocks.append(b)
                self.num_tokens += num_new_tokens
                return [b]
            return super().append_tokens(num_new_tokens)

    with pytest.raises(CheckFailed, match="blocks differ after") as info:
        block_table.check_free(WrongAfterFree)
    assert "parts.allocate_many" in str(info.value)


def test_scheduler_fixed_stories_tell_their_story() -> None:
    """The fixed stories ignore EOS, so what their labels promise happens with every seed the
    checks use; the preemption stories preempt, the newest request first."""
    stats = {"ops": 0, "runs": 0, "current": ""}
    for seed in (0, 1, 2):
        for label, cfg, reqs in scheduler._fixed("preemption"):
            sim = scheduler._play(Scheduler, label, cfg, reqs, seed, stats, ignore_eos=True)
            assert sim.ref.num_preemptions > 0, f"{label!r} (seed {seed}) never preempts"
            first = next(h for h in sim.history if "preempted" in h)
            if "newest" in label:
                assert "preempted r2" in first, f"{label!r} (seed {seed}): the first preemption is {first!r}"
            assert all(len(s.output_token_ids) == s.max_tokens for s in sim.ref_seqs.values()), label


@pytest.mark.parametrize("path", sorted(p for p in (WRONG / "06_scheduler").glob("*.py") if not p.name.startswith("_")),
                         ids=lambda p: p.stem)
def test_scheduler_replay_line_rebuilds_the_failing_step(path: Path) -> None:
    """The replay line a failure prints (with the check's seed) rebuilds the run: the reference's
    next schedule() is the 'Expected' of the message."""
    import re

    mod = _load(path)
    if any("minipaged's own" in e for e in mod.EXPECT) or not hasattr(mod, "MyScheduler"):
        pytest.skip("a delegation refusal or a plant of the watch's (answer()): nothing is played, so there is no replay line")
    cls = mod.MyScheduler
    check = getattr(scheduler, mod.CHECK.split(":")[1])
    with pytest.raises(CheckFailed) as info:
        check(cls)
    msg = str(info.value)
    m = re.search(r"mine, ref = (sc\.replay\(.*\))  # both schedulers (just before step \d+|after the add_request)", msg)
    assert m, msg
    mine, ref = eval(m.group(1), {"sc": scheduler, cls.__name__: cls})
    exp = re.search(r"Expected: scheduled (.*), preempted (\[.*\])", msg)
    if "sched.schedule() differs" in msg and exp:
        out = ref.schedule()
        assert scheduler._Sim._sched_text(out) == exp.group(1), msg
        assert "[" + ", ".join(f"r{s.seq_id}" for s in out.preempted) + "]" == exp.group(2), msg


def test_scheduler_replay_takes_the_seed() -> None:
    label, cfg, reqs = scheduler._random("preemption", 1, 3)
    stats = {"ops": 0, "runs": 0, "current": ""}
    for steps in (2, 5):
        sim = scheduler._play(Scheduler, label, cfg, reqs, 1, stats, steps=steps)
        _, ref = scheduler.replay(_RefScheduler, label, steps=steps, seed=1)
        want = [(s.seq_id, s.num_computed_tokens, s.output_token_ids) for s in list(sim.ref.running) + list(sim.ref.waiting)]
        got = [(s.seq_id, s.num_computed_tokens, s.output_token_ids) for s in list(ref.running) + list(ref.waiting)]
        assert got == want
    with pytest.raises(KeyError):
        scheduler.replay(_RefScheduler, label, steps=1, seed=0)  # a seed-1 run is not among seed 0's


def _parts_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "learner"
    folder.mkdir()
    for stem in ("02_block_allocator", "03_block_table", "04_paged_attention_torch", "06_scheduler"):
        shutil.copy(SOLUTIONS / f"{stem}.ipynb", folder)
    return folder


def _build_engine(model, tokenizer, parts, **engine_args):
    """Workbook 07's answer: minipaged's engine serving the learner's parts."""
    from minipaged.llm import LLM

    return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
               scheduler_cls=parts.scheduler_cls, attention=parts.attention, **engine_args)


def test_workbook_05_is_optional_on_a_gpu(tmp_path: Path, capsys, one_thread) -> None:
    """With a GPU (use_triton=True), a missing or unsolved 05 is not required: decode runs through
    04, and load_parts says so."""
    from minipaged.checks import assemble

    folder = _parts_folder(tmp_path)
    parts = assemble.load_parts(folder, use_triton=True)
    out = capsys.readouterr().out
    assert parts.paged_decode is None and parts.attention is parts.paged_attention
    assert "05_triton_decode_kernel" in out and "not used" in out and "not found" in out, out
    assert "decode runs through your 04 attention" in out, out

    shutil.copy(ROOT / "exercises" / "05_triton_decode_kernel.ipynb", folder)
    parts = assemble.load_parts(folder, use_triton=True)
    out = capsys.readouterr().out
    assert parts.paged_decode is None
    assert "decode runs through your 04 attention" in out and "NotImplementedError" in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a solved 05 is used only on a GPU (its check is slow interpreted)")
def test_solved_workbook_05_serves_decode_on_a_gpu(tmp_path: Path, capsys, one_thread) -> None:
    from minipaged.checks import assemble

    folder = _parts_folder(tmp_path)
    shutil.copy(SOLUTIONS / "05_triton_decode_kernel.ipynb", folder)
    parts = assemble.load_parts(folder)
    out = capsys.readouterr().out
    assert parts.paged_decode is not None, out
    assert "decode steps run through your Triton kernel (05" in out, out


def test_assembled_attention_dispatches_on_num_decodes() -> None:
    """With a Triton decode (05), the runner's num_decodes sends the first sequences to it and the rest
    to the 04 attention: the result equals the reference on a decode-first mixed batch."""
    pytest.importorskip("triton")
    from minipaged.checks import assemble

    sys.path.insert(0, str(WRONG / "05_triton_decode_kernel"))
    try:
        decode = _load(WRONG / "05_triton_decode_kernel" / "_base.py").make()
    finally:
        sys.path.remove(str(WRONG / "05_triton_decode_kernel"))
    calls = {"decode": 0, "full": 0}

    def counted(fn, key):
        def f(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return f

    parts = assemble.LearnerParts(BlockAllocator, BlockTable, counted(paged_attention, "full"), Scheduler,
                           counted(decode, "decode"))
    case = pa.make_case("mixed", "", [(9, 1), (5, 1), (12, 4), (6, 6)], num_heads=4, num_kv_heads=2, seed=3)
    got = parts.attention(*case.args(), num_decodes=2)
    assert torch.allclose(got, paged_attention(*case.args()), atol=2e-3, rtol=2e-3)
    assert calls == {"decode": 1, "full": 1}, calls
    parts.attention(*case.args(), num_decodes=0)
    assert calls == {"decode": 1, "full": 2}, calls


@pytest.mark.slow  # loads the model
def test_serving_check_compares_every_step(one_thread) -> None:
    """Workbook 09: parts that give the reference's greedy tokens anyway (a rejected draft changes no
    token) are still caught in the engine by the step-by-step comparison: a rollback that leaks its
    blocks, a proposer that drafts one token only. Neither is run through its own check here."""
    from minipaged.checks import spec_decode as sd

    ns = _solution("09_speculative_decoding")
    good_propose, good_table = ns["propose_ngram"], ns["MyBlockTable"]

    class Leaky(good_table):
        def truncate(self, num_tokens):
            keep = -(-num_tokens // self.block_size)
            self.blocks, self.num_tokens = self.blocks[:keep], num_tokens

    def one_token(token_ids, k, min_n, max_n):
        return good_propose(token_ids, k, min_n, max_n)[:1]

    with pytest.raises(CheckFailed, match="differs from the reference engine") as info:
        sd.check_serving(good_propose, Leaky)
    assert "must give it back with self.allocator.free(b)" in str(info.value), str(info.value)
    with pytest.raises(CheckFailed, match="your proposer gave another draft") as info:
        sd.check_serving(one_token, good_table)
    assert "Expected: [" in str(info.value), str(info.value)


def test_every_watched_workbook_plants_each_way_around_the_watch() -> None:
    """Issue 40: every workbook the delegation watch covers (WATCH) has one wrong answer per way around it
    (tests/wrong_answers/_plant.py), or says in rules_table.WATCH_PLANTS_NOT_APPLICABLE why it takes none; and an
    allow-list (ALLOW) of what it hands the learner."""
    from rules_table import WATCH_PLANTS, WATCH_PLANTS_NOT_APPLICABLE

    from minipaged.checks import _delegation
    from minipaged.checks._workbooks import WORKBOOKS

    importlib.import_module("minipaged.checks.spec_decode")  # it adds its own WATCH entry
    importlib.import_module("minipaged.checks.structured")  # so does workbook 11's
    missing = []
    for stem in WORKBOOKS:
        nn = stem[:2]
        if nn not in _delegation.WATCH:
            continue
        if nn not in _delegation.ALLOW:
            missing.append(f"minipaged/checks/_delegation.py: ALLOW[{nn!r}] (what workbook {nn} hands the learner)")
        for plant in WATCH_PLANTS:
            if f"{stem}/{plant}" not in WATCH_PLANTS_NOT_APPLICABLE and not (WRONG / stem / f"{plant}.py").is_file():
                missing.append(f"tests/wrong_answers/{stem}/{plant}.py")
    assert not missing, "missing: " + ", ".join(missing)


def test_every_workbook_plants_each_shortcut_its_inputs_allow() -> None:
    """Issue 40: the shortcuts that pass small inputs only (16-bit ids, a bounded window, an id()-keyed memo) are
    planted, one wrong answer each, in every workbook whose answer takes such an input (rules_table.INPUT_PLANTS),
    and the table says which take none."""
    from rules_table import INPUT_PLANTS, INPUT_PLANTS_NOT_APPLICABLE, NOT_A_RULE, RULES

    from minipaged.checks._workbooks import WORKBOOKS

    in_table = {f"{r.workbook}/{r.wrong}" for r in RULES} | NOT_A_RULE
    missing = []
    for plant, where in INPUT_PLANTS.items():
        for stem in WORKBOOKS:
            if stem in where:
                path = WRONG / stem / f"{where[stem]}.py"
                if not path.is_file() or f"{stem}/{where[stem]}" not in in_table:
                    missing.append(f"{path.relative_to(ROOT)} (in the rule table)")
            elif (plant, stem) not in INPUT_PLANTS_NOT_APPLICABLE:
                missing.append(f"{plant} for {stem}: plant it, or say in INPUT_PLANTS_NOT_APPLICABLE why it does not apply")
    assert not missing, "missing: " + ", ".join(missing)


def test_work_handed_to_a_pool_started_before_the_check_is_refused() -> None:
    """A pool of the learner's whose threads started before the check, idle (nothing of the learner's on their
    stack), handed the reference's work during the check: refused. A pool started inside the learner's call is
    watched from its start, and passes."""
    import concurrent.futures

    from minipaged.checks import block_allocator

    good = _solution("02_block_allocator")["MyBlockAllocator"]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    pool.submit(lambda: None).result()  # its thread runs now, idle

    class HandsOver(good):
        def allocate(self):
            return pool.submit(super().allocate).result()

    class OwnPool(good):
        def allocate(self):
            with concurrent.futures.ThreadPoolExecutor(2) as mine:
                return list(mine.map(lambda _: super(OwnPool, self).allocate(), [0]))[0]

    try:
        with pytest.raises(CheckFailed, match="handed work to a ThreadPoolExecutor"):
            block_allocator.check_allocate_free(HandsOver)
    finally:
        pool.shutdown()
    block_allocator.check_allocate_free(OwnPool)


def test_workbook_10_is_found_by_its_number() -> None:
    from minipaged.checks._workbooks import identify, learner_from_name

    assert identify("alice_10_predict_and_measure.ipynb") == "10_predict_and_measure"
    assert identify("10 (bob).ipynb") == "10_predict_and_measure"
    assert learner_from_name("10 (bob).ipynb", None) == "bob"
    assert identify("bob_02.ipynb") == "02_block_allocator"


def test_workbook_10_ledger_check_runs_measure_pair_and_refuses_a_contradicting_verdict() -> None:
    """The ledger check given the learner's measure_pair runs it on each arm (fake engines here: it
    times generate) and verifies the method; a measure_pair whose verdict its interval contradicts fails."""

    from minipaged.checks import predict as pm

    class FakeLLM:
        def generate(self, prompts, params):
            return [type("O", (), {"outputs": [type("C", (), {"token_ids": [1, 2]})()]})() for _ in prompts]

    def measure_pair(name, make_control, make_treatment, prompts, params, repeats=3):
        c, t = [], []
        for _ in range(repeats):
            c.append(pm.ledger_run("control", make_control, prompts, params))
            t.append(pm.ledger_run("treatment", make_treatment, prompts, params))
        iv = pm.ref_speedup_interval([r.seconds for r in c], [r.seconds for r in t])
        return {"optimisation": name, "control": c, "treatment": t, "interval": iv, "verdict": pm.ref_verdict(*iv)}

    base = _load(WRONG / "10_predict_and_measure" / "_base.py")
    arms = [(n, FakeLLM, FakeLLM, [[1, 2, 3]], "params") for n in ("prefix caching", "speculative decoding")]
    with contextlib.redirect_stdout(io.StringIO()):
        ledger = pm.check_ledger(measure_pair, base.speedup_interval, base.verdict, arms=arms)
    assert [e["optimisation"] for e in ledger] == ["prefix caching", "speculative decoding"]

    def lying(*a):
        e = measure_pair(*a)
        return dict(e, verdict={"keep": "reject"}.get(e["verdict"], "keep"))

    with pytest.raises(CheckFailed, match="contradicts its interval"):
        pm.check_ledger(lying, base.speedup_interval, base.verdict, arms=arms)


def test_a_module_fingerprinted_while_it_is_still_being_imported_is_read_again_once_imported():
    """The watch runs during imports, so the copy finder can meet a package module half executed. It
    must not mark that module done: a function defined after that moment would never be fingerprinted,
    and its copy, compiled again under a learner's file, would pass (it did, when the rules ran first)."""
    import importlib.machinery
    import types

    from minipaged.checks import _delegation

    name = "minipaged._half_imported_for_a_test"
    src = ("def late(a, b):\n    total, seen = 0, {}\n    for i in range(a):\n        seen[i % 7] = seen.get(i % 7, 0) + b\n"
           "        total += i * b - (i % 3) + seen[i % 7] // 2\n        if total > 10_000:\n            total -= a * b\n"
           "    return total, sorted(seen.items())\n")
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__spec__._initializing = True
    sys.modules[name] = mod
    try:
        _delegation.package_fingerprints()                  # met mid-import: nothing of it is defined yet
        exec(compile(src, os.path.join(os.path.dirname(_delegation.__file__), "_half_imported.py"), "exec"), mod.__dict__)
        mod.late.__module__ = name
        mod.__spec__._initializing = False                  # the import completes
        copy = {}
        exec(compile(src, "my_copy.py", "exec"), copy)
        assert _delegation.package_copy(copy["late"].__code__) == f"{name}.late"
    finally:
        del sys.modules[name]


@pytest.mark.slow  # loads the model and serves it twice
def test_the_engine_rows_situations_are_built_by_the_solution_run(tmp_path, one_thread) -> None:
    """Issue 40 for workbook 07's rows, whose check needs the model (tests/test_rules.py records the rest):
    the solved parts served by check_engine build every situation those rows name."""
    if hasattr(BlockTable, "as_tensor"):
        pytest.skip("needs the engine that serves Protocol-only parts")
    from rules_table import RULES

    from minipaged.checks import assemble
    from minipaged.checks._core import recording_situations

    folder = _parts_folder(tmp_path)
    with recording_situations() as built, contextlib.redirect_stdout(io.StringIO()):
        assemble.load_parts(folder)
        assemble.check_engine(_build_engine, folder)
    for rule in (r for r in RULES if r.workbook == "07_assemble"):
        missing = sorted(set(rule.situations) - built)
        assert not missing, f"07:{rule.wrong} names {missing}, which the solution run did not build ({sorted(built)})"
