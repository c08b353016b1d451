"""Checks for workbook 02: a learner's block allocator against minipaged.BlockAllocator.

Both are driven through the same seeded operations (allocate, free, incref, misuse), and
after every operation the returned block id, ``num_free_blocks`` and every ``ref_count(b)``
must agree. The first difference stops the check with the replayable story and a hint.
Only the members of ``minipaged.interfaces.BlockPool`` are used: how the learner keeps the
free list and the counts is theirs. minipaged's own BlockAllocator in the learner's place
(an alias, a subclass, a wrapper) is refused.
"""
from __future__ import annotations

import random
from typing import Any

from collections import deque

from ..block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError
from ..interfaces import BlockPool
from ._core import (
    DEFAULT_TIMEOUT_S,
    CheckFailed,
    Log,
    builds,
    failure,
    fmt_list,
    learner_call,
    not_implemented,
    plain,
    passed,
    table,
    watching,
    _qualname,
)
from ._delegation import refuse_package_class, run_guarded

NAME = "02 block allocator"

class _Run:
    """One pool driven on both sides: ``ref`` (the reference) and ``mine`` (the learner's)."""

    def __init__(self, cls: type, num_blocks: int, block_size: int, label: str, stats: dict) -> None:
        self.cls, self.label, self.stats = cls, label, stats
        self.num_blocks = num_blocks
        self.log = Log([f"a = {cls.__name__}(num_blocks={num_blocks}, block_size={block_size})"])
        self.current = f"{cls.__name__}(num_blocks={num_blocks}, block_size={block_size})"
        self.ref = BlockAllocator(num_blocks, block_size)
        self.ref_free_order: deque = deque(range(num_blocks))  # the reference's free list, followed from outside
        # The free lists two queue mistakes would keep (each falsified as soon as it predicts another block than the
        # learner's, who matched the reference so far): allocate() from the back, or free() to the front.
        self.wrong_orders: dict = {"takes_back": deque(range(num_blocks)), "frees_front": deque(range(num_blocks))}
        self.mine = self.call(cls, num_blocks, block_size, what=self.current)
        self.held: list[int] = []  # one entry per reference a "block table" holds
        self.returned: set = set()  # blocks that went back to the free list: handed out again, they are reused
        self.names: dict[int, str] = {}
        self.compare("creating the allocator", op="create")

    # -- plumbing --------------------------------------------------------------------------
    def story(self) -> str:
        return f"Run: {self.label}.\n" + self.log.render()

    @property
    def current(self) -> str:
        return self.stats.get("current", "")

    @current.setter
    def current(self, what: str) -> None:
        self.stats["current"] = f"{what}  ({self.label})"

    def call(self, fn, *args, what: str):
        self.current = what
        return learner_call(fn, *args, what=what, context=self.story)

    def fail(self, title: str, **kw) -> CheckFailed:
        return failure(f"{NAME}: {title}", done=self.story(), **kw)

    def expect_error(self, fn, arg, kinds: tuple, what: str):
        """Call the learner's ``fn(arg)`` expecting an exception of ``kinds``; return it or None."""
        self.current = what
        try:
            with watching(what):
                fn(arg)
        except NotImplementedError as e:
            raise not_implemented(_qualname(e.__traceback__)) from None
        except kinds as e:
            return e
        except CheckFailed:
            raise
        except Exception as e:
            return e
        return None

    # -- state comparison ------------------------------------------------------------------
    def ref_counts_mine(self) -> list:
        out = []
        for b in range(self.num_blocks):
            out.append(self.call(self.mine.ref_count, b, what=f"a.ref_count({b})"))
        return out

    @staticmethod
    def _ref_count_hint(op: str, b: int, exp: int, got: int) -> str:
        """The hint for block ``b``'s wrong ref count, chosen by the operation that just ran."""
        if op == "allocate":
            if exp == 1:
                return (f"allocate() must set the new block's ref count to 1: one block table now holds it "
                        f"(yours says {got}).")
            return (f"allocate() changed the ref count of block {b}, which it did not hand out: it may only touch the "
                    "block it takes from the free list.")
        if op == "free":
            if exp > 0 and got == 0:
                return (f"block {b} is still held by {exp} block table(s), but your allocator counts it as free. "
                        "free() drops ONE reference; the block goes back to the free list only when its count reaches 0.")
            return "free() must lower the ref count by exactly one; a block whose count reaches 0 is free again."
        if op == "incref":
            return "incref() adds one to the block's ref count, and changes nothing else."
        if op == "misuse":
            return "a call that raises must change nothing: check for the misuse before touching any ref count."
        return ("a fresh pool has every ref count at 0." if op == "create" else
                "allocate() sets the count to 1, incref() adds one, free() takes one away.")

    def compare(self, after: str, hint: str = "", op: str = "") -> None:
        """Compare both allocators after ``after``; ``op`` (allocate, free, incref, misuse, create) picks the hint."""
        exp_free = self.ref.num_free_blocks
        got_free = learner_call(lambda: self.mine.num_free_blocks, what="a.num_free_blocks", context=self.story)
        exp_rc = [self.ref.ref_count(b) for b in range(self.num_blocks)]
        got_rc = self.ref_counts_mine()
        if got_rc != exp_rc:
            bad = [b for b in range(self.num_blocks) if got_rc[b] != exp_rc[b]]
            shown = list(range(self.num_blocks)) if self.num_blocks <= 16 else sorted(set(bad[:8]))
            pic = table(
                [["block"] + [str(b) for b in shown],
                 ["expected ref_count"] + [str(exp_rc[b]) for b in shown],
                 ["your ref_count"] + [str(got_rc[b]) for b in shown],
                 [""] + ["^" if b in bad else "" for b in shown]]
            )
            b = bad[0]
            if not hint:
                hint = self._ref_count_hint(op, b, exp_rc[b], got_rc[b])
            raise self.fail(f"ref counts differ after {after}.",
                            expected=f"a.ref_count(b) == {fmt_list(exp_rc)} for b = 0..{self.num_blocks - 1}",
                            got=f"{fmt_list(got_rc)}", picture=pic, hint=hint)
        if got_free != exp_free:
            used = [b for b in range(self.num_blocks) if exp_rc[b] > 0]
            raise self.fail(
                f"num_free_blocks differs after {after}.",
                expected=f"a.num_free_blocks == {exp_free} ({len(used)} of {self.num_blocks} blocks in use: {fmt_list(used)})",
                got=f"{got_free!r}",
                hint=hint or ("num_free_blocks is how many blocks can still be handed out: the length of your free list. "
                              "A block leaves the free list in allocate() and returns in free() only when its ref count reaches 0."),
            )

    # -- operations ------------------------------------------------------------------------
    def allocate(self) -> None:
        var = f"b{len(self.names)}"
        if self.ref.num_free_blocks == 0:
            what = "a.allocate()"
            handed: list = []
            builds("full pool", "misuse", "exception type")
            err = self.expect_error(lambda _: handed.append(self.mine.allocate()), None, (OutOfBlocksError,), what)
            self.log.add(f"a.allocate()  # the pool is full: must raise OutOfBlocksError")
            if err is None:
                got_b = plain(handed[0]) if handed else None
                if isinstance(got_b, int) and 0 <= got_b < self.num_blocks:
                    # the learner's free list was not empty: the cause is earlier, where a block in use went back to it
                    hint = (f"every block is in use, yet your allocate() handed out block {got_b} (ref count "
                            f"{self.ref.ref_count(got_b)}): your free list still held it. A block goes back to the free "
                            "list only when its ref count reaches 0, and only once: look at free() (a block freed twice, "
                            "or a shared block freed by one holder, must not go back) and at how num_free_blocks is counted.")
                else:
                    hint = ("when the free list is empty, raise OutOfBlocksError (from minipaged import OutOfBlocksError) "
                            "with a message; the scheduler catches it and preempts a sequence.")
                raise self.fail(f"{what} on a full pool did not raise.",
                                expected=f"OutOfBlocksError: all {self.num_blocks} blocks are in use",
                                got=f"it returned {got_b!r}" + (" (a block that is in use)" if isinstance(got_b, int) else ""),
                                hint=hint)
            if not isinstance(err, OutOfBlocksError):
                if type(err).__name__ == "OutOfBlocksError":
                    hint = _own_class("OutOfBlocksError")
                elif isinstance(err, IndexError):
                    hint = ("the IndexError came from taking a block off an empty free list (popleft() or pop() of an "
                            "empty deque or list): check for an empty free list first and raise OutOfBlocksError "
                            "yourself (from minipaged import OutOfBlocksError); nobody upstream catches IndexError.")
                elif isinstance(err, ValueError):
                    hint = (f"a full pool is not a misuse of a block: {type(err).__name__} (a ValueError, like "
                            "BlockAllocatorError) is for free() or incref() of a free block. Raise OutOfBlocksError "
                            "when the free list is empty: it is the one error the scheduler catches, to preempt a sequence.")
                elif isinstance(err, MemoryError):
                    hint = (f"{type(err).__name__} is not OutOfBlocksError (OutOfBlocksError is a MemoryError, not the other "
                            "way round): the rule names OutOfBlocksError, the error that says the pool is full, while a bare "
                            "MemoryError says the machine ran out. Raise OutOfBlocksError itself (from minipaged import "
                            "OutOfBlocksError).")
                else:
                    hint = (f"raise OutOfBlocksError (from minipaged import OutOfBlocksError), not {type(err).__name__}, "
                            "when the free list is empty: it is the one error the scheduler catches, to preempt a sequence.")
                raise self.fail(f"{what} on a full pool raised the wrong exception.",
                                expected="OutOfBlocksError (a MemoryError)",
                                got=f"{type(err).__name__}: {err}", hint=hint)
            self.compare("allocate() on a full pool (nothing may change)", op="misuse")
            return
        free_before = list(self.ref_free_order)
        exp = self.ref.allocate()
        if exp in self.returned:
            builds("reused object")  # a block freed earlier is handed out again, to a new holder
        self.ref_free_order.remove(exp)
        got = self.call(self.mine.allocate, what="a.allocate()")
        predicted = {k: (q[-1] if k == "takes_back" else q[0]) for k, q in self.wrong_orders.items() if q}
        self.log.add(f"{var} = a.allocate()  # -> {exp} expected")
        self.names[len(self.names)] = var
        if isinstance(got, bool) or not isinstance(got, int):
            raise self.fail("a.allocate() must return the block id, an int.",
                            expected=f"{exp}", got=f"{got!r} ({type(got).__name__})",
                            hint="return the block you took from the free list.")
        if got != exp:
            pic = f"Reference free list before this allocate (front first): {fmt_list(free_before)}"
            if 0 <= got < self.num_blocks and self.ref.ref_count(got) > 0 and got != exp:
                hint = (f"block {got} is in use (ref count {self.ref.ref_count(got)} in the reference): it was handed out twice. "
                        "A block must leave the free list when allocated and come back only when its ref count drops to 0.")
            elif got in free_before and [k for k, v in predicted.items() if v == got] == ["takes_back"]:
                hint = (f"block {got} is the BACK of the free list: your allocate() takes the block at the back (a "
                        "list's pop(), or deque.pop()). Take the FRONT instead (deque.popleft()): the free list is a "
                        "queue, so the block freed longest ago is reused first.")
            elif got in free_before and [k for k, v in predicted.items() if v == got] == ["frees_front"]:
                hint = (f"block {got} was freed most recently, and your allocate() handed it out first: your free() puts "
                        "a block that became free at the FRONT of the free list (appendleft, or insert(0, b)). Put it at "
                        "the BACK (deque.append()): the block freed last is reused last.")
            elif got in free_before:
                hint = ("the right block is the FRONT of the free list. The free list is a queue: allocate() takes from the "
                        "front (deque.popleft()), free() puts a block that became free at the BACK (deque.append()). "
                        "A list's pop() takes from the back instead.")
            else:
                hint = f"block ids are 0..{self.num_blocks - 1}, and a fresh pool hands them out in that order."
            raise self.fail("a.allocate() returned a different block.", expected=f"block {exp}", got=f"block {got}",
                            picture=pic, hint=hint)
        for k in list(self.wrong_orders):  # a mistake that would have handed out another block is not the learner's
            if predicted.get(k) == exp:
                self.wrong_orders[k].remove(exp)
            else:
                del self.wrong_orders[k]
        self.held.append(exp)
        self.stats["ops"] += 1
        self.compare(f"a.allocate() -> {exp}", op="allocate")

    def free(self, rng: random.Random) -> None:
        b = rng.choice(self.held)
        self.held.remove(b)
        shared = self.ref.ref_count(b) > 1
        if shared:
            builds("shared block")
        self.ref_free(b)
        self.call(self.mine.free, b, what=f"a.free({b})")
        note = f"  # still held {self.ref.ref_count(b)}x" if shared else ""
        self.log.add(f"a.free({b}){note}")
        self.stats["ops"] += 1
        hint = ""
        if shared:
            hint = (f"block {b} had ref count {self.ref.ref_count(b) + 1}: another block table still holds it. free() drops one "
                    "reference; only when the count reaches 0 does the block go back to the free list.")
        self.compare(f"a.free({b})" + (" of a shared block" if shared else ""), hint=hint, op="free")

    def ref_free(self, b: int) -> None:
        self.ref.free(b)
        if self.ref.ref_count(b) == 0:
            self.returned.add(b)
            self.ref_free_order.append(b)
            for k, q in self.wrong_orders.items():
                q.appendleft(b) if k == "frees_front" else q.append(b)

    def incref(self, rng: random.Random) -> None:
        b = rng.choice(sorted(set(self.held)))
        self.held.append(b)
        builds("shared block")
        self.ref.incref(b)
        self.call(self.mine.incref, b, what=f"a.incref({b})")
        self.log.add(f"a.incref({b})  # a second table shares block {b}")
        self.stats["ops"] += 1
        self.compare(f"a.incref({b})", hint="incref() adds one to the block's ref count; the free list does not change.", op="incref")

    def misuse(self, rng: random.Random, kind: str) -> None:
        free_blocks = [b for b in range(self.num_blocks) if self.ref.ref_count(b) == 0]
        if not free_blocks:
            return
        b = rng.choice(free_blocks)
        fn = self.mine.free if kind == "free" else self.mine.incref
        what = f"a.{kind}({b})"
        builds("misuse", "exception type")
        err = self.expect_error(fn, b, (BlockAllocatorError,), what)
        self.log.add(f"{what}  # block {b} is free: must raise BlockAllocatorError")
        self.stats["ops"] += 1
        why = ("a double free: two owners think they hold the block, and it would sit in the free list twice "
               "and be handed out to two sequences" if kind == "free"
               else "sharing a block nobody holds: its data could be overwritten at any time")
        if err is None:
            raise self.fail(f"{what} on a free block did not raise.",
                            expected=f"BlockAllocatorError (a ValueError): block {b} is already free (ref count 0)",
                            got="it returned normally",
                            hint=f"this is {why}. Check the ref count first and raise BlockAllocatorError "
                                 "(from minipaged import BlockAllocatorError) with a message that names the block.")
        if not isinstance(err, BlockAllocatorError):
            fix = "BlockAllocatorError yourself before touching the ref count or the free list."
            if type(err).__name__ == "BlockAllocatorError":
                hint = _own_class("BlockAllocatorError")
            elif isinstance(err, ValueError):
                hint = (f"{type(err).__name__} is not BlockAllocatorError (BlockAllocatorError is a ValueError, not the "
                        "other way round): the rule names BlockAllocatorError, the error that says the pool was misused. "
                        "Raise " + fix)
            else:
                hint = "raise " + fix
            raise self.fail(f"{what} on a free block raised the wrong exception.",
                            expected="BlockAllocatorError (a ValueError)", got=f"{type(err).__name__}: {err}", hint=hint)
        self.compare(f"{what} (which must change nothing)", op="misuse",
                     hint="check for the misuse BEFORE changing anything: a failed call must leave the allocator as it was.")


def _own_class(name: str) -> str:
    """The hint when the learner raised an exception class of their own that has minipaged's name."""
    return (f"your {name} is a class of your own with minipaged's name, and the check asks for minipaged's: import "
            f"it (from minipaged import {name}) instead of defining it.")


def _drive(cls, rng: random.Random, run: _Run, n_ops: int, sharing: bool) -> None:
    for _ in range(n_ops):
        r = rng.random()
        if not run.held or r < 0.45:
            run.allocate()
        elif r < 0.8 or not sharing:
            run.free(rng)
        elif r < 0.92:
            run.incref(rng)
        elif r < 0.96:
            run.misuse(rng, "free")
        else:
            run.misuse(rng, "incref")


def _scenarios(cls, stats, sharing: bool) -> None:
    r = _Run(cls, 4, 16, "a fresh pool hands out 0, 1, 2, 3, then is full", stats)
    for _ in range(5):
        r.allocate()
    r = _Run(cls, 5, 4, "freed blocks go to the back of the free list", stats)
    for _ in range(3):
        r.allocate()
    for b in (1, 0):
        r.held.remove(b)
        r.ref_free(b)
        r.call(r.mine.free, b, what=f"a.free({b})")
        r.log.add(f"a.free({b})")
        r.compare(f"a.free({b})", op="free")
    for _ in range(4):
        r.allocate()
    if sharing:
        r = _Run(cls, 3, 4, "a shared block is freed only when its last holder frees it", stats)
        r.allocate()
        r.held.append(0)
        r.ref.incref(0)
        r.call(r.mine.incref, 0, what="a.incref(0)")
        r.log.add("a.incref(0)  # a second table shares block 0")
        r.compare("a.incref(0)", op="incref", hint="incref() adds one to the ref count and leaves the free list alone.")
        for _ in range(2):
            r.free(random.Random(0))
        r.allocate()
        _fork_scenario(cls, stats)
        r = _Run(cls, 2, 4, "freeing a free block is an error", stats)
        r.allocate()
        r.misuse(random.Random(1), "free")
        r.misuse(random.Random(1), "incref")


def _check_members(cls) -> None:
    from ..parts import check_part

    try:
        check_part(cls, BlockPool, "allocator")
    except TypeError as e:
        raise CheckFailed(f"{NAME}: {e}. Keep the members the workbook's skeleton gives.") from None


# What the learner writes: BlockPool's members (num_blocks and block_size are set in __init__).
MUST_WRITE = ("__init__", "num_free_blocks", "allocate", "free", "incref", "ref_count")


class _Table:
    """The smallest block table over any BlockPool, so that parts.fork_table can share its blocks."""

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.blocks: list = []
        self.num_tokens = 0


def _fork_scenario(cls, stats) -> None:
    """A table of 3 blocks is forked (parts.fork_table: every block incref'd), then both are freed."""
    from .. import parts

    r = _Run(cls, 5, 4, "a forked table shares all its blocks (parts.fork_table); each holder frees once", stats)
    builds("forked table", "shared block")
    for _ in range(3):
        r.allocate()
    tables = {}
    for side, pool in (("ref", r.ref), ("mine", r.mine)):
        t = _Table(pool)
        t.blocks, t.num_tokens = [0, 1, 2], 10
        tables[side] = t
    r.current = "parts.fork_table(table)"
    child_ref = parts.fork_table(tables["ref"])
    child_mine = r.call(parts.fork_table, tables["mine"], what="parts.fork_table(table)  # a.incref(b) for its blocks 0, 1, 2")
    r.held += [0, 1, 2]
    r.log.add("child = parts.fork_table(table)  # a.incref(0); a.incref(1); a.incref(2)")
    r.compare("forking a table of blocks [0, 1, 2]", op="incref")
    for name, t_ref, t_mine in (("table", tables["ref"], tables["mine"]), ("child", child_ref, child_mine)):
        for b in t_ref.blocks:
            r.held.remove(b)
            shared = r.ref.ref_count(b) > 1
            r.ref_free(b)
            r.call(t_mine.allocator.free, b, what=f"a.free({b})  # {name}.free()")
            r.log.add(f"a.free({b})  # {name} gives block {b} back" + ("; the other table still holds it" if shared else ""))
            r.compare(f"a.free({b}) by the {name}" + (" (the other table still holds it)" if shared else ""), op="free",
                      hint=(f"block {b} is shared by two tables (ref count 2): the first free() leaves it in use with count 1; "
                            "only the second puts it back on the free list." if shared else ""))
    r.allocate()


def _check(cls: type, sharing: bool, seed: int, runs: int, timeout: float, title: str) -> None:
    refuse_package_class(cls, MUST_WRITE, NAME, "block allocator")
    _check_members(cls)
    stats = {"ops": 0, "runs": 0, "current": "creating the allocator"}

    def _body():
        builds("package code in place")  # every call of the learner's below is watched (run_guarded)
        _scenarios(cls, stats, sharing)
        rng = random.Random(seed)
        for i in range(runs):
            builds("random stories")
            num_blocks = rng.randint(1, 3 + i)
            block_size = rng.choice([1, 2, 4, 16])
            run = _Run(cls, num_blocks, block_size, f"random run {i + 1} of {runs} (seed {seed})", stats)
            _drive(cls, rng, run, 6 + 4 * i, sharing)
            stats["runs"] += 1

    run_guarded("02", NAME, _body, timeout, stats)
    passed(f"{title}: {stats['runs']} random runs, {stats['ops']} operations; after every one your allocator's "
           "block ids, free count and ref counts matched the reference.")


def check_allocate_free(cls: type, seed: int = 0, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """allocate() and free() without sharing: ids in free-list order, counts, a full pool."""
    _check(cls, False, seed, runs, timeout, "allocate and free")


def check_sharing(cls: type, seed: int = 1, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """incref() and free() of shared blocks, and misuse (double free, sharing a free block)."""
    _check(cls, True, seed, runs, timeout, "ref counts and sharing")


def check(cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Everything workbook 02 asks of ``cls``."""
    check_allocate_free(cls, timeout=timeout)
    check_sharing(cls, timeout=timeout)


__all__ = ["check", "check_allocate_free", "check_sharing"]
