"""Checks for workbook 03: a learner's block table against minipaged.BlockTable.

Each side gets its own reference BlockAllocator, so only the table is under test. Both
are driven through the same seeded appends (often right at, just short of or just past a
block boundary, and up to SmolLM2's max_model_len), slot-mapping queries and frees; after
every operation every table's blocks and token count, and the pool's free count and ref
counts, must agree. free() may give the blocks back in any order:
the check records the order the learner's table gave them back in and frees the reference's
in that same order, so the block ids handed out later are still compared exactly. A forked
table (``parts.fork_table``) shares its blocks: free() drops one reference to each.
Only the members of ``minipaged.interfaces.BlockTableProtocol`` are used, and minipaged's
own BlockTable in the learner's place (an alias, a subclass, a wrapper) is refused.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from .. import parts
from ..block_allocator import BlockAllocator, OutOfBlocksError
from ..block_table import BlockTable
from ..interfaces import BlockTableProtocol
from ._core import (
    DEFAULT_TIMEOUT_S,
    CheckFailed,
    Log,
    _qualname,
    builds,
    failure,
    fmt_list,
    learner_call,
    not_implemented,
    passed,
    plural,
    table,
    watching,
)
from ._delegation import refuse_package_class, run_guarded
from ._core import length_situations

NAME = "03 block table"
LONG = 8192  # SmolLM2's max_model_len (max_position_embeddings): the longest sequence a table serves there
MUST_WRITE = ("blocks_needed", "append_tokens", "slot_mapping", "free")

class _RecordingPool(BlockAllocator):
    """minipaged's pool, recording the order in which blocks are given back (for free() in any order)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.freed: list = []

    def free(self, block_id: int) -> None:
        super().free(block_id)
        self.freed.append(block_id)


_n = plural


def _scattered(blocks: list) -> bool:
    """True when a table's physical blocks are not one consecutive run: logical order is not physical order."""
    return bool(blocks) and blocks != list(range(blocks[0], blocks[0] + len(blocks)))


def page_table_picture(exp_blocks: list, got_blocks: list, title: str = "") -> str:
    n = max(len(exp_blocks), len(got_blocks), 1)
    cols = list(range(min(n, 20)))
    rows = [
        ["logical block"] + [str(i) for i in cols],
        ["expected physical"] + [str(exp_blocks[i]) if i < len(exp_blocks) else "-" for i in cols],
        ["your physical"] + [str(got_blocks[i]) if i < len(got_blocks) else "-" for i in cols],
        [""] + ["^" if (exp_blocks[i] if i < len(exp_blocks) else None) != (got_blocks[i] if i < len(got_blocks) else None)
                else "" for i in cols],
    ]
    more = f"\n    ... {n - 20} more logical blocks" if n > 20 else ""
    return (title + "\n" if title else "") + table(rows) + more


class _Run:
    def __init__(self, cls: type, num_blocks: int, block_size: int, num_tables: int, label: str, stats: dict) -> None:
        self.cls, self.label, self.stats = cls, label, stats
        self.bs = block_size
        self.ref_alloc = BlockAllocator(num_blocks, block_size)
        self.my_alloc = _RecordingPool(num_blocks, block_size)
        self.log = Log([f"from minipaged import BlockAllocator",
                        f"pool = BlockAllocator(num_blocks={num_blocks}, block_size={block_size})"])
        self.ref: list[BlockTable | None] = []
        self.mine: list = []
        self.forked: set = set()  # tables made by parts.fork_table: their blocks and num_tokens were set from outside
        self.freed: set = set()  # tables freed once: used again, the same object holds new blocks
        self.answered: dict = {}  # (i, start, end) -> the slots t_i.slot_mapping(start, end) last gave, rightly
        for i in range(num_tables):
            self.ref.append(BlockTable(self.ref_alloc))
            self.mine.append(self.call(cls, self.my_alloc, what=f"{cls.__name__}(pool)"))
            self.log.add(f"t{i} = {cls.__name__}(pool)")
        self.compare("creating the tables")

    @property
    def current(self) -> str:
        return self.stats["current"]

    @current.setter
    def current(self, what: str) -> None:
        self.stats["current"] = f"{what}  ({self.label})"

    def story(self) -> str:
        return f"Run: {self.label}.\n" + self.log.render()

    def call(self, fn, *args, what: str):
        self.current = what
        return learner_call(fn, *args, what=what, context=self.story)

    def fail(self, title: str, **kw) -> CheckFailed:
        return failure(f"{NAME}: {title}", done=self.story(), **kw)

    # -- a forked table's state was set from outside its methods ----------------------------------
    def _replica(self, i: int):
        """A table of the learner's with t_i's num_tokens, reached through its own append_tokens on a scratch pool;
        None when that fails (then the fork is not shown to be the cause)."""
        n = self.ref[i].num_tokens
        try:
            t = learner_call(self.cls, BlockAllocator(-(-n // self.bs) + 4, self.bs), what=f"{self.cls.__name__}(pool)")
            if n:
                learner_call(t.append_tokens, n, what=f"append_tokens({n})")
            return t
        except CheckFailed:
            return None

    def fork_hint(self, i: int, method: str, *args) -> str:
        """The fork hint, when t_i is a fork and a table that grew to the same tokens by its own appends answers
        ``method(*args)`` right (its own blocks' slots for slot_mapping): the state the fork did not set is the cause."""
        if i not in self.forked:
            return ""
        t = self._replica(i)
        if t is None:
            return ""
        if method == "blocks":  # the state an append left: the replica's is right
            ok = len(list(getattr(t, "blocks", []))) == len(self.ref[i].blocks)
        elif method == "num_tokens":
            ok = getattr(t, "num_tokens", None) == self.ref[i].num_tokens
        else:
            try:
                got = learner_call(getattr(t, method), *args, what=f"{method}{args}")
            except CheckFailed:
                return ""
            if method == "slot_mapping":
                start, end = args
                blocks = list(getattr(t, "blocks", []))
                try:
                    ok = isinstance(got, torch.Tensor) and got.long().tolist() == [
                        blocks[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
                except (IndexError, TypeError):
                    ok = False
            else:  # blocks_needed
                ok = got == self.ref[i].blocks_needed(*args) and not isinstance(got, bool)
        if not ok:
            return ""
        what = {"blocks": "as many blocks as the reference", "num_tokens": "the right num_tokens"}.get(method, f"{method} right")
        return (f"t{i} was made by parts.fork_table, which builds a new table and sets only its blocks and num_tokens. "
                f"A table that reached the same {self.ref[i].num_tokens} tokens through its own append_tokens has "
                f"{what}; the fork has not: your table uses something else that append_tokens keeps (a count, "
                "a list of slots), which the fork never set. Work from self.blocks and self.num_tokens alone.")

    # -- state -----------------------------------------------------------------------------
    def compare(self, after: str, hint: str = "", i_focus: int | None = None, op: str = "") -> None:
        """Every table's blocks and num_tokens, then the pool; ``op`` "free" (t_{i_focus} was freed) picks its hints."""
        order = list(range(len(self.ref)))
        if i_focus is not None:
            order.remove(i_focus)
            order.insert(0, i_focus)
        for i in order:
            r, m = self.ref[i], self.mine[i]
            got_blocks = getattr(m, "blocks", None)
            got_tokens = getattr(m, "num_tokens", None)
            try:
                got_list = list(got_blocks)
            except TypeError:
                raise self.fail(f"t{i}.blocks is not a list after {after}.", expected=f"a list of block ids, {r.blocks}",
                                got=repr(got_blocks), hint="keep self.blocks as a plain list of physical block ids.") from None
            if got_list != r.blocks:
                fork_h = self.fork_hint(i, "blocks") if len(got_list) != len(r.blocks) and op != "free" else ""
                if op == "free" and i == i_focus and not r.blocks:
                    gave, listed = sorted(self.my_alloc.freed), sorted(got_list)
                    h = (f"after free() the table holds nothing: set self.blocks = [] once its blocks are given back. A "
                         "table that still lists freed blocks would free them again, or map positions into blocks another "
                         "sequence now holds.")
                    if gave != listed:
                        h += (f" Give each block back first, with allocator.free(b) once per block: your free() gave back "
                              f"{fmt_list(gave)}, the table listed {fmt_list(listed)}.")
                elif fork_h:
                    h = fork_h
                elif len(got_list) > len(r.blocks) and r.num_tokens % self.bs == 0:
                    h = (f"t{i} holds {len(got_list)} blocks for {r.num_tokens} tokens; {r.num_tokens} tokens of block size {self.bs} "
                         f"need ceil({r.num_tokens} / {self.bs}) = {len(r.blocks)}. Is your block count off by one when the tokens "
                         "end exactly at a block boundary? -(-total // block_size) rounds up without that mistake.")
                elif len(got_list) > len(r.blocks):
                    h = (f"t{i} holds {len(got_list)} blocks for {r.num_tokens} tokens; {r.num_tokens} tokens of block size {self.bs} "
                         f"need ceil({r.num_tokens} / {self.bs}) = {len(r.blocks)}. append_tokens(n) takes exactly "
                         "blocks_needed(n) blocks: the room left in the last, partly filled block is used first.")
                elif len(got_list) < len(r.blocks):
                    h = (f"t{i} holds too few blocks: {r.num_tokens} tokens need ceil({r.num_tokens} / {self.bs}) = {len(r.blocks)} "
                         "blocks of the pool. Round UP: a partly filled block is still a whole block.")
                elif sorted(got_list) == sorted(r.blocks):
                    h = (f"t{i} holds the right blocks in another order. self.blocks lists them in LOGICAL order: block i "
                         "holds positions i * block_size ... (i + 1) * block_size - 1, so the new blocks go at the END "
                         "(self.blocks.extend(new)), after the ones the table already holds.")
                else:
                    h = "take new blocks from the allocator in order (parts.allocate_many(allocator, n), or allocator.allocate() n times) and extend self.blocks."
                raise self.fail(f"t{i}'s blocks differ after {after}.",
                                expected=f"t{i}.blocks == {fmt_list(r.blocks)}, t{i}.num_tokens == {r.num_tokens}",
                                got=f"t{i}.blocks == {fmt_list(got_list)}, t{i}.num_tokens == {got_tokens!r}",
                                picture=page_table_picture(r.blocks, got_list, f"Page table of t{i}:"), hint=hint or h)
            if got_tokens != r.num_tokens:
                raise self.fail(f"t{i}.num_tokens differs after {after}.",
                                expected=f"{r.num_tokens}", got=f"{got_tokens!r}",
                                hint=("after free() the table holds no tokens: set self.num_tokens = 0 as well as emptying "
                                      "self.blocks (a reused table would otherwise count its old tokens)."
                                      if op == "free" and i == i_focus else "")
                                or hint or self.fork_hint(i, "num_tokens") or
                                "append_tokens(n) adds n to num_tokens (after taking the blocks); free() sets it back to 0.")
        mine_rc, ref_rc = parts.ref_counts(self.my_alloc), parts.ref_counts(self.ref_alloc)
        if self.my_alloc.num_free_blocks != self.ref_alloc.num_free_blocks or mine_rc != ref_rc:
            leaked = [b for b in range(self.ref_alloc.num_blocks) if mine_rc[b] > ref_rc[b]]
            over = [b for b in range(self.ref_alloc.num_blocks) if mine_rc[b] < ref_rc[b]]
            if over and not leaked and not hint:
                hint = (f"block(s) {fmt_list(over)} lost a reference that another table still holds (ref counts now "
                        f"{fmt_list(mine_rc[b] for b in over)}, expected {fmt_list(ref_rc[b] for b in over)}). A table may "
                        "share its blocks (a forked sequence): free() calls allocator.free(b) exactly once per block, "
                        "whatever the block's ref count.")
            raise self.fail(
                f"the pool differs after {after}.",
                expected=f"pool.num_free_blocks == {self.ref_alloc.num_free_blocks}",
                got=f"{self.my_alloc.num_free_blocks}" + (f" (blocks {fmt_list(leaked)} are still taken)" if leaked else ""),
                hint=hint or ("a table must give every block back with allocator.free(b) when it is freed; clearing self.blocks "
                              "alone leaks them, and the pool slowly runs dry." if leaked else
                              "take blocks only through the allocator, and only as many as blocks_needed(n) says."),
            )

    # -- operations ------------------------------------------------------------------------
    def situations(self, i: int, length: int) -> None:
        """Record what a call on t_i that reaches ``length`` tokens (or positions) puts the learner's table in."""
        builds(*length_situations(length, self.bs, LONG))
        if i in self.forked:
            builds("forked table")
        if i in self.freed:
            builds("reused object")
        if _scattered(self.ref[i].blocks):
            builds("out-of-order blocks")

    def pick_n(self, rng: random.Random, i: int) -> int:
        used = self.ref[i].num_tokens
        to_boundary = (-used) % self.bs
        choice = rng.random()
        if choice < 0.25:
            return to_boundary or self.bs  # end exactly on a boundary
        if choice < 0.45:
            return to_boundary + 1  # one past it
        if choice < 0.6:
            return 1
        if choice < 0.65:
            return 0
        return rng.randint(1, 2 * self.bs + 3)

    def blocks_needed(self, i: int, n: int) -> None:
        self.situations(i, self.ref[i].num_tokens + n)
        exp = self.ref[i].blocks_needed(n)
        got = self.call(self.mine[i].blocks_needed, n, what=f"t{i}.blocks_needed({n})")
        if got != exp or isinstance(got, bool):
            r = self.ref[i]
            total = r.num_tokens + n
            fork_h = self.fork_hint(i, "blocks_needed", n)
            raise self.fail(
                f"t{i}.blocks_needed({n}) differs.",
                expected=f"{exp}: t{i} holds {_n(len(r.blocks), 'block')} for {_n(r.num_tokens, 'token')}; {r.num_tokens} + {n} = {total} "
                         f"tokens need ceil({total} / {self.bs}) = {-(-total // self.bs)} blocks in all, so {exp} more",
                got=f"{got!r}",
                hint=fork_h or "blocks in all = ceil((num_tokens + n) / block_size), then subtract the blocks already held (never "
                     "below 0). " + ("Watch the exact boundary: 0 tokens need no block at all. " if total == 0 else
                                     f"Watch the exact boundary: {total} tokens in blocks of {self.bs} fill exactly "
                                     f"{total // self.bs} block(s), as 16 tokens in blocks of 16 fill one. " if total % self.bs == 0
                                     else f"Round UP: {total} tokens leave the last block partly filled, and it is still a "
                                          "whole block. ") + "-(-x // b) is ceil(x / b) on ints.",
            )

    def append(self, i: int, n: int) -> None:
        r = self.ref[i]
        need = r.blocks_needed(n)
        what = f"t{i}.append_tokens({n})"
        self.situations(i, r.num_tokens + n)
        if n == 0:
            builds("empty")
        if need > self.ref_alloc.num_free_blocks:
            builds("full pool", "exception type")
            self.log.add(f"{what}  # needs {need} blocks, only {self.ref_alloc.num_free_blocks} free: must raise OutOfBlocksError")
            self.current = what
            try:
                with watching(what):
                    self.mine[i].append_tokens(n)
            except NotImplementedError as e:
                raise not_implemented(_qualname(e.__traceback__)) from None
            except OutOfBlocksError:
                pass
            except Exception as e:
                if type(e).__name__ == "OutOfBlocksError":
                    h = ("your OutOfBlocksError is a class of your own with minipaged's name, and the check asks for "
                         "minipaged's: import it (from minipaged import OutOfBlocksError) instead of defining it.")
                elif isinstance(e, MemoryError):
                    h = (f"{type(e).__name__} is not OutOfBlocksError (OutOfBlocksError is a MemoryError, not the other way "
                         "round): the rule names OutOfBlocksError, the error that says the pool is full. Raise it yourself "
                         "(from minipaged import OutOfBlocksError).")
                else:
                    h = "check `need > allocator.num_free_blocks` before taking any block and raise OutOfBlocksError."
                raise self.fail(f"{what} raised the wrong exception when the pool ran out.",
                                expected="OutOfBlocksError (from minipaged import OutOfBlocksError)",
                                got=f"{type(e).__name__}: {e}", hint=h) from e
            else:
                raise self.fail(f"{what} did not raise although the pool is short of blocks.",
                                expected=f"OutOfBlocksError: {need} blocks needed, {self.ref_alloc.num_free_blocks} free",
                                got="it returned normally",
                                hint="the scheduler relies on this error (or on checking blocks_needed first) to preempt.")
            self.stats["ops"] += 1
            self.compare(f"{what} ran out of blocks", i_focus=i,
                         hint="all or nothing: when the pool cannot give every block needed, raise BEFORE taking any, so the "
                              "table and the pool stay exactly as they were.")
            return
        exp_new = r.append_tokens(n)
        if _scattered(r.blocks):  # the new blocks are not the ones right after the old: order matters now
            builds("out-of-order blocks")
        got_new = self.call(self.mine[i].append_tokens, n, what=what)
        self.log.add(f"{what}  # -> {exp_new} expected; now {_n(r.num_tokens, 'token')} in {_n(len(r.blocks), 'block')}")
        self.stats["ops"] += 1
        self.compare(what, i_focus=i)
        try:
            got_list = list(got_new)
        except TypeError:
            got_list = None
        if got_list != exp_new:
            raise self.fail(f"{what} returned the wrong list of new blocks.", expected=f"{exp_new}", got=f"{got_new!r}",
                            hint="return the blocks this call took (an empty list when none was needed).")

    def slots(self, i: int, start: int, end: int) -> None:
        r = self.ref[i]
        what = f"t{i}.slot_mapping({start}, {end})"
        self.situations(i, end)
        if start:
            builds(*length_situations(start, self.bs, LONG))
        if start == end:
            builds("empty")
        exp = r.slot_mapping(start, end)
        got = self.call(self.mine[i].slot_mapping, start, end, what=what)
        self.log.add(f"{what}")
        self.stats["ops"] += 1
        if not isinstance(got, torch.Tensor):
            raise self.fail(f"{what} must return a torch tensor.", expected=f"tensor({exp.tolist()})",
                            got=f"{got!r} ({type(got).__name__})",
                            hint="build it with torch.tensor(...) or torch.arange(...) and return it; dtype torch.int64.")
        if got.dtype.is_floating_point or got.dtype == torch.bool:
            raise self.fail(f"{what} returned {got.dtype}; slots index the cache, so they must be integers.",
                            expected="dtype torch.int64", got=str(got.dtype),
                            hint=("an empty range has no slots, and torch.tensor([]) is float32 unless you give it "
                                  "dtype=torch.int64." if start == end and got.dtype == torch.float32
                                  else "use integer ops: // and %, not /."))
        if tuple(got.shape) != tuple(exp.shape):
            h = self.fork_hint(i, "slot_mapping", start, end)
            n_got = got.shape[0] if got.dim() == 1 else None
            if h:
                pass
            elif n_got is not None and abs(n_got - (end - start)) == 1:
                h = (f"{n_got} slots for the {end - start} positions {start}..{end - 1}: end is exclusive, like "
                     "range(start, end), and start is included.")
            elif n_got is not None and 0 < n_got < end - start and got.long().tolist() == exp[:n_got].tolist():
                h = (f"your slots are right up to position {start + n_got - 1}, then stop: something in your slot_mapping "
                     f"holds only {start + n_got} positions (a fixed-size table or window?). A sequence runs to the model's "
                     "max_model_len (8192 for SmolLM2), so compute the slots of every position from self.blocks.")
            else:
                h = (f"one slot per position: slot_mapping({start}, {end}) returns a 1-D tensor of {end - start} slots, "
                     "computed from self.blocks and the block size.")
            raise self.fail(f"{what} has the wrong shape.", expected=f"shape {tuple(exp.shape)} (one slot per position {start}..{end - 1})",
                            got=f"shape {tuple(got.shape)}", hint=h)
        if not torch.equal(got.long(), exp):
            positions = list(range(start, end))
            bad = [k for k in range(len(positions)) if int(got[k]) != int(exp[k])]
            k = bad[0]
            p = positions[k]
            shown = range(max(0, k - 3), min(len(positions), k + 5))
            pic = table([["position"] + [str(positions[j]) for j in shown],
                         ["expected slot"] + [str(int(exp[j])) for j in shown],
                         ["your slot"] + [str(int(got[j])) for j in shown],
                         [""] + ["^" if j in bad else "" for j in shown]])
            blk, off = p // self.bs, p % self.bs
            gv = int(got[k])
            fork_h = self.fork_hint(i, "slot_mapping", start, end)
            before = self.answered.get((i, start, end))
            if fork_h:
                h = fork_h
            elif i in self.freed and before is not None and got.long().tolist() == before:
                h = (f"these are the slots t{i}.slot_mapping({start}, {end}) gave before t{i} was freed; since then it grew "
                     "again in other blocks. Something keeps answers from before (a memo keyed by the range, by the "
                     "table or by id()): compute the slots from self.blocks and self.num_tokens as they are now.")
            elif gv == p:
                h = ("your slot equals the position itself: the table was not used. The slot lives in the PHYSICAL block: "
                     "blocks[pos // block_size] * block_size + pos % block_size.")
            elif gv % self.bs != off:
                h = f"the offset inside the block is wrong: it is pos % block_size = {off}, added to physical block * block_size."
            else:
                h = ("position p is in logical block p // block_size at offset p % block_size; its slot is "
                     "blocks[p // block_size] * block_size + p % block_size.")
            raise self.fail(
                f"{what}: position {p} maps to the wrong slot.",
                expected=f"slot {int(exp[k])} = physical block {r.blocks[blk]} (t{i}.blocks[{blk}]) * {self.bs} + offset {off}",
                got=f"slot {gv}",
                picture=pic + f"\n\nt{i}'s page table (the same on both sides):\n" + table(
                    [["logical block"] + [str(j) for j in range(len(r.blocks))],
                     ["physical block"] + [str(b) for b in r.blocks]]),
                hint=h,
            )
        self.answered[(i, start, end)] = exp.tolist()

    def free(self, i: int) -> None:
        what = f"t{i}.free()"
        held = list(self.ref[i].blocks)
        shared = [b for b in held if self.ref_alloc.ref_count(b) > 1]
        if shared:
            builds("shared block")
        if not held:
            builds("empty")
        self.my_alloc.freed = []
        self.call(self.mine[i].free, what=what)
        order = list(self.my_alloc.freed)
        if sorted(order) == sorted(held):
            # Any order is right: the reference gives its blocks back in yours, so later ids still match.
            for b in order:
                self.ref_alloc.free(b)
            self.ref[i].blocks = []
            self.ref[i].num_tokens = 0
        else:
            self.ref[i].free()
        self.freed.add(i)
        note = f"; blocks {shared} stay held by another table" if shared else ""
        self.log.add(f"{what}  # gives back {held}{note}")
        self.stats["ops"] += 1
        self.compare(what, i_focus=i, op="free", hint=(
            f"free() must hand each of the table's blocks ({held}) back with allocator.free(b), once per block, then empty "
            "self.blocks and set num_tokens to 0. Clearing the list alone leaks the blocks: the pool never sees them again."
            if not shared and sorted(order) != sorted(held) else ""))

    def fork(self, i: int) -> None:
        """t_new = parts.fork_table(t_i) on both sides: a second table sharing every block of t_i."""
        j = fork_both(self, i, "parts.fork_table", ": each ref count is now 2")
        self.forked.add(j)
        builds("forked table")
        if self.ref[i].blocks:
            builds("shared block")
        self.compare(f"t{j} = parts.fork_table(t{i})", i_focus=j)


def fork_both(run: Any, i: int, spelled: str, note: str = "") -> int:
    """``t_j = fork_table(t_i)`` on the reference's tables (``run.ref``) and the learner's
    (``run.mine``, through ``run.call``), logged as ``spelled``; returns ``j``."""
    j = len(run.ref)
    run.ref.append(parts.fork_table(run.ref[i]))
    run.mine.append(run.call(parts.fork_table, run.mine[i], what=f"t{j} = {spelled}(t{i})"))
    run.log.add(f"t{j} = {spelled}(t{i})  # shares blocks {run.ref[i].blocks}{note}")
    run.stats["ops"] += 1
    return j


def _check(cls: type, part: str, seed: int, runs: int, timeout: float, title: str) -> None:
    refuse_package_class(cls, MUST_WRITE, NAME, "block table")
    try:
        parts.check_part(cls, BlockTableProtocol, "block table")
    except TypeError as e:
        raise CheckFailed(f"{NAME}: {e}. Keep the members the workbook's skeleton gives.") from None
    stats = {"ops": 0, "runs": 0, "current": f"creating a {cls.__name__}"}

    def _body():
        builds("package code in place")  # every call of the learner's below is watched (run_guarded)
        # Fixed stories first: they are short, so their failure messages are easy to read.
        r = _Run(cls, 6, 4, 1, "block size 4: 4 tokens fill one block exactly, the 5th opens a second", stats)
        for n in (0, 1, 3, 4, 5):
            r.blocks_needed(0, n)
        r.append(0, 4)
        r.blocks_needed(0, 0)
        r.blocks_needed(0, 1)
        r.append(0, 1)
        if part == "growth":
            r6 = _Run(cls, 8, 4, 1, "a forked table (parts.fork_table sets only its blocks and num_tokens) grows from there",
                      stats)
            r6.append(0, 6)
            r6.fork(0)
            for n in (0, 1, 2, 3):
                r6.blocks_needed(1, n)
            r6.append(1, 3)
            r6.blocks_needed(1, 4)
            r6.append(1, 4)
            r8 = _Run(cls, LONG // 16 + 1, 16, 2, f"in blocks of 16, t0 grows to {LONG} tokens (SmolLM2's max_model_len) "
                      "beside t1's block, until the pool is full", stats)
            for n in (15, 16, 17):  # 16 tokens in blocks of 16 fill exactly one block
                r8.blocks_needed(0, n)
            r8.append(0, 16)
            r8.append(1, 1)  # t1 takes the next block, so t0's blocks are not one run
            r8.blocks_needed(0, LONG - 17)
            r8.append(0, LONG - 17)  # one short of max_model_len: every block of the pool is taken
            r8.blocks_needed(0, 1)
            r8.append(0, 1)  # exactly max_model_len: the last block fills, no new one
            r8.blocks_needed(1, 16)
            r8.append(1, 16)  # t1 needs a second block: the pool has none
        if part in ("slots", "free"):
            r2 = _Run(cls, 8, 4, 2, "two tables interleave, so their blocks are not in order", stats)
            r2.append(0, 3)
            r2.append(1, 5)
            r2.append(0, 6)
            r2.slots(0, 0, 9)
            r2.slots(1, 2, 5)
            r2.slots(0, 4, 9)
            r2.slots(0, 4, 4)  # an empty range: no slots, still an int64 tensor
            r5 = _Run(cls, 8, 4, 1, "a forked table (parts.fork_table) maps positions through the blocks it shares", stats)
            r5.append(0, 6)
            r5.fork(0)
            r5.slots(1, 0, 6)
            r5.append(1, 3)
            r5.slots(1, 3, 9)
            r5.slots(0, 0, 6)
            if part == "free":
                r2.free(1)
                r2.append(0, 8)
                r2.free(0)
                r4 = _Run(cls, 8, 4, 1, "a forked table shares its blocks (parts.fork_table): free() drops one reference "
                          "each; t0 is used again after its free()", stats)
                r4.append(0, 6)
                r4.slots(0, 0, 5)
                r4.fork(0)
                r4.free(0)
                r4.append(1, 3)
                r4.free(1)
                r4.append(0, 5)  # the same t0 again, with new blocks: nothing kept from before its free() may answer
                r4.slots(0, 0, 5)
        if part == "slots":
            r7 = _Run(cls, LONG // 16 + 3, 16, 2,
                      f"a sequence of {LONG} tokens (SmolLM2's max_model_len) in blocks of 16, after another table's 2 blocks",
                      stats)
            r7.append(1, 20)
            r7.append(0, LONG - 5)
            r7.append(0, 5)
            r7.slots(0, 0, LONG)
            r7.slots(0, LONG - 40, LONG)
        r3 = _Run(cls, 2, 4, 1, "the pool runs out: the append must take nothing", stats)
        r3.append(0, 5)
        r3.append(0, 4)
        rng = random.Random(seed)
        for k in range(runs):
            builds("random stories")
            bs = rng.choice([1, 2, 4, 8, 16])
            num_tables = rng.randint(1, 3)
            pool = rng.randint(2, 4 + k)
            run = _Run(cls, pool, bs, num_tables, f"random run {k + 1} of {runs} (seed {seed})", stats)
            for _ in range(8 + 2 * k):
                i = rng.randrange(num_tables)
                u = rng.random()
                if part == "free" and u < 0.15:
                    run.free(i)
                elif part == "free" and u < 0.2 and run.ref[i].num_tokens > 0 and len(run.ref) < 5:
                    run.fork(i)  # a second table shares t_i's blocks; both are freed later in the run
                    if rng.random() < 0.5:
                        run.free(len(run.ref) - 1)
                elif part in ("slots", "free") and u < 0.45 and run.ref[i].num_tokens > 0:
                    a = rng.randint(0, run.ref[i].num_tokens)
                    b = rng.randint(a, run.ref[i].num_tokens)
                    run.slots(i, a, b)
                else:
                    n = run.pick_n(rng, i)
                    run.blocks_needed(i, n)
                    run.append(i, n)
            stats["runs"] += 1

    run_guarded("03", NAME, _body, timeout, stats)
    passed(f"{title}: {stats['runs']} random runs, {stats['ops']} operations; after every one your tables' blocks, "
           "token counts and the pool matched the reference.")


def check_growth(cls: type, seed: int = 0, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """blocks_needed() and append_tokens(): whole blocks, the exact boundary, all or nothing."""
    _check(cls, "growth", seed, runs, timeout, "growth")


def check_slot_mapping(cls: type, seed: int = 1, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """slot_mapping(start, end) through tables whose blocks are out of order."""
    _check(cls, "slots", seed, runs, timeout, "slot mapping")


def check_free(cls: type, seed: int = 2, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """free(): every block back to the pool, the table empty and reusable."""
    _check(cls, "free", seed, runs, timeout, "freeing")


def check(cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    check_growth(cls, timeout=timeout)
    check_slot_mapping(cls, timeout=timeout)
    check_free(cls, timeout=timeout)


__all__ = ["check", "check_growth", "check_slot_mapping", "check_free", "page_table_picture"]
