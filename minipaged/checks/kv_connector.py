"""Checks for workbook 12: a learner's host-memory tier (an LRU store of whole blocks and a KV
connector that saves and loads through it) against minipaged's reference host tier.

``check_store``: the learner's store and minipaged's ``HostKVStore`` take the same seeded ``put``,
``get`` and ``in`` calls; every returned slot, ``len`` and ``num_evictions`` must agree.

``check_connector``: the learner's connector and minipaged's ``HostOffloadConnector`` are driven as
the engine drives them (minipaged.kv_connector draws the step), over two small KV caches whose
blocks the check "computes" itself: prompts prefilled whole or in chunks, decode steps, requests
that end, prompts that come back after their device blocks were dropped, a prefix whose middle block
the store evicted, token ids past 16 bits beside their 16-bit aliases, a finished request's Sequence
handed in again changed in place, and a prompt of 2,048 tokens (past any window a learner might cap at). After every
call the matched token counts and both KV caches must agree.

``check_serving``: the learner's connector is plugged into the engine (``LLMEngine(kv_connector=...)``,
``minipaged.parts.check_part`` first) and serves SmolLM2 with a device pool too small for the
workload's prefixes; the greedy tokens must equal a clean engine's, and the host-tier hits the
reference tier's.
"""
from __future__ import annotations

import hashlib
import random
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ..kv_connector import HostKVStore, HostOffloadConnector, KVLayout
from ._core import (
    DEFAULT_TIMEOUT_S,
    SITUATIONS,
    CheckFailed,
    Log,
    Story,
    builds,
    failure,
    fmt_list,
    is_stub,
    learner_call,
    not_implemented,
    passed,
    run_with_time_limit,
)
from ._delegation import guarded, refuse_package_class, run_guarded
from ._core import length_situations

NAME = "12 KV connector"
STORE_MEMBERS = ("__contains__", "__len__", "get", "put")
CONNECTOR_MEMBERS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "start_load_kv",
                     "save_kv")
SENTINEL = -7.0  # what a device block holds before anything is computed or loaded into it
MAX_MODEL_LEN = 2048  # a long prompt, past any window a learner might cap at (SmolLM2-135M serves 8,192; shorter keeps the check fast)
# The situations of workbook 12's rules that _core's vocabulary does not name (issue 40).
SITUATIONS.update({
    "device prefix hit": "a request whose first blocks are a hit of the device prefix cache (num_computed_tokens > 0), "
                         "so the host tier's blocks come after them",
    "chunked prefill": "a prompt prefilled in chunks, so a block's tokens are all known before its K/V is all computed",
    "request id again": "a request id that comes back with other tokens after request_finished",
    "used again": "a stored block used again (a get, or a put of it) before the store must evict, so the least "
                  "recently used block is not the first stored",
})


def _refuse_reference(store_cls: Any = None, conn_cls: Any = None) -> None:
    """A check of minipaged's own host tier in the learner's place would prove nothing."""
    for cls, ref, members, role in ((store_cls, HostKVStore, STORE_MEMBERS, "host store"),
                                    (conn_cls, HostOffloadConnector, CONNECTOR_MEMBERS, "KV connector")):
        if cls is None:
            continue
        if cls is ref or (isinstance(cls, type) and issubclass(cls, ref)):
            raise CheckFailed(f"{NAME}: {getattr(cls, '__name__', cls)} is minipaged's own {ref.__module__}.{ref.__name__} "
                              f"(or built on it), not your {role}. The check compares yours with minipaged's, so it "
                              "refuses minipaged's own: write your own in the class cell above, run it, then run this "
                              "check again.")
        refuse_package_class(cls, members, NAME, role)


# -- the store ----------------------------------------------------------------------------------------
def _h(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


class _StoreRun(Story):
    check_name = NAME

    def __init__(self, cls: type, capacity: int, label: str, stats: dict) -> None:
        self.cls, self.capacity, self.label, self.stats = cls, capacity, label, stats
        self.log = Log([f"s = {cls.__name__}({capacity})", "h = lambda i: hashlib.sha256(f'block {i}'.encode()).digest()"])
        self.ref = HostKVStore(KVLayout(1, 1, 1, 1, torch.float32), capacity)
        self.names: dict = {}
        self.mine = self.call(cls, capacity, what=f"{cls.__name__}({capacity})")

    def compare(self, after: str) -> None:
        for what, exp, fn in (("len(s)", len(self.ref), lambda: len(self.mine)),
                              ("s.num_evictions", self.ref.num_evictions, lambda: self.mine.num_evictions)):
            got = self.call(fn, what=what)
            if got != exp:
                hint = ("count one eviction each time put() gives a new block the slot of the least recently used one."
                        if what == "s.num_evictions" else
                        "len(s) is the number of blocks stored: at most the capacity; a put() of a block stored "
                        "already adds nothing.")
                raise self.fail(f"{what} differs after {after}.", expected=repr(exp), got=repr(got), hint=hint)

    def put(self, i: int) -> None:
        full = len(self.ref) == self.capacity and _h(i) not in self.ref
        if full:
            builds("full pool")
        elif _h(i) in self.ref:
            builds("used again")
        elif not len(self.ref):
            builds("empty")
        lru = self.ref.lru_order()
        exp = self.ref.put(_h(i))
        self.names[_h(i)] = i
        what = f"s.put(h({i}))"
        self.log.add(f"{what}  # -> slot {exp} expected" + ("  (the store is full)" if full else ""))
        try:
            got = learner_call(self.mine.put, _h(i), what=what, context=self.story)
        except CheckFailed as e:
            if full and " crashed with " in str(e):
                raise self.fail(f"{what} on a full store raised instead of evicting.", expected=f"slot {exp}",
                                got=str(e).split("\n", 1)[0],
                                hint="a full store evicts its least recently used block and gives its slot to the new "
                                     "one: it never fails a request (a host tier is a cache, not a pool).") from None
            raise
        if got != exp:
            if full:
                hint = ("the store is full: the block to evict is the least recently used one (an OrderedDict kept "
                        f"in use order: popitem(last=False)), here h({self.names[lru[0]]}), the one stored or hit "
                        "longest ago.")
            else:
                hint = ("a new block takes the lowest free slot (0, 1, 2, ...); a block stored already keeps its slot "
                        "(and becomes the most recently used).")
            raise self.fail(f"{what} returned another slot.", expected=f"slot {exp}", got=repr(got), hint=hint)
        self.stats["ops"] += 1
        self.compare(what)

    def get(self, i: int) -> None:
        if _h(i) in self.ref:
            builds("used again")
        exp = self.ref.get(_h(i))
        what = f"s.get(h({i}))"
        self.log.add(f"{what}  # -> {exp} expected")
        got = self.call(self.mine.get, _h(i), what=what)
        if got != exp:
            raise self.fail(f"{what} returned something else.", expected=repr(exp), got=repr(got),
                            hint="get(h) is the slot holding h, or None when h is not stored.")
        self.stats["ops"] += 1
        self.compare(what)

    def contains(self, i: int) -> None:
        exp = _h(i) in self.ref
        what = f"h({i}) in s"
        self.log.add(f"{what}  # -> {exp} expected")
        got = self.call(lambda: _h(i) in self.mine, what=what)
        if got != exp:
            raise self.fail(f"{what} is {got!r}.", expected=repr(exp), got=repr(got),
                            hint=("an evicted block is no longer stored, and the block evicted is the least recently "
                                  "used one: a get() or put() of a stored block makes it the most recently used "
                                  "(move_to_end)."))
        self.stats["ops"] += 1


def check_store(store_cls: type, seed: int = 0, runs: int = 30, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``put``, ``get``, ``in``, ``len`` and ``num_evictions`` against minipaged's HostKVStore."""
    _refuse_reference(store_cls=store_cls)
    stats = {"ops": 0, "current": "creating your store"}

    def body():
        builds("package code in place")
        r = _StoreRun(store_cls, 3, "fill, then one more: the least recently used goes", stats)
        for i in (0, 1, 2, 3):
            r.put(i)
        for i in (0, 1, 2, 3):
            r.contains(i)
        r = _StoreRun(store_cls, 3, "a hit makes a block the most recently used", stats)
        for i in (0, 1, 2):
            r.put(i)
        r.get(0)
        r.put(3)
        for i in (0, 1, 2, 3):
            r.contains(i)
        r = _StoreRun(store_cls, 2, "storing a block stored already", stats)
        for i in (0, 1, 0, 2, 0, 3):
            r.put(i)
        rng = random.Random(seed)
        for k in range(runs):
            builds("random stories")
            r = _StoreRun(store_cls, rng.randint(1, 5), f"random run {k + 1} of {runs} (seed {seed})", stats)
            for _ in range(12 + k):
                x, i = rng.random(), rng.randrange(8)
                (r.put if x < 0.5 else r.get if x < 0.8 else r.contains)(i)

    run_guarded("12", NAME, body, timeout, stats)
    passed(f"host store: {runs} random runs and 3 stories, {stats['ops']} calls; every slot, len and eviction count "
           "matched minipaged's HostKVStore (least recently used out first, a hit refreshes, a full store evicts).")


# -- the connector -----------------------------------------------------------------------------------
@dataclass
class _Seq:
    """What the engine hands a connector about one request (minipaged.data.Sequence's fields it reads)."""

    seq_id: str
    token_ids: list
    block_table: Any = field(default_factory=lambda: SimpleNamespace(blocks=[]))
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Sch:
    """One sequence's share of a step (minipaged.data.ScheduledSeq's fields a connector reads)."""

    seq: Any
    start: int
    num_new_tokens: int


def _new_cache(layout: KVLayout, num_blocks: int) -> SimpleNamespace:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return SimpleNamespace(k=[torch.full(shape, SENTINEL) for _ in range(layout.num_layers)],
                           v=[torch.full(shape, SENTINEL) for _ in range(layout.num_layers)])


def _kv_value(tokens: list, pos: int, layer: int, kv: int) -> float:
    """The K/V the check 'computes' at ``pos``: a function of every token up to it, as a model's is."""
    return float(int.from_bytes(hashlib.sha256(repr((tokens[: pos + 1], layer, kv)).encode()).digest()[:3], "big") % 9973)


class _ConnRun(Story):
    """One story played on both connectors, each with its own KV cache of ``num_blocks`` device blocks."""

    check_name = NAME

    def __init__(self, cls: type, bs: int, capacity: int, num_blocks: int, label: str, stats: dict) -> None:
        self.cls, self.bs, self.label, self.stats = cls, bs, label, stats
        self.layout = KVLayout(num_layers=2, block_size=bs, num_kv_heads=1, head_dim=2, dtype=torch.float32)
        self.log = Log([f"layout = KVLayout(num_layers=2, block_size={bs}, num_kv_heads=1, head_dim=2, dtype=torch.float32)",
                        f"c = {cls.__name__}(layout, None, capacity_blocks={capacity})",
                        f"# two KV caches of {num_blocks} device blocks, one for minipaged's connector, one for yours"])
        self.ref = HostOffloadConnector(self.layout, None, capacity_blocks=capacity)
        self.mine = learner_call(cls, self.layout, None, capacity_blocks=capacity, context=self.story,
                                 what=f"{cls.__name__}(layout, None, capacity_blocks={capacity})")
        self.caches = (_new_cache(self.layout, num_blocks), _new_cache(self.layout, num_blocks))
        self.num_blocks, self.next_block = num_blocks, 0
        self.seq_ids: set = set()  # the request ids admitted so far
        stats["stories"] = stats.get("stories", 0) + 1

    def _seqs(self, seq_id: str, tokens: list, reuse: tuple | None) -> tuple[_Seq, _Seq]:
        """A new Sequence on each side; or ``reuse``'s, changed in place (their token lists and block tables too)."""
        if reuse is None:
            return _Seq(seq_id, list(tokens)), _Seq(seq_id, list(tokens))
        for s in reuse:
            s.seq_id, s.is_finished = seq_id, False
            s.token_ids[:] = tokens
            s.block_table.blocks[:] = []
        return reuse

    def _fresh_block(self) -> int:
        b = self.next_block % self.num_blocks
        self.next_block += 1
        for cache in self.caches:
            for t in cache.k + cache.v:
                t[b] = SENTINEL
        return b

    def _compute(self, pair, start: int, n: int) -> None:
        """The forward pass: K/V of positions start .. start+n-1 written into both caches."""
        seq = pair[0]
        for p in range(start, start + n):
            b, off = seq.block_table.blocks[p // self.bs], p % self.bs
            for layer in range(self.layout.num_layers):
                k, v = _kv_value(seq.token_ids, p, layer, 0), _kv_value(seq.token_ids, p, layer, 1)
                for cache in self.caches:
                    cache.k[layer][b, off], cache.v[layer][b, off] = k, v

    def _same_caches(self, after: str, hint: str) -> None:
        ref, mine = self.caches
        bad = [b for b in range(self.num_blocks)
               if any(not torch.equal(x[b], y[b]) for x, y in zip(ref.k + ref.v, mine.k + mine.v))]
        if bad:
            if any(bool((y[b] == SENTINEL).any()) and not bool((y[b] == SENTINEL).all())
                   and not bool((x[b] == SENTINEL).any()) for b in bad for x, y in zip(ref.k + ref.v, mine.k + mine.v)):
                hint = ("a block you loaded holds positions that were never computed: it was saved before it was full. "
                        "save_kv saves only the blocks the step made full (positions up to sch.start + "
                        "sch.num_new_tokens - 1), and a block stored once is never copied again, so an early save stays "
                        "wrong.")
            raise self.fail(f"the device KV cache differs after {after}.",
                            expected=f"every block as minipaged's connector left its cache",
                            got=f"device block(s) {fmt_list(bad)} differ (a block still at {SENTINEL} was never written)",
                            hint=hint)

    def step(self, pair, start: int, n: int, what: str = "") -> None:
        """One step of one sequence: compute its positions, then save_kv on both."""
        ref_seq, my_seq = pair
        for s in pair:
            while len(s.block_table.blocks) * self.bs < start + n:
                s.block_table.blocks.append(None)
        for i, b in enumerate(ref_seq.block_table.blocks):
            if b is None:
                b = self._fresh_block()
                ref_seq.block_table.blocks[i] = my_seq.block_table.blocks[i] = b
        self._compute(pair, start, n)
        builds(*length_situations(start + n, self.bs, MAX_MODEL_LEN))  # the positions computed after this step
        call = f"c.save_kv(kv_cache, [ScheduledSeq({ref_seq.seq_id!r}, start={start}, num_new_tokens={n})])"
        self.log.add(f"# {what or 'a step'} computes positions {start}..{start + n - 1} of {ref_seq.seq_id!r} "
                     f"(blocks {ref_seq.block_table.blocks})")
        self.log.add(call)
        self.ref.save_kv(self.caches[0], [_Sch(ref_seq, start, n)])
        self.call(self.mine.save_kv, self.caches[1], [_Sch(my_seq, start, n)], what=call)
        self.stats["ops"] += 1

    def admit(self, seq_id: str, tokens: list, device_hit: list | None = None, chunk: int | None = None,
              decode: int = 0, reuse: tuple | None = None, why: str = "") -> tuple:
        """A request admitted as the engine admits it: the device prefix cache's hit (``device_hit``: device
        blocks of an earlier request's prefix), the connector's match, its load, then the prefill (in chunks
        of ``chunk`` tokens) and ``decode`` decode steps. ``reuse``: a finished request's Sequences, handed in
        again changed in place; ``why``: the hint should the match be wrong here (what the story is about)."""
        pair = self._seqs(seq_id, tokens, reuse)
        hit = list(device_hit or [])
        computed = len(hit) * self.bs
        for s in pair:
            s.block_table.blocks[:] = hit
        builds(*length_situations(len(tokens), self.bs, MAX_MODEL_LEN))
        if computed:
            builds("device prefix hit")
        if seq_id in self.seq_ids:
            builds("request id again")
        if reuse is not None:
            builds("reused object")
        self.seq_ids.add(seq_id)
        what = f"c.get_num_new_matched_tokens(Sequence({seq_id!r}, {fmt_list(tokens)}), {computed})"
        exp = self.ref.get_num_new_matched_tokens(pair[0], computed)
        got = self.call(self.mine.get_num_new_matched_tokens, pair[1], computed, what=what)
        self.log.add(f"{what}  # -> {exp} expected")
        if got != exp:
            raise self.fail(f"{what} returned another count.", expected=repr(exp), got=repr(got),
                            hint=self._match_hint(tokens, computed, exp, got, why))
        self.stats["ops"] += 1
        if exp > 0:
            new = [self._fresh_block() for _ in range(exp // self.bs)]
            for s in pair:
                s.block_table.blocks = hit + new
            what = f"c.update_state_after_alloc(seq, {hit + new}, {exp})"
            self.log.add(f"{what}  # blocks {new} are the connector's to fill")
            self.ref.update_state_after_alloc(pair[0], hit + new, exp)
            self.call(self.mine.update_state_after_alloc, pair[1], hit + new, exp, what=what)
            self.log.add("c.start_load_kv(kv_cache)")
            self.ref.start_load_kv(self.caches[0])
            self.call(self.mine.start_load_kv, self.caches[1], what="c.start_load_kv(kv_cache)")
            self._same_caches("start_load_kv", hint=(
                "of block_ids, only the LAST num_external_tokens // block_size are this connector's to fill (the ones "
                "before them are the device prefix cache's hit, already there): copy into each the host block of the "
                "same index in the request's hash chain. A block's K/V goes in whole, every layer, K and V."))
            self.stats["ops"] += 1
        pos, end = computed + exp, len(tokens)
        while pos < end:
            n = min(chunk or end, end - pos)
            if n < end - pos:
                builds("chunked prefill")
            self.step(pair, pos, n, "a prefill chunk" if chunk else "the prefill")
            pos += n
        for k in range(decode):
            tok = 3 + (len(tokens) * 7 + k) % 11
            for s in pair:
                s.token_ids.append(tok)
            self.step(pair, pos, 1, f"a decode step (token {tok} appended)")
            pos += 1
        return pair

    def _match_hint(self, tokens, computed, exp, got, why: str = "") -> str:
        bs = self.bs
        if not isinstance(got, int):
            return "return a number of tokens (an int): whole blocks, 0 for none."
        if isinstance(got, int) and got % bs:
            return f"count whole blocks: the answer is a multiple of block_size ({bs})."
        if why:
            return why
        if got == exp + computed and computed:
            return ("the first num_computed_tokens are the device prefix cache's hit: count only the stored blocks "
                    "AFTER them (from block num_computed_tokens // block_size on), and return only those tokens.")
        if got > exp and computed + got >= len(tokens):
            return ("never the last token: it is recomputed for its logits, so only the whole blocks of "
                    "token_ids[:-1] count ((num_tokens - 1) // block_size blocks at most).")
        if got > exp:
            return ("stop at the first block the store does not hold: a block found after a miss cannot be used "
                    "(its K/V depends on the missing one's), and the blocks must be a prefix.")
        return ("count the blocks the store holds, from block num_computed_tokens // block_size on, each found by the "
                "request's chained hash (full_block_hashes); a block becomes findable once save_kv stored it.")

    def finish(self, pair) -> None:
        what = f"c.request_finished(Sequence({pair[0].seq_id!r}, ...))"
        self.log.add(what)
        self.ref.request_finished(pair[0])
        self.call(self.mine.request_finished, pair[1], what=what)
        self.stats["ops"] += 1


def _connector_stories(cls: type, stats: dict) -> None:
    # First, so that an answer kept by id() is named here: later stories free Sequences whose ids new ones may get.
    r = _ConnRun(cls, 2, 8, 24, "a finished request's Sequence handed in again as a new request, changed in place "
                 "(the same object, another id and other tokens)", stats)
    old = r.admit("o", [1, 2, 3, 4, 5])
    r.finish(old)
    r.finish(r.admit("o2", [7, 8, 9, 10, 11], reuse=old, why=(
        "this Sequence is the object handed in before as request 'o' (finished), changed in place since: its seq_id, "
        "token list and block table. Anything kept by id() of the Sequence or of its token list belongs to what it "
        "held before: keep what you keep for a request under seq.seq_id, and hash the tokens it holds now.")))
    a = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 2 whole blocks of 4, and 3 tokens more
    r = _ConnRun(cls, 4, 8, 16, "a prompt comes back: its blocks are loaded from the host tier", stats)
    r.finish(r.admit("a", a, decode=2))
    r.finish(r.admit("a2", a + [5, 6]))
    r = _ConnRun(cls, 4, 8, 16, "a prompt of whole blocks: the last token is never loaded", stats)
    w = list(range(30, 42))
    r.finish(r.admit("w", w))
    r.finish(r.admit("w2", w))
    r = _ConnRun(cls, 2, 8, 24, "a device hit, then host blocks after it", stats)
    p = list(range(50, 61))
    first = r.admit("p", p)
    r.finish(first)
    r.finish(r.admit("p2", p + [1], device_hit=first[0].block_table.blocks[:2]))
    r = _ConnRun(cls, 2, 2, 24, "a small host store: only its last blocks are left, after a device hit", stats)
    first = r.admit("q", list(range(60, 69)))
    r.finish(first)
    r.finish(r.admit("q2", list(range(60, 69)) + [2], device_hit=first[0].block_table.blocks[:2]))
    r = _ConnRun(cls, 4, 8, 24, "a chunked prefill: a block is saved only once it is full", stats)
    c = list(range(70, 83))
    r.finish(r.admit("c", c, chunk=3))
    r.finish(r.admit("c2", c + [9]))
    r = _ConnRun(cls, 4, 8, 24, "a host miss in the middle: the match stops there", stats)
    m = list(range(90, 103))
    r.finish(r.admit("m", m[:5]))  # block 0 stored
    r.finish(r.admit("m-other", m[:4] + [0, 0, 0, 0] + m[8:]))  # block 0, and another block 1 and 2
    r.finish(r.admit("m2", m))
    r = _ConnRun(cls, 2, 8, 24, "a request id that comes back with other tokens, after request_finished", stats)
    r.finish(r.admit("again", [1, 2, 3, 4, 5]))
    r.finish(r.admit("again", [7, 8, 9, 10, 11]))
    r.finish(r.admit("again2", [7, 8, 9, 10, 11, 12]))
    r = _ConnRun(cls, 2, 2, 24, "a stored block computed again is used again: it becomes the most recently used", stats)
    r.finish(r.admit("x", [1, 2, 3, 4]))
    r.finish(r.admit("x2", [1, 2, 3, 4]))  # block 0 loaded; block 1 (the last token's) computed and saved again
    r.finish(r.admit("y", [9, 9, 9]))  # a full store: the least recently used goes
    r.finish(r.admit("x3", [1, 2, 3, 4, 5]))
    r = _ConnRun(cls, 2, 3, 24, "a full host store evicts; a request never fails", stats)
    for i in range(4):
        r.finish(r.admit(f"f{i}", [100 + i] * 5))
    for i in (3, 0):
        r.finish(r.admit(f"f{i}b", [100 + i] * 6))
    # Last, so that every rule above is named on its own story first.
    r = _ConnRun(cls, 2, 3, 24, "a prefix whose middle block was evicted: the match stops there, before a stored block",
                 stats)
    p = [1, 2, 3, 4, 5, 6, 7]
    r.finish(r.admit("p", p))  # blocks 0, 1 and 2 stored: the store is full
    r.finish(r.admit("t", p[:2] + [99, 98, 97]))  # block 0 used again, then a new block 1 evicts p's block 1
    builds("evicted middle block")
    r.finish(r.admit("p2", p + [8]))
    r = _ConnRun(cls, 2, 8, 24, "token ids of a real vocabulary (up to 151,000) beside their 16-bit aliases", stats)
    builds("ids past 16 bits")
    r.finish(r.admit("big", [70_000, 151_000, 65_537, 99_999, 5]))
    r.finish(r.admit("alias", [70_000 - 65_536, 151_000 - 131_072, 65_537 - 65_536, 99_999 - 65_536, 5], why=(
        "these ids are the ones stored before, each less a multiple of 65,536: other tokens, other blocks. Hash every "
        "token id whole (full_block_hashes takes the ids as they are; ids go up to 151,000 in a real vocabulary): an "
        "id narrowed to 16 bits (int16, uint16, array('H')) matches another request's blocks.")))
    r.finish(r.admit("big2", [70_000, 151_000, 65_537, 99_999, 7]))
    r = _ConnRun(cls, 16, 160, 288, f"a prompt of {MAX_MODEL_LEN} tokens (blocks of 16), "
                 "then again", stats)
    context = [(i * 7919) % 49_152 for i in range(MAX_MODEL_LEN)]  # ids across SmolLM2's vocabulary
    r.finish(r.admit("long", context))
    r.finish(r.admit("long2", context))


def check_connector(conn_cls: type, seed: int = 0, runs: int = 20, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """The five calls of the KV connector, driven as the engine drives them, against HostOffloadConnector."""
    _refuse_reference(conn_cls=conn_cls)
    stats = {"ops": 0, "current": "creating your connector"}

    def body():
        builds("package code in place")
        _connector_stories(conn_cls, stats)
        rng = random.Random(seed)
        for k in range(runs):
            builds("random stories")
            bs = rng.choice([1, 2, 4])
            r = _ConnRun(conn_cls, bs, rng.randint(1, 10), 64, f"random run {k + 1} of {runs} (seed {seed})", stats)
            prefixes = [[rng.randrange(200) for _ in range(rng.randint(1, 3 * bs))] for _ in range(2)]
            for j in range(5):
                tokens = rng.choice(prefixes) + [rng.randrange(200) for _ in range(rng.randint(1, 2 * bs))]
                chunk = rng.choice([None, None, rng.randint(1, 2 * bs)])
                r.finish(r.admit(f"r{j}", tokens, chunk=chunk, decode=rng.randint(0, bs + 1)))

    run_guarded("12", NAME, body, timeout, stats)
    passed(f"KV connector: {stats['stories'] - runs} stories and {runs} random runs, {stats['ops']} calls; every matched "
           "count and both KV caches after every load matched minipaged's HostOffloadConnector.")


# -- serving ---------------------------------------------------------------------------------------------
_BASELINES: dict = {}  # (model, device) -> (a clean engine's tokens, the reference tier's tokens, its host hits)
ENGINE_ARGS = dict(block_size=16, num_blocks=5, max_num_seqs=1, kv_offloading_size=0.02)
MAX_TOKENS = 3


def serving_prompts(tok) -> list[list[int]]:
    """Two shared prefixes of 3 blocks taking turns: each evicts the other's blocks from a 5-block device pool,
    so only the host tier can give a prefix back."""
    docs = ["The history of the printing press begins in the fifteenth century, when movable type changed how books "
            "were made, sold and read across Europe. Before it, every copy was written by hand. ",
            "A river delta forms where a river meets the sea and drops the sand and mud it carried, building land "
            "that shifts with every flood, tide and storm over thousands of years. "]
    out = []
    for turn in range(2):
        for i, d in enumerate(docs):
            ids = tok.encode(d)[:48]
            out.append(ids + tok.encode(f" Question {turn}.{i}: what is it about?"))
    return out


def check_serving(conn_cls: type, timeout: float = 600) -> None:
    """Your connector plugged into the engine (``check_part`` first) serves SmolLM2: its greedy tokens are a clean
    engine's, and it has as many host-tier hits as minipaged's host tier."""
    _refuse_reference(conn_cls=conn_cls)
    for member in ("__init__",) + CONNECTOR_MEMBERS:  # a stub is named before the model loads
        fn = getattr(conn_cls, member, None)
        if fn is not None and is_stub(fn):
            raise not_implemented(f"{getattr(conn_cls, '__name__', 'your connector')}.{member}")
    state = {"current": "loading SmolLM2-135M-Instruct"}

    def body():
        from ..engine import LLMEngine
        from ..interfaces import KVConnector
        from ..parts import check_part
        from ..sampling import SamplingParams
        from .assemble import model_and_tokenizer

        state["current"] = "check_part(your connector, KVConnector)"
        try:
            check_part(conn_cls, KVConnector, "KV connector")
        except (TypeError, ValueError) as e:
            raise CheckFailed(f"{NAME}: the engine would not take your connector: {e}") from None
        model, tok = model_and_tokenizer()
        prompts = serving_prompts(tok)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

        def serve(label, **kw):
            eng = LLMEngine(model, tok, **{**ENGINE_ARGS, **kw})
            out = []
            for i, p in enumerate(prompts):
                state["current"] = f"{label}: prompt {i + 1} of {len(prompts)}"
                rid = eng.add_request(f"p{i}", {"prompt_token_ids": p}, params)
                done = eng.run()
                o = done[rid]
                if getattr(o.outputs[0], "finish_reason", None) == "error":
                    raise CheckFailed(f"{NAME}: {label}: request p{i} ended with an error raised in your code:\n    "
                                      f"{getattr(o, 'error', '')}")
                out.append(list(o.outputs[0].token_ids))
            return out, eng

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            key = (id(model), str(next(model.parameters()).device))
            if key not in _BASELINES:  # the two reference runs depend on nothing of yours: once per process
                clean, _ = serve("a clean engine (no host tier, a pool large enough)", num_blocks=32,
                                 kv_offloading_size=None)
                want, ref = serve("the engine with minipaged's host tier")
                _BASELINES[key] = (clean, want, ref.stats()["kv_connector"]["host_hit_tokens"])
            clean, want, exp_hits = _BASELINES[key]
            with guarded("12", NAME):
                builds("package code in place")
                try:
                    got, mine = serve("the engine with your connector", kv_connector=conn_cls)
                except CheckFailed:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise CheckFailed(f"{NAME}: the engine with your connector failed at {state['current']}: "
                                      f"{type(e).__name__}: {e}") from e
        if want != clean:
            raise CheckFailed(f"{NAME}: minipaged's own host tier gave other tokens than a clean engine. This is a bug "
                              "of minipaged, not of your code: please report it.")
        if got != clean:
            bad = next(i for i in range(len(clean)) if got[i] != clean[i])
            raise CheckFailed(f"{NAME}: with your connector, prompt {bad + 1} gave other greedy tokens than a clean "
                              f"engine.\n    expected {clean[bad]}\n    got      {got[bad]}\n\nHint: a loaded block "
                              "must hold exactly the K/V the model computed for the same prefix: save a block only "
                              "once it is full, and load each host block into the device block of the same index.")
        st = mine.stats()["kv_connector"]
        if st["host_hit_tokens"] != exp_hits:
            raise CheckFailed(f"{NAME}: your connector's host-tier hits differ from minipaged's host tier's on the same "
                              f"prompts.\n    expected {exp_hits} host-hit tokens\n    got      {st['host_hit_tokens']}"
                              "\n\nHint: the device pool holds only one prefix, so each returning prompt should find "
                              "its whole blocks in your store.")
        if exp_hits == 0:
            raise CheckFailed(f"{NAME}: the workload gave minipaged's host tier no hit: a bug of the check, please report it.")
        if mine.allocator.num_free_blocks != mine.allocator.num_blocks:
            raise CheckFailed(f"{NAME}: after every request ended, {mine.allocator.num_blocks - mine.allocator.num_free_blocks} "
                              "device block(s) are still held.")
        passed(f"your connector serves SmolLM2 ({len(prompts)} prompts sharing 2 prefixes, a device pool of "
               f"{ENGINE_ARGS['num_blocks']} blocks): the greedy tokens are a clean engine's, and "
               f"{st['host_hit_tokens']} prompt tokens came from your host tier, as many as from minipaged's "
               f"({st['device_hit_tokens']} from the device pool).")

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])


def check(store_cls: type, conn_cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Everything workbook 12 asks (the serving check loads the model)."""
    check_store(store_cls, timeout=timeout)
    check_connector(conn_cls, timeout=timeout)
    check_serving(conn_cls)


__all__ = ["check", "check_store", "check_connector", "check_serving", "ENGINE_ARGS", "serving_prompts"]
