"""The checks in minipaged.checks: the reference passes them, stubs are named, endless loops
are stopped, and every typical wrong answer in tests/wrong_answers/ is rejected with the
message it is meant to get. The checks are called directly (no notebooks): this is fast.

A wrong answer is a small file in tests/wrong_answers/NN_workbook/ with CHECK
("module:function"), EXPECT (phrases the message must contain, case-insensitive) and the
answer: the names starting with My/my_ (or an ``answer()`` function returning the
arguments). Files starting with "_" are shared helpers, not wrong answers. Workbook 07's
wrong answers name a ``build_engine`` and how the learner's folder differs (DROP, EDIT).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
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
from minipaged.checks._core import run_with_time_limit  # noqa: E402


def _wrong_answer_files() -> list[Path]:
    return sorted(p for p in WRONG.glob("*/*.py") if not p.name.startswith("_"))


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
    module, fn_name = mod.CHECK.split(":")
    check = getattr(importlib.import_module(module), fn_name)
    kwargs = getattr(mod, "KWARGS", {})
    if path.parent.name.startswith("07_"):
        request.getfixturevalue("one_thread")
        folder = _learner_folder(tmp_path, mod)
        args = (mod.build_engine, folder) if fn_name == "check_engine" else (folder,)
    else:
        args = _answer(mod)
    with pytest.raises(CheckFailed) as info:
        check(*args, **kwargs)
    msg = str(info.value)
    if hasattr(mod, "ERROR"):
        assert type(info.value).__name__ == mod.ERROR, msg
    else:
        assert not isinstance(info.value, (NotImplementedYet, CheckTimeout)), msg
    missing = [e for e in mod.EXPECT if e.lower() not in msg.lower()]
    assert not missing, f"{path.name}: the message lacks {missing}:\n\n{msg}"


def test_every_workbook_has_three_wrong_answers() -> None:
    stems = ["01_kv_cache_math", "02_block_allocator", "03_block_table", "04_paged_attention_torch",
             "05_triton_decode_kernel", "06_scheduler", "07_assemble"]
    for stem in stems:
        n = len([p for p in (WRONG / stem).glob("*.py") if not p.name.startswith("_")])
        assert n >= 3, f"tests/wrong_answers/{stem}/ has {n} wrong answers; keep at least 3"


# -- the reference passes --------------------------------------------------------------------------
class _RefScheduler(Scheduler):
    def add_request(self, seq):
        return super().add_request(seq)

    def schedule(self):
        return super().schedule()

    def _preempt(self, seq):
        return super()._preempt(seq)


def test_reference_passes_every_check(capsys) -> None:
    k = kv_cache_math
    k.check(k.ref_bytes_per_token, k.ref_bytes_per_sequence, k.ref_max_seqs_contiguous, k.ref_max_seqs_paged)
    block_allocator.check(BlockAllocator)
    block_table.check(BlockTable)
    pa.check(gather_kv, paged_attention)
    scheduler.check(_RefScheduler)
    out = capsys.readouterr().out
    assert out.count("\u2714") == 13, out


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
    class Crashy(BlockAllocator):
        def free(self, block_id):
            return self.ref_count[block_id]  # a learner's typo: a method, not the list

    with pytest.raises(CheckFailed) as info:
        block_allocator.check_allocate_free(Crashy)
    msg = str(info.value)
    assert "crashed with TypeError" in msg and "self.ref_count[block_id]" in msg, msg
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
    from minipaged.checks import assemble
    from minipaged.engine import LLM

    folder = tmp_path / "learner"
    folder.mkdir()
    for stem in ("02_block_allocator", "03_block_table", "04_paged_attention_torch", "06_scheduler"):
        shutil.copy(SOLUTIONS / f"{stem}.ipynb", folder)
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

    def build_engine(model, tokenizer, parts, **engine_args):
        return LLM(model, tokenizer, allocator_cls=parts.allocator_cls, block_table_cls=parts.block_table_cls,
                   scheduler_cls=parts.scheduler_cls, attention=parts.attention, **engine_args)

    with pytest.raises(CheckFailed, match="differ from the reference engine") as info:
        assemble.check_engine(build_engine, folder)
    assert "with minipaged's attention (04/05) instead of yours, the answers match" in str(info.value)
