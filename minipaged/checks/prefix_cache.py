"""Checks for workbook 08: a learner's prefix cache and copy-on-write against minipaged's.

Both caches sit in front of a fresh minipaged.BlockAllocator and are driven through the same
seeded story, played as the scheduler plays it: prompts admitted (``match_prefix``, ``incref``
of the hits, ``allocate`` for the rest, ``cache_blocks``), sequences that grow by a token and
cache the blocks they fill, sequences that end (``free``), and misuse. After every operation
the returned blocks, every ``ref_count(b)``, ``num_free_blocks``, ``num_cached_blocks`` and
``num_evictions`` must agree; the first difference stops the check with the replayable story
and a hint. Copy-on-write is checked on forked block tables the same way.
"""
from __future__ import annotations

import builtins
import random
from typing import Any, Callable

from ..block_allocator import BlockAllocator, BlockAllocatorError, OutOfBlocksError
from ..block_table import BlockTable
from ..parts import fork_table
from ..prefix_cache import ROOT_HASH, PrefixCache, copy_on_write as ref_copy_on_write
from ._delegation import guarded, refuse_reference, run_guarded
from ._core import (
    length_situations,
    Story,
    DEFAULT_TIMEOUT_S,
    SITUATIONS,
    CheckFailed,
    Log,
    builds,
    describe_exception,
    failure,
    fmt_list,
    is_stub,
    learner_call,
    not_implemented,
    passed,
    run_with_time_limit,
    table,
)

NAME = "08 prefix cache"
LONG = 8192  # SmolLM2-135M's max_model_len (max_position_embeddings): the longest prompt the engine hands the cache

# The situations of the prefix cache's rules that _core's names do not cover (issue 40).
SITUATIONS.update({
    "forbidden call": "a function the workbook forbids (Python's hash()) watched while the learner's code runs: refused",
    "same block, other prefix": "the same tokens of a block after different prefixes (parent hashes): they must not match",
    "ids past 8 bits": "token ids above 255 beside the ids they alias in one byte (1 and 257)",
    "evictable block": "a cached block that no table holds any more (ref count 0): still findable, and counted free",
    "revived block": "a hit on an evictable block: incref() takes it back from the evictable ones",
    "eviction": "allocate() with the inner pool empty: a cached block no table holds is evicted and handed out",
    "eviction order": "an eviction among two or more evictable blocks, so the least recently released must go",
    "free beside evictable": "allocate() while the inner pool has a free block and cached blocks are evictable",
})



_MEMBERS = ("hash_block", "match_prefix", "cache_blocks", "allocate", "free", "incref", "ref_count",
            "num_free_blocks", "num_cached_blocks")


def _refuse_reference(cache_cls: Any = None, cow_fn: Any = None) -> None:
    """A check of minipaged's own code in the learner's place would prove nothing."""
    builds("package code in place")  # refused here, and watched while the check runs
    if cache_cls is not None:
        own = [m for m in _MEMBERS if m in dir(cache_cls) and getattr(cache_cls, m, None) is getattr(PrefixCache, m)]
        if own:
            raise CheckFailed(f"{NAME}: {getattr(cache_cls, '__name__', cache_cls)}'s {', '.join(own)} is minipaged's own "
                              "(minipaged.prefix_cache.PrefixCache). Write your own in the class cell above, run it, "
                              "then run this check again.")
    if cow_fn is not None:
        refuse_reference(cow_fn, ref_copy_on_write, NAME, "copy_on_write (minipaged.prefix_cache)")


# -- the hash chain ---------------------------------------------------------------------------
def check_hash_chain(cache_cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``hash_block(parent, token_ids)``: the same inputs give the same hash, and a different
    parent, different tokens or another order give another."""
    _refuse_reference(cache_cls)
    state = {"current": "creating your cache"}

    def body():
        with guarded("08", NAME) as g:
            builds("forbidden call")
            g.refuse(builtins.hash, "Python's hash()",
                     "its value for bytes and text changes from one process to the next (PYTHONHASHSEED), so a block "
                     "cached by one process is never found by another. Use hashlib.sha256(...).digest().")
            _body()

    def _body():
        c = learner_call(cache_cls, BlockAllocator(4, 4), what=f"{cache_cls.__name__}(BlockAllocator(4, 4))")

        def h(parent, ids):
            state["current"] = f"c.hash_block({_short(parent)}, {ids})"
            return learner_call(c.hash_block, parent, list(ids), what=state["current"])

        a = h(ROOT_HASH, [1, 2, 3, 4])
        try:
            hash(a)
        except TypeError:
            raise failure(f"{NAME}: c.hash_block(ROOT_HASH, [1, 2, 3, 4]) returned {type(a).__name__}, which cannot be a dict key.",
                          hint="return bytes: hashlib.sha256(...).digest()") from None
        if a is None:
            raise failure(f"{NAME}: c.hash_block(...) returned None.", hint="return the hash (bytes) you computed.")
        n = 0
        cases = [  # (what, one call, another call, equal hashes?, hint, the situations the pair builds)
            ("the same parent and tokens twice", (ROOT_HASH, [1, 2, 3, 4]), (ROOT_HASH, [1, 2, 3, 4]), True,
             "a hash must not depend on anything but its inputs: use hashlib (Python's hash() of bytes changes with "
             "every process, and an id() or a counter is not a hash of the content).", ()),
            ("the same tokens after two different parents", (ROOT_HASH, [5, 6, 7, 8]), (a, [5, 6, 7, 8]), False,
             "the block's K/V depends on every token before it, so its hash must include its parent's hash: "
             "hashlib.sha256(parent + <the token ids as bytes>). Without it, a block found by its tokens alone "
             "can hold the K/V of the same tokens at another place in another prompt.", ("same block, other prefix",)),
            ("two different blocks after the same parent", (ROOT_HASH, [1, 2, 3, 4]), (ROOT_HASH, [1, 2, 3, 5]), False,
             "every token id of the block goes into the hash.", ()),
            ("the same tokens in another order", (ROOT_HASH, [1, 2, 3, 4]), (ROOT_HASH, [4, 3, 2, 1]), False,
             "encode the token ids in order (a sum or a set of them loses the order).", ()),
            ("token ids whose digits run together", (ROOT_HASH, [1, 23]), (ROOT_HASH, [12, 3]), False,
             "separate the token ids when you turn them into bytes: str([1, 23]) or struct.pack, not ''.join.", ()),
            ("token ids 256 apart (a real vocabulary has 50,000 ids and more)", (ROOT_HASH, [1, 2, 3, 4]),
             (ROOT_HASH, [257, 2, 3, 4]), False,
             "every token id must go in whole: one byte per id (bytes(ids), % 256) cannot tell 1 from 257. "
             "Use str(list(ids)).encode() or struct.pack with 4 or 8 bytes per id.", ("ids past 8 bits",)),
            ("token ids 65,536 apart", (ROOT_HASH, [70_000, 5]), (ROOT_HASH, [70_000 - 65_536, 5]), False,
             "every token id must go in whole: two bytes per id cannot tell 4464 from 70000 (vocabularies reach 150,000).",
             ("ids past 16 bits",)),
            ("large token ids, the same twice", (ROOT_HASH, [151_000, 99_999, 3, 4]), (ROOT_HASH, [151_000, 99_999, 3, 4]), True,
             "a hash must depend only on its inputs, for token ids of any size.", ()),
        ]
        for what, x, y, same, hint, situations in cases:
            builds(*situations)
            hx, hy = h(*x), h(*y)
            n += 1
            if (hx == hy) != same:
                raise failure(
                    f"{NAME}: hash_block gives {'different' if same else 'equal'} hashes for {what}.",
                    done=f"c.hash_block({_short(x[0])}, {x[1]}) -> {_short(hx)}\nc.hash_block({_short(y[0])}, {y[1]}) -> {_short(hy)}",
                    expected="equal hashes" if same else "different hashes", got="equal" if not same else "different",
                    hint=hint)
        # One list object, changed in place between two calls (the engine appends to a sequence's ids in place): a
        # memo keyed on id(token_ids) meets new contents and returns the old hash.
        builds("reused object")
        ids = [1, 2, 3, 4]
        state["current"] = "c.hash_block(ROOT_HASH, ids) with ids = [1, 2, 3, 4], then ids[3] = 5 and again"
        first = learner_call(c.hash_block, ROOT_HASH, ids, what="c.hash_block(ROOT_HASH, ids)")
        ids[3] = 5
        again = learner_call(c.hash_block, ROOT_HASH, ids, what="c.hash_block(ROOT_HASH, ids)  # after ids[3] = 5")
        fresh = h(ROOT_HASH, [1, 2, 3, 5])
        n += 1
        if again == first or again != fresh:
            raise failure(
                f"{NAME}: hash_block gives a stale hash for a list of ids changed in place.",
                done=f"ids = [1, 2, 3, 4]\nc.hash_block(ROOT_HASH, ids) -> {_short(first)}\nids[3] = 5\n"
                     f"c.hash_block(ROOT_HASH, ids) -> {_short(again)}\n"
                     f"c.hash_block(ROOT_HASH, [1, 2, 3, 5]) -> {_short(fresh)}  # a new list of the same ids",
                expected="the hash of [1, 2, 3, 5], as for a new list of those ids",
                got="the hash of the list's old contents" if again == first else "another hash",
                hint="a hash depends on the ids the list holds now, not on which list object holds them: a memo "
                     "keyed on id(token_ids) (or on the list itself) returns a stale hash when the list changes in "
                     "place. Hash the ids each time, or key a memo on their values (tuple(token_ids)).")
        passed(f"hash chain: {n} pairs of blocks, each hashed as the rules say (the same inputs give the same hash, without "
               "Python's hash(), which differs between processes; chained to the parent; every token id, of any size, in order; "
               "a list changed in place hashed by what it holds now).")

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])


def _short(h: Any) -> str:
    if h == ROOT_HASH:
        return "ROOT_HASH"
    if isinstance(h, (bytes, bytearray)):
        return f"<{bytes(h)[:4].hex()}...>"
    return repr(h)[:20]


# -- lookup, caching and eviction -----------------------------------------------------------------
class _Run(Story):
    """One story played on both caches: ``ref`` (minipaged.PrefixCache) and ``mine``."""

    check_name = NAME

    def __init__(self, cls: type, num_blocks: int, block_size: int, label: str, stats: dict) -> None:
        self.cls, self.label, self.stats = cls, label, stats
        self.num_blocks, self.bs = num_blocks, block_size
        stats["stories"] = stats.get("stories", 0) + (not label.startswith("random run"))
        self.log = Log([f"c = {cls.__name__}(BlockAllocator(num_blocks={num_blocks}, block_size={block_size}))"])
        self.ref = PrefixCache(BlockAllocator(num_blocks, block_size))
        self.mine = self.call(cls, BlockAllocator(num_blocks, block_size), what=f"{cls.__name__}(BlockAllocator({num_blocks}, {block_size}))")
        self.seqs: list[tuple[list[int], list[int]]] = []  # (tokens, blocks): the block tables the story holds
        self.prefix_of: dict[int, tuple] = {}  # block -> the tokens up to its end, when the reference last cached it
        self.evicted = 0  # the reference's num_evictions before the last operation
        self.ids_seen: set[int] = set()  # every token id this cache was handed
        self.ids: list[int] | None = None  # the list object admit() hands in again, once the story has one
        self.compare("creating the cache", op="create")

    # -- state ------------------------------------------------------------------------------
    def compare(self, after: str, op: str = "", hint: str = "") -> None:
        exp_rc = [self.ref.ref_count(b) for b in range(self.num_blocks)]
        got_rc = [self.call(self.mine.ref_count, b, what=f"c.ref_count({b})") for b in range(self.num_blocks)]
        if got_rc != exp_rc:
            bad = [b for b in range(self.num_blocks) if got_rc[b] != exp_rc[b]]
            shown = list(range(self.num_blocks)) if self.num_blocks <= 16 else sorted(bad[:8])
            pic = table([["block"] + [str(b) for b in shown],
                         ["cached (reference)"] + ["yes" if self.ref.is_cached(b) else "" for b in shown],
                         ["expected ref_count"] + [str(exp_rc[b]) for b in shown],
                         ["your ref_count"] + [str(got_rc[b]) for b in shown],
                         [""] + ["^" if b in bad else "" for b in shown]])
            b = bad[0]
            if not hint:
                if self.ref.is_cached(b) and got_rc[b] == exp_rc[b] + 1:
                    hint = ("ref_count(b) counts the block tables that hold b. The cache's own hold on a cached block "
                            "(its reference in the inner pool) is not one of them: subtract it.")
                elif op == "cache" and self.ref.is_cached(b) and got_rc[b] == exp_rc[b] - 1:
                    hint = (f"block {b} was just cached, and your ref_count subtracts the cache's hold, but the inner pool "
                            "does not count one: cache_blocks() takes one reference of its own for each block it caches "
                            "(self.pool.incref(block)), so the inner pool never hands it out while it is cached.")
                elif op == "allocate" and self.ref.num_evictions > self.evicted and got_rc[b] == exp_rc[b] - 1 \
                        and not self.ref.is_cached(b):
                    hint = (f"c.allocate() evicted block {b}: it is no longer cached, and its cache hold became the "
                            "caller's reference, yet your ref_count still subtracts a cache hold for it. An evicted block "
                            "leaves the cache: drop its hash when you evict it (from both of your maps, hash -> block and "
                            "block -> hash).")
                elif op == "free":
                    hint = "free() drops one reference; a cached block that reaches 0 stays cached (evictable), its count is 0."
                else:
                    hint = "allocate() gives a block with ref count 1, incref() adds one (and revives an evictable block), free() takes one away."
            raise self.fail(f"ref counts differ after {after}.", expected=fmt_list(exp_rc), got=fmt_list(got_rc),
                            picture=pic, hint=hint)
        for name, exp, hint2 in [
            ("num_free_blocks", self.ref.num_free_blocks,
             "free blocks are the never-cached free blocks of the inner pool PLUS the cached blocks nobody holds "
             "(evictable): both can be handed out by allocate()."),
            ("num_cached_blocks", self.ref.num_cached_blocks,
             "a block is cached from cache_blocks() until it is evicted. Only FULL blocks are cached: a partial block "
             "is still being written, so its content (and hash) will change."),
            ("num_evictions", self.ref.num_evictions,
             "count one eviction each time allocate() hands out a cached block (and drops its hash)."),
        ]:
            got = self.call(lambda n=name: getattr(self.mine, n), what=f"c.{name}")
            if got != exp:
                if name == "num_free_blocks" and op == "incref" and got == exp + 1:
                    hint2 = ("a hit revives an evictable block: the cached block that no table held is held again, so "
                             "incref() must take it out of the evictable blocks (it is no longer free, and must never be "
                             "evicted while a table holds it).")
                elif name == "num_free_blocks" and op == "free" and got == exp - 1:
                    hint2 = ("a cached block whose last holder frees it stays cached and becomes evictable (the most "
                             "recently released): free() must add it to the evictable blocks, which num_free_blocks counts.")
                elif name == "num_cached_blocks" and op == "cache" and isinstance(got, int) and got < exp \
                        and getattr(self, "last_cache_len", 0) > 1024:
                    hint2 = (f"your cache holds {got} blocks where it should hold {exp}, after caching a prompt of "
                             f"{self.last_cache_len:,} tokens: something looks at only part of a long prompt (a window of "
                             "its last ids, a cap on its length). Prompts run to max_model_len (8,192 for SmolLM2-135M): "
                             "hash every full block of token_ids, from the first.")
                elif name == "num_cached_blocks" and op == "cache" and isinstance(got, int) and got < exp:
                    hint2 = ("cache_blocks() caches every FULL block i of the sequence (i < len(token_ids) // block_size) "
                             "whose chained hash is not cached yet: remember hash -> block and block -> hash, and take "
                             "the cache's own reference (self.pool.incref(block)).")
                elif name == "num_cached_blocks" and op == "allocate" and self.ref.num_evictions > self.evicted \
                        and got == exp + 1:
                    hint2 = ("c.allocate() evicted a cached block: an evicted block leaves the cache, so drop its hash "
                             "when you evict it (from both of your maps).")
                raise self.fail(f"c.{name} differs after {after}.", expected=repr(exp), got=repr(got), hint=hint or hint2)

    # -- operations, played as the scheduler plays them ---------------------------------------
    def spelled(self, xs: list[int]) -> str:
        """``xs`` as the replay log writes it: a name given to a long prompt, a run of block ids as a range."""
        named = getattr(self, "names", {}).get(tuple(xs))
        if named is not None:
            return named
        if len(xs) > 8 and xs == list(range(xs[0], xs[0] + len(xs))):
            return f"list(range({xs[0]}, {xs[0] + len(xs)}))"
        return str(list(xs))

    def admit(self, tokens: list[int], ids: list[int] | None = None, named: tuple[str, str] | None = None) -> None:
        """A prompt admitted. ``ids``: the story's one list object, set to ``tokens`` in place and handed to your
        cache instead of a new list (the engine hands a sequence's own list of ids, which changes in place).
        ``named``: (name, source) for a prompt too long to print: the log defines it once, then uses its name."""
        if named is not None and tuple(tokens) not in getattr(self, "names", {}):
            self.names = {**getattr(self, "names", {}), tuple(tokens): named[0]}
            self.log.add(f"{named[0]} = {named[1]}")
        arg, name = list(tokens), self.spelled(tokens)
        if ids is not None:
            builds("reused object")
            if self.ids is not ids:
                self.ids = ids
                self.log.add("ids = []  # one list object, handed to the cache at every call below")
            ids[:] = tokens
            arg, name = ids, "ids"
            self.log.add(f"ids[:] = {tokens}  # changed in place")
        # Every list handed over stays alive until the check ends: a new list never takes a freed one's id() by
        # chance, so a memo keyed on id() fails in the story built for it, with the hint that names it.
        self.stats.setdefault("handed", []).append(arg)
        self.builds_prompt(tokens)
        exp = self.ref.match_prefix(tokens)
        got = self.call(self.mine.match_prefix, arg, what=f"c.match_prefix({name})")
        self.log.add(f"hit = c.match_prefix({name})  # -> {exp} expected")
        got_l = list(got) if isinstance(got, (list, tuple)) else got
        if got_l != exp:
            hint = self._match_hint(tokens, exp, got_l) if ids is None else (
                "this list object was handed to your cache before, holding other ids (it changed in place since): "
                "a memo keyed on id(token_ids), or on the list itself, answers for its old contents. Look at the ids "
                "the list holds now.")
            raise self.fail(f"c.match_prefix({name}) returned other blocks.", expected=fmt_list(exp), got=repr(got_l),
                            hint=hint)
        bs, usable = self.bs, tuple(tokens[:-1])
        if any(self.ref.is_cached(b) and len(q) > (len(exp) + 1) * bs and q == usable[: len(q)]
               for b, q in self.prefix_of.items()):
            builds("evicted middle block")  # the match ends at a block that is gone, before one still cached
        need = -(-len(tokens) // self.bs) - len(exp)
        revived = sum(1 for b in exp if self.ref.ref_count(b) == 0)
        if need > self.ref.num_free_blocks - revived:
            self.log.add("# not enough free blocks for the rest of the prompt: the scheduler waits")
            return
        blocks = list(exp)
        for b in exp:
            builds("revived block" if self.ref.ref_count(b) == 0 else "shared block")
            self.ref.incref(b)
            self.call(self.mine.incref, b, what=f"c.incref({b})")
            self.log.add(f"c.incref({b})  # share the cached block")
            self.compare(f"c.incref({b}) of a hit", op="incref")
        for _ in range(need):
            self.allocate(blocks)
        self.cache(tokens, blocks, ids)
        self.seqs.append((list(tokens), blocks))
        self.stats["ops"] += 1

    def builds_prompt(self, tokens: list[int]) -> None:
        """The situations a prompt puts match_prefix in, against the ids and blocks this cache has seen."""
        bs = self.bs
        builds(*length_situations(len(tokens), bs))
        self.ids_seen.update(tokens)
        if any(t > 0xFFFF and t % 0x10000 in self.ids_seen for t in self.ids_seen):
            builds("ids past 16 bits")
        if any(t > 0xFF and t % 0x100 in self.ids_seen for t in self.ids_seen):
            builds("ids past 8 bits")
        for i in range(len(tokens) // bs):
            block, before = tuple(tokens[i * bs : (i + 1) * bs]), tuple(tokens[: i * bs])
            if any(self.ref.is_cached(b) and q[-bs:] == block and q[:-bs] != before for b, q in self.prefix_of.items()):
                builds("same block, other prefix")
                return

    def _match_hint(self, tokens, exp, got) -> str:
        if not isinstance(got, list):
            return "return a list of block ids (the cached blocks of the prompt's prefix, in order)."
        if len(got) == len(exp) + 1 and (len(exp) + 1) * self.bs >= len(tokens):
            return ("your match covers the prompt's last token. It must always be recomputed: its logits give the "
                    "first new token. Match the full blocks of token_ids[:-1] only.")
        k = next((j for j in range(len(got)) if j >= len(exp) or got[j] != exp[j]), None)
        g = got[k] if k is not None else None
        q = self.prefix_of.get(g) if isinstance(g, int) else None
        mine = tuple(tokens[: (k + 1) * self.bs]) if k is not None else ()
        if q is not None and len(q) == len(mine) and q != mine:
            pairs = [(a, b) for a, b in zip(mine, q) if a != b]
            for mod, what in ((65536, "two bytes or fewer (int16/uint16, % 65536; one byte would lose them too)"),
                              (256, "one byte (int8/uint8, % 256, bytes(ids))")):
                if all(a % mod == b % mod for a, b in pairs):
                    a, b = pairs[0]
                    return (f"block {k} of this prompt holds ids {list(mine[-self.bs:])}; the block you returned (block "
                            f"{g}) was cached for ids {list(q[-self.bs:])}"
                            + (" (after other tokens)" if q[:-self.bs] != mine[:-self.bs] else "")
                            + f". Ids {a} and {b} are equal modulo {mod:,}: somewhere your ids are narrowed to {what} "
                            "before they are hashed. hash_block may be right while match_prefix or cache_blocks stores "
                            "the ids in a narrower integer type first: every id goes into the hash whole, up to 151,000 "
                            "and more.")
        if q is not None and q != mine and q[-self.bs:] == mine[-self.bs:]:
                return (f"for block {k} of this prompt you returned block {g}, which was cached for the same tokens "
                        f"{list(mine[-self.bs:])} after other tokens before them ({list(q[:-self.bs])}), so its K/V is not "
                        "this prompt's: the hash of block i must chain from block i-1's hash (the first block's parent is "
                        "ROOT_HASH), so a block is found only after the same prefix.")
        if q is not None and k is not None and k == len(exp) and len(q) > len(mine) and q == tuple(tokens[: len(q)]):
            return (f"block {k} of this prompt is not cached (it was evicted), so the match ends there, even though a "
                    f"later block of the same prefix (block {g}) is still cached: the match ends at the first block that "
                    "is not cached (break, not continue). Without block "
                    f"{k}'s K/V, a later block is of no use.")
        if q is not None and q == mine and not self.ref.is_cached(g):
            return (f"block {g} was evicted (handed out again by allocate()), but your cache still finds it: drop its "
                    "hash when you evict it (from both of your maps).")
        if len(got) > len(exp):
            return ("you matched a block the reference does not have: the hash of block i must chain from block "
                    "i-1's hash (the first block's parent is ROOT_HASH), so a block is found only after the same "
                    "prefix. Stop at the first block that is not cached.")
        return ("walk the prompt's full blocks in order, chaining the hashes, and stop at the first miss; "
                "blocks cached by cache_blocks() must be found.")

    def allocate(self, blocks: list[int]) -> None:
        # what was cached BEFORE the reference's allocate(), which may evict the very block it returns
        cached_before = {b for b in range(self.num_blocks) if self.ref.is_cached(b)}
        evictable = self.ref.evictable()
        if evictable and self.ref.pool.num_free_blocks:
            builds("free beside evictable")
        elif evictable:
            builds("eviction")
            if len(evictable) > 1:
                builds("eviction order")
        self.evicted = self.ref.num_evictions
        exp = self.ref.allocate()
        got = self.call(self.mine.allocate, what="c.allocate()")
        self.log.add(f"c.allocate()  # -> {exp} expected")
        if got != exp:
            rc = self.ref.ref_count(got) if isinstance(got, int) and 0 <= got < self.num_blocks else None
            if rc:
                hint = (f"block {got} is still held by {rc} block table(s): only a cached block at ref count 0 may be "
                        "evicted. Keep the evictable blocks (cached, ref count 0) apart from the ones in use.")
            elif isinstance(got, int) and 0 <= got < self.num_blocks and got in cached_before and exp not in cached_before:
                hint = ("a never-cached free block was available: hand those out first (the inner pool's allocate()), "
                        "and evict a cached block only when the inner pool is empty.")
            else:
                hint = ("when the inner pool is empty, evict the cached block released LEAST recently (an OrderedDict: "
                        "popitem(last=False)); a block revived by incref() leaves that order, and goes to its back when "
                        "it is released again.")
            raise self.fail("c.allocate() returned a different block.", expected=f"block {exp}", got=repr(got), hint=hint)
        blocks.append(exp)
        self.compare(f"c.allocate() -> {exp}", op="allocate")

    def cache(self, tokens: list[int], blocks: list[int], ids: list[int] | None = None) -> None:
        """cache_blocks of a sequence's ``tokens``; ``ids``: the list object admit() handed in, holding them."""
        builds(*length_situations(len(tokens), self.bs, LONG))  # full blocks only: a partial last block is not cached
        before = {b for b in blocks if self.ref.is_cached(b)}
        self.ref.cache_blocks(tokens, blocks)
        for i, b in enumerate(blocks[: len(tokens) // self.bs]):
            if b not in before and self.ref.is_cached(b):
                self.prefix_of[b] = tuple(tokens[: (i + 1) * self.bs])
        name = self.spelled(tokens) if ids is None else "ids"
        self.last_cache_len = len(tokens)
        handed = list(tokens) if ids is None else ids
        self.stats.setdefault("handed", []).append(handed)
        what = f"c.cache_blocks({name}, {self.spelled(blocks)})"
        self.call(self.mine.cache_blocks, handed, list(blocks), what=what)
        self.log.add(what)
        self.compare(what, op="cache")

    def grow(self, rng: random.Random) -> None:
        tokens, blocks = rng.choice(self.seqs)
        if len(tokens) % self.bs == 0:
            if self.ref.num_free_blocks == 0:
                return
            self.allocate(blocks)
        tokens.append(rng.randint(0, 3))
        self.log.add(f"# a decode step appends token {tokens[-1]}")
        self.cache(tokens, blocks)
        self.stats["ops"] += 1

    def release(self, rng: random.Random | None = None, index: int = -1, forward: bool = False) -> None:
        tokens, blocks = self.seqs.pop(rng.randrange(len(self.seqs)) if rng is not None else index)
        for b in (blocks if forward else reversed(blocks)):  # minipaged's block table frees its last block first
            cached = self.ref.is_cached(b)
            self.ref.free(b)
            if cached and self.ref.ref_count(b) == 0:
                builds("evictable block")
            self.call(self.mine.free, b, what=f"c.free({b})")
            self.log.add(f"c.free({b})" + ("  # cached: stays findable" if cached else ""))
            self.compare(f"c.free({b})" + (" of a cached block" if cached else ""), op="free")
        self.stats["ops"] += 1

    def full_pool(self) -> None:
        """allocate() while every block is held by a table: OutOfBlocksError, and nothing changes."""
        if self.ref.num_free_blocks:
            return
        builds("full pool", "exception type")
        self.log.add("c.allocate()  # every block is held by a table: must raise OutOfBlocksError")
        try:
            got = self.call(self.mine.allocate, what="c.allocate()")
        except CheckFailed as e:
            cause = e.__cause__
            if cause is None:
                raise
            if not isinstance(cause, OutOfBlocksError):
                raise self.fail(f"c.allocate() with every block held raised {type(cause).__name__}, not OutOfBlocksError.",
                                expected="OutOfBlocksError (from minipaged import OutOfBlocksError)",
                                got=f"{type(cause).__name__}: {cause}",
                                hint="when the inner pool has no free block and no cached block is evictable, raise "
                                     "OutOfBlocksError: the scheduler catches it to preempt.") from None
            self.stats["ops"] += 1
            self.compare("c.allocate() on a full pool (which must change nothing)", op="misuse",
                         hint="check that a block can be handed out before changing anything.")
            return
        raise self.fail("c.allocate() with every block held by a table did not raise.",
                        expected="OutOfBlocksError", got=f"block {got!r}",
                        hint="a block a table holds is never handed out again: with no free and no evictable block, "
                             "raise OutOfBlocksError.")

    def double_free(self, rng: random.Random) -> None:
        idle = self.ref.evictable()
        if not idle:
            return
        b = rng.choice(idle)
        builds("misuse", "exception type")
        self.log.add(f"c.free({b})  # cached, but no table holds it: must raise BlockAllocatorError")
        self.stats["current"] = f"c.free({b})  ({self.label})"
        try:
            self.mine.free(b)
        except NotImplementedError:
            raise not_implemented(f"{self.cls.__name__}.free") from None
        except BlockAllocatorError:
            self.compare(f"c.free({b}) of an evictable block (which must change nothing)", op="misuse",
                         hint="check the ref count (without the cache's own hold) before changing anything.")
            return
        except Exception as e:  # noqa: BLE001 - any other type, a plain ValueError too, is not the rule's
            raise self.fail(f"c.free({b}) raised {type(e).__name__}, not BlockAllocatorError.",
                            expected="BlockAllocatorError (from minipaged import BlockAllocatorError)",
                            got=describe_exception(e),
                            hint="a double free raises BlockAllocatorError: the code that frees blocks catches exactly "
                                 "that type, which a plain ValueError (its parent class) or another error slips past.") from None
        raise self.fail(f"c.free({b}) of a cached block that no block table holds did not raise.",
                        expected="BlockAllocatorError: a double free", got="it returned normally",
                        hint="its ref count (the tables that hold it) is 0: freeing it again is a double free, even "
                             "though the cache still keeps it.")


def _scenarios(cls, stats) -> None:
    r = _Run(cls, 8, 4, "two prompts share their first block", stats)
    r.admit([1, 2, 3, 4, 5, 6])
    r.admit([1, 2, 3, 4, 9, 9, 9])
    r = _Run(cls, 8, 4, "a prompt whose first block is another prompt's second", stats)
    r.admit([7, 7, 7, 7, 1, 2, 3, 4, 0])
    r.admit([1, 2, 3, 4, 5])
    r = _Run(cls, 8, 4, "a prompt of whole blocks, all cached: its last token is recomputed", stats)
    r.admit([1, 2, 3, 4, 5, 6, 7, 8])
    r.admit([1, 2, 3, 4, 5, 6, 7, 8])
    r = _Run(cls, 6, 2, "a partial block is not cached", stats)
    r.admit([1, 2, 3])
    r.grow(random.Random(0))
    r = _Run(cls, 4, 2, "a block still held is never evicted", stats)
    r.admit([1, 2, 3])
    r.admit([5, 6, 7])
    r.release(index=1)
    r.admit([8, 9, 1])
    r = _Run(cls, 4, 2, "ended requests stay cached; the least recently released is evicted first", stats)
    r.admit([1, 2, 3, 4])
    r.release(random.Random(0))
    r.admit([5, 6, 7, 8, 1])
    r.admit([1, 2, 3, 4, 9])
    r.double_free(random.Random(0))
    r = _Run(cls, 2, 2, "every block held by a table: allocate() raises OutOfBlocksError", stats)
    r.admit([1, 2, 3])
    r.full_pool()
    r = _Run(cls, 8, 4, "token ids of a real vocabulary (up to 151,000), two prompts sharing a block", stats)
    r.admit([151_000, 2, 70_000, 4, 65_537, 6])
    r.admit([151_000, 2, 70_000, 4, 1, 6, 9])
    r.admit([151_000, 2, 70_000, 260, 1])
    r = _Run(cls, 8, 2, "ids above 65,535 and their 16-bit aliases (x - 65,536) in one cache: they must not match", stats)
    r.admit([70_000, 151_000, 65_537, 99_999, 5])
    r.admit([70_000 - 65_536, 151_000 - 131_072, 1, 99_999 - 65_536, 5])
    r.admit([70_000, 151_000, 1, 99_999, 7])
    r = _Run(cls, 6, 2, "the middle of a cached prefix is evicted: a prompt's match ends there", stats)
    r.admit([1, 2, 3, 4, 5, 6, 7])  # blocks 0, 1, 2 cached; 3 partial
    r.release(index=0, forward=True)  # a table that frees its first block first: evictable 0, 1, 2 in that order
    r.admit([1, 2, 9, 9, 9, 9, 9, 9, 9])  # revives block 0; the pool is empty, so block 1 (oldest) is evicted
    r.admit([1, 2, 3, 4, 5, 6, 8])  # block 0 cached, block 1 evicted, block 2 still cached: the match is [0]
    r = _Run(cls, 8, 2, "one list of ids, changed in place between calls: the same object, other tokens", stats)
    ids: list[int] = []  # handed in each time, as the engine hands a sequence's own list, which changes in place
    r.admit([1, 2, 3, 4, 5], ids=ids)
    r.admit([1, 2, 3, 4, 7], ids=ids)  # caches nothing new: the next call meets the cache as this one left it
    r.admit([1, 2, 9, 9, 5], ids=ids)  # only block 0 is theirs: a memo keyed on id(ids) answers for the old ids
    # As long as the model serves (max_model_len): a lookup that looks only at the last tokens ("no prompt is
    # longer than that") finds nothing of a long prompt, and caches its blocks under other hashes.
    source = f"[(7 * i) % 49_152 for i in range({LONG})]"
    long_prompt = [(7 * i) % 49_152 for i in range(LONG)]
    r = _Run(cls, LONG // 64 + 2, 64, f"a prompt of {LONG:,} tokens (SmolLM2's max_model_len), in blocks of 64, twice", stats)
    r.admit(long_prompt, named=("long_prompt", source))
    r.release(index=0)
    r.admit(long_prompt, named=("long_prompt", source))  # every block but the one holding the last token is a hit


def check_lookup_and_eviction(cache_cls: type, seed: int = 0, runs: int = 25, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """match_prefix, cache_blocks, and the block pool with LRU eviction, against minipaged.PrefixCache."""
    _refuse_reference(cache_cls)
    stats = {"ops": 0, "runs": 0, "current": "creating the cache"}

    def _body():
        _scenarios(cache_cls, stats)
        rng = random.Random(seed)
        for i in range(runs):
            bs = rng.choice([1, 2, 3, 4])
            run = _Run(cache_cls, rng.randint(2, 6 + i // 2), bs, f"random run {i + 1} of {runs} (seed {seed})", stats)
            prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 3 * bs))] for _ in range(2)]
            for _ in range(6 + i):
                x = rng.random()
                if not run.seqs or x < 0.4:
                    run.admit(rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(1, 2 * bs))])
                elif x < 0.65:
                    run.grow(rng)
                elif x < 0.95:
                    run.release(rng)
                else:
                    run.double_free(rng)
            stats["runs"] += 1

    run_guarded("08", NAME, _body, timeout, stats)
    passed(f"lookup, caching and eviction: {stats['runs']} random runs and {stats['stories']} stories, {stats['ops']} requests admitted, "
           "grown or ended; after every call your cache's blocks, ref counts, free, cached and eviction counts matched the reference.")


# -- copy-on-write ---------------------------------------------------------------------------------
def check_copy_on_write(cow_fn: Callable, seed: int = 0, runs: int = 40, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``copy_on_write(table, start, end)`` on forked tables: every shared block the write
    touches is replaced by a fresh one, the (src, dst) pairs are returned, nothing else changes."""
    if is_stub(cow_fn):
        raise not_implemented(getattr(cow_fn, "__name__", "copy_on_write"))
    _refuse_reference(cow_fn=cow_fn)
    state = {"current": "", "n": 0}

    def one(label, num_blocks, bs, n_tokens, forks, writes):
        log = Log([f"pool = BlockAllocator({num_blocks}, {bs})", "parent = BlockTable(pool)",
                   f"parent.append_tokens({n_tokens})"])
        sides = []
        for _ in range(2):
            pool = BlockAllocator(num_blocks, bs)
            parent = BlockTable(pool)
            parent.append_tokens(n_tokens)
            tables = [parent] + [fork_table(parent) for _ in range(forks)]
            sides.append((pool, tables))
        log.add(f"children = [fork_table(parent) for _ in range({forks})]  # from minipaged.parts import fork_table")
        if forks:
            builds("forked table")
        (rp, rt), (mp, mt) = sides
        for (ti, start, end) in writes:
            what = f"copy_on_write({'parent' if ti == 0 else f'children[{ti - 1}]'}, {start}, {end})"
            state["current"] = f"{what}  ({label})"
            rc_before = {b: rp.ref_count(b) for b in rt[ti].blocks}
            if end == start:
                builds("empty")
            else:
                builds(*length_situations(end, bs))
                if any(rc_before[b] > 1 for b in rt[ti].blocks[start // bs : (end - 1) // bs + 1]):
                    builds("shared block")  # the write falls in a block another table holds
            try:
                exp = ref_copy_on_write(rt[ti], start, end)
            except OutOfBlocksError:
                exp = None  # the pool is short: all or nothing
            if exp is None:
                builds("exception type")
                if rp.num_free_blocks == 0:
                    builds("full pool")
                log.add(f"{what}  # {rp.num_free_blocks} free block(s), fewer than the copies needed: "
                        "must raise OutOfBlocksError and change nothing")
                try:
                    got = learner_call(cow_fn, mt[ti], start, end, what=what, context=lambda: log.render())
                except CheckFailed as e:
                    cause = e.__cause__
                    if cause is None:
                        raise
                    if not isinstance(cause, OutOfBlocksError):
                        raise failure(f"{NAME}: {what} raised {type(cause).__name__}, not OutOfBlocksError.",
                                      done=f"Run: {label}.\n" + log.render(),
                                      expected="OutOfBlocksError (from minipaged import OutOfBlocksError), with nothing changed",
                                      got=describe_exception(cause),
                                      hint="the pool has fewer free blocks than the copies the write needs: raise "
                                           "OutOfBlocksError before replacing any block. The scheduler catches exactly "
                                           "that type to preempt, which a MemoryError (its parent class) or another "
                                           "error slips past.") from None
                    got = None
                else:
                    raise failure(f"{NAME}: {what} did not raise, but the pool has too few free blocks for its copies.",
                                  done=f"Run: {label}.\n" + log.render(), expected="OutOfBlocksError, with nothing changed",
                                  got=f"it returned {got!r}",
                                  hint="all or nothing: count the shared blocks the write touches first; if the pool has "
                                       "fewer free blocks, raise OutOfBlocksError before replacing any.")
            else:
                got = learner_call(cow_fn, mt[ti], start, end, what=what, context=lambda: log.render())
                log.add(f"{what}  # -> {exp} expected")
            got_l = [tuple(p) for p in got] if isinstance(got, (list, tuple)) else got
            ctx = f"Run: {label}.\n" + log.render()
            exp_rc = [rp.ref_count(b) for b in range(num_blocks)]
            got_rc = [mp.ref_count(b) for b in range(num_blocks)]
            if [t.blocks for t in mt] != [t.blocks for t in rt] or got_rc != exp_rc:
                bad = next(i for i in range(len(rt)) if mt[i].blocks != rt[i].blocks) if [t.blocks for t in mt] != [t.blocks for t in rt] else None
                if end <= start:
                    hint = ("a write of no positions (start == end) touches no block: copy nothing, return [].")
                elif exp is None:
                    hint = ("all or nothing: when the pool has fewer free blocks than the copies needed, raise "
                            "OutOfBlocksError BEFORE replacing any block (count the shared blocks first).")
                elif exp and got_l == []:
                    hint = ("the write touches a block that another table shares (ref count > 1): writing into it "
                            "would change the other sequence too. Take a fresh block, put it in the table in place of "
                            "the shared one, and free() the shared one (its other holders keep it).")
                elif isinstance(got_l, list) and len(got_l) > len(exp) and [
                        p for p in got_l if isinstance(p, tuple) and p and p[0] not in {q[0] for q in exp}
                        and rc_before.get(p[0], 0) > 1]:
                    extra = [p[0] for p in got_l if isinstance(p, tuple) and p and p[0] not in {q[0] for q in exp}
                             and rc_before.get(p[0], 0) > 1]
                    hint = (f"you copied shared block(s) {extra} that positions {start}..{end - 1} do not fall in: only "
                            f"the blocks the write touches (blocks[{start} // block_size] ... blocks[({end} - 1) // "
                            "block_size], those the table has) are replaced; a shared block the write does not touch "
                            "stays shared.")
                elif isinstance(got_l, list) and len(got_l) > len(exp):
                    hint = ("you copied a block that needs no copy: only blocks with ref count > 1 are replaced; "
                            "a block this table holds alone is written in place.")
                elif got_rc != exp_rc:
                    hint = "after the copy the shared block loses THIS table's reference only: call pool.free(src) once."
                else:
                    hint = ("only the blocks that positions start..end-1 fall in, and only those with ref count > 1, "
                            "are replaced; a block this table holds alone is written in place.")
                raise failure(f"{NAME}: the tables or ref counts differ after {what}.", done=ctx,
                              expected=f"tables {[t.blocks for t in rt]}, ref counts {exp_rc}",
                              got=f"tables {[t.blocks for t in mt]}, ref counts {got_rc}"
                                  + (f" (table {bad} first)" if bad is not None else ""), hint=hint)
            if exp is not None and got_l != exp:
                raise failure(f"{NAME}: {what} returned other (src, dst) pairs.", done=ctx, expected=repr(exp), got=repr(got_l),
                              hint="return one (shared block, its fresh copy) pair per replaced block, in table order: "
                                   "the engine copies their K/V before the step writes.")
            state["n"] += 1

    def _body():
        one("a child writes into the shared partial block", 6, 4, 6, 1, [(1, 5, 5), (1, 6, 7), (0, 6, 7)])
        one("a write into blocks held alone copies nothing", 6, 4, 6, 0, [(0, 6, 8)])
        one("a write that spans a shared block and new ones", 8, 2, 3, 2, [(2, 3, 4), (1, 2, 6)])
        one("the pool is short: 2 shared blocks to copy, 1 free block", 3, 2, 4, 1, [(1, 0, 4), (1, 2, 4), (0, 0, 2)])
        one(f"a table of {LONG:,} tokens (SmolLM2's max_model_len) in blocks of 16, forked: the child writes at its end",
            LONG // 16 + 4, 16, LONG, 1, [(1, LONG - 2, LONG)])
        rng = random.Random(seed)
        for i in range(runs):
            bs = rng.choice([1, 2, 4])
            n = rng.randint(1, 4 * bs)
            forks = rng.randint(0, 3)
            num_blocks = -(-n // bs) + 2 * (forks + 1) + 2
            writes = []
            for _ in range(rng.randint(1, 4)):
                ti = rng.randint(0, forks)
                start = rng.randint(max(0, n - 2 * bs), n)
                writes.append((ti, start, min(n, start + rng.randint(1, 2 * bs)) if start < n else start))
            writes = [(t, s, e) for t, s, e in writes if e > s] or [(0, n - 1, n)]
            one(f"random run {i + 1} of {runs} (seed {seed})", num_blocks, bs, n, forks, writes)

    run_guarded("08", NAME, _body, timeout, state)
    passed(f"copy-on-write: {state['n']} writes into forked tables; after each one your tables, ref counts and "
           "(src, dst) pairs matched the reference.")


# -- beam search on the learner's fork, copy-on-write and free --------------------------------------
# A small Llama with seeded random weights (no download, a few ms a step): its beams fork and fall out at
# every step. The same model, prompts and settings drive minipaged's engine twice: with its own
# fork_table / copy_on_write / free_table, and with the learner's (the engine's parts of those names).
BEAM_RUNS = [  # (beam_width, block_size, max_tokens, ignore_eos, prompts as token ids)
    (2, 4, 6, True, [[5, 9, 13, 17, 21, 25], [7, 7, 30, 41, 12, 3, 9, 50]]),
    (3, 4, 5, False, [[11, 22, 33, 44, 55, 6, 17, 28, 39, 40], [60, 3]]),
    (4, 2, 5, True, [[8, 16, 24, 32, 40], [1, 12, 23]]),
]


def tiny_model() -> Any:
    """A 2-layer Llama of 64 tokens with seeded random weights (every norm and weight non-trivial), built
    afresh each call (a few ms; no module state for a grader to see changed)."""
    import torch

    from ..model.config import LlamaConfig
    from ..model.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), name="tiny-random-llama")
    model = LlamaModel(cfg)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _refuse_sharing(fork_fn: Any, free_fn: Any, cow_fn: Any) -> None:
    from ..parts import fork_table as ref_fork, free_table as ref_free

    builds("package code in place")  # refused here, and watched while the beam searches run
    for fn, ref, what in ((fork_fn, ref_fork, "fork_table (minipaged.parts)"), (free_fn, ref_free, "free_table (minipaged.parts)"),
                          (cow_fn, ref_copy_on_write, "copy_on_write (minipaged.prefix_cache)")):
        refuse_reference(fn, ref, NAME, what)


class _Plugged:
    """The learner's three functions as the engine's parts fork_table, copy_on_write and free_table:
    each call watched (delegation), the first error kept for the check to report after the step."""

    def __init__(self, fork_fn: Callable, free_fn: Callable, cow_fn: Callable) -> None:
        self.fns = {"fork_table": fork_fn, "free_table": free_fn, "copy_on_write": cow_fn}
        self.error: CheckFailed | None = None
        self.calls = {k: 0 for k in self.fns}
        self.step = 1

    def _call(self, name: str, *args: Any) -> Any:
        self.calls[name] += 1
        what = f"{name}(table{''.join(f', {a}' for a in args[1:])})  (step {self.step})"
        try:
            return learner_call(self.fns[name], *args, what=what)
        except CheckFailed as e:  # the engine may turn it into a request error: the check reports it itself
            self.error = self.error or e
            raise

    @staticmethod
    def _counts(table: Any, blocks: list) -> dict:
        return {b: table.allocator.ref_count(b) for b in set(blocks)}

    def _refuse_counts(self, title: str, hint: str) -> None:
        self.error = self.error or failure(f"{NAME}: at step {self.step}, {title}", hint=hint)
        raise self.error

    def fork_table(self, table: Any) -> Any:
        held = list(table.blocks)
        builds("forked table")
        if held:
            builds("shared block")  # the child shares every block of the parent
        builds(*length_situations(table.num_tokens, table.block_size))
        before = self._counts(table, held)
        child = self._call("fork_table", table)
        after = self._counts(table, held)
        twice = sorted(b for b in before if after[b] - before[b] > held.count(b))
        missed = sorted(b for b in before if after[b] - before[b] < held.count(b))
        if twice:  # (a fork that raises none is seen by the invariants after the step)
            self._refuse_counts(
                f"fork_table(table) of a table of blocks {held} raised the ref count of block(s) {twice} by more than one "
                f"(from {fmt_list(before[b] for b in twice)} to {fmt_list(after[b] for b in twice)}).",
                "the child is one more holder of each block: incref each block of the parent exactly once "
                "(table.allocator.incref(b) for b in table.blocks), and nothing else.")
        if missed and len(missed) < len(before):
            self._refuse_counts(
                f"fork_table(table) of a table of blocks {held} raised the ref count of some of its blocks, but not of "
                f"{missed}.",
                "the child shares EVERY block of the parent, so each one gets one more holder: incref each block of "
                "table.blocks, the first and the last included.")
        if child is table or not hasattr(child, "blocks"):
            self.error = self.error or failure(
                f"{NAME}: at step {self.step}, fork_table(table) returned {type(child).__name__}"
                + (" (the parent itself)" if child is table else "") + ", not a new block table.",
                hint="return a new table of the same class, type(table)(table.allocator), that shares the parent's blocks.")
            raise self.error
        return child

    def copy_on_write(self, table: Any, start: int, end: int) -> Any:
        bs = table.block_size
        if end > start:
            builds(*length_situations(end, bs))
            if any(table.allocator.ref_count(b) > 1 for b in table.blocks[start // bs : (end - 1) // bs + 1]):
                builds("shared block")  # the beam writes into a block a sibling holds
        return self._call("copy_on_write", table, start, end)

    def free_table(self, table: Any) -> None:
        held = list(table.blocks)
        before = self._counts(table, held)
        if any(n > 1 for n in before.values()):
            builds("shared block")  # a beam that falls out gives back blocks its siblings keep
        self._call("free_table", table)
        after = self._counts(table, held)
        twice = sorted(b for b in before if before[b] - after[b] > held.count(b))
        kept = sorted(b for b in before if before[b] - after[b] < held.count(b))
        if twice:
            self._refuse_counts(
                f"free_table(table) of a beam that fell out (blocks {held}) lowered the ref count of block(s) {twice} by "
                f"more than one (from {fmt_list(before[b] for b in twice)} to {fmt_list(after[b] for b in twice)}).",
                "the beam is one holder of each of its blocks: free each block of the table exactly once "
                "(table.allocator.free(b)); its siblings keep theirs.")
        if kept and len(kept) < len(before):  # (a free_table that frees none is seen by the invariants after the step)
            self._refuse_counts(
                f"free_table(table) of a beam that fell out (blocks {held}) gave back some of its blocks, but not "
                f"{kept}.",
                "give back EVERY block the table holds, the first and the last included: table.allocator.free(b) once "
                "for each b in table.blocks, before you empty the list.")
        if list(table.blocks) or table.num_tokens:
            self.error = self.error or failure(
                f"{NAME}: at step {self.step}, after free_table(table) of a beam that fell out (blocks {held}), the table "
                f"still lists blocks {list(table.blocks)} and {table.num_tokens} token(s).",
                hint="after giving its blocks back the table holds nothing: table.blocks = [] and table.num_tokens = 0 "
                     "(a table that still lists freed blocks would free them again, or read another sequence's K/V).")
            raise self.error


def _beam_snapshot(eng: Any) -> dict:
    """What the step left: each running sequence's table, every ref count, free blocks, the step's copies and shares."""
    rec = eng.trace.steps[-1] if eng.trace is not None and eng.trace.steps else None
    pool = eng.allocator
    return {
        "tables": {q.seq_id: (list(q.block_table.blocks), q.block_table.num_tokens) for q in eng.scheduler.running
                   if q.block_table is not None},
        "ref_counts": [pool.ref_count(b) for b in range(pool.num_blocks)],
        "free": pool.num_free_blocks,
        "copied": [tuple(p) for p in rec.copied] if rec is not None else [],
        "shared": len(rec.shared_blocks or []) if rec is not None else 0,
    }


def _beam_hint(exp: dict, got: dict, plugged: "_Plugged", forked: bool, dropped: bool) -> str:
    if len(got["copied"]) > len(exp["copied"]):
        return ("your copy_on_write copied more blocks than the reference: copy only the blocks the write falls in "
                "(a beam writes its next token into its LAST block, the partly filled one); the full blocks before it "
                "are never written again, so they stay shared.")
    if len(got["copied"]) < len(exp["copied"]):
        return ("the reference copied a shared block before a beam wrote into it, yours did not: a block whose "
                "ref_count(b) > 1 is held by another beam too, and writing into it would change that beam's K/V.")
    exp_sum, got_sum = sum(exp["ref_counts"]), sum(got["ref_counts"])
    if got_sum < exp_sum and forked:
        return ("fork_table must raise the ref count of every block it shares (table.allocator.incref(b) for each): "
                "the child holds them too, and each holder frees once.")
    if got["free"] < exp["free"] and dropped:
        return ("a beam that fell out still holds blocks: free_table must give every block back AT ONCE "
                "(table.allocator.free(b) for each), not later: the next step needs them.")
    if got_sum > exp_sum:
        return "a block is held more times than the reference's: fork_table raises each shared block's ref count once."
    return ("the tables differ from the reference's: fork_table gives the child the parent's blocks, in order, in a "
            "list of its own, with the parent's num_tokens.")


def _invariant_hint(msg: str, eng: Any) -> str:
    tables = [q.block_table for q in eng.scheduler.running if q.block_table is not None]
    for i, a in enumerate(tables):
        for b in tables[i + 1:]:
            if a.blocks is b.blocks:
                return ("two beams' tables are the same list object: a copy-on-write in one changed the other. Give "
                        "the child a list of its own: child.blocks = list(table.blocks).")
    if "tokens need" in msg:
        return "the child must have the parent's tokens: child.num_tokens = table.num_tokens."
    import re

    m = re.search(r"allocator ref count (\d+) but (\d+) running", msg)
    if m and int(m.group(1)) > int(m.group(2)):
        return ("a block is counted for a table that no longer holds it: a beam that fell out still holds blocks. "
                "free_table must give every block back AT ONCE (table.allocator.free(b) for each), not later or never.")
    if m and int(m.group(1)) < int(m.group(2)):
        return ("more tables hold the block than its ref count says: fork_table must raise the ref count of every "
                "block it shares (table.allocator.incref(b) for each).")
    if "allocator ref count" in msg:
        return ("every holder of a block counts once: fork_table raises each shared block's ref count "
                "(table.allocator.incref(b)); free_table lowers it once per block, at once.")
    return "fork_table shares every block of the parent (ref counts raised); free_table gives each back once."


def check_beam_search(fork_fn: Callable, free_fn: Callable, cow_fn: Callable, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``LLM.beam_search`` with your fork_table, free_table and copy_on_write as the engine's parts, side by
    side with minipaged's own: after every step the block tables, ref counts, free blocks and the trace's
    shared and copied blocks are the reference's and the invariants hold; the beams (tokens and cumulative
    log-probabilities) are the reference's, and every block is free at the end."""
    for fn, name in ((fork_fn, "fork_table"), (free_fn, "free_table"), (cow_fn, "copy_on_write")):
        if is_stub(fn):
            raise not_implemented(getattr(fn, "__name__", name))
    _refuse_sharing(fork_fn, free_fn, cow_fn)
    state = {"current": "building the engines", "steps": 0, "copied": 0, "forks": 0, "drops": 0, "beams": 0}

    def run(llm: Any, prompts: list, params: Any, on_step: Callable[[Any], None]) -> list:
        eng = llm.engine
        inner = eng.step

        def step():
            outs = inner()
            on_step(outs)
            return outs

        eng.step = step  # LLM.beam_search steps its engine through this
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)

    def _body():
        from ..beam_search import BeamSearchParams
        from ..llm import LLM
        from ..parts import check_scheduler

        model = tiny_model()
        for width, bs, max_tokens, ignore_eos, prompts in BEAM_RUNS:
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
            args = dict(block_size=bs, num_blocks=64, max_num_seqs=8, enable_prefix_caching=False, max_model_len=128,
                        attention="torch", record_trace=True)
            settings = (f"LLM(<a 2-layer Llama, random weights>, block_size={bs}, num_blocks=64, max_num_seqs=8)."
                        f"beam_search({prompts}, BeamSearchParams(beam_width={width}, max_tokens={max_tokens}, "
                        f"ignore_eos={ignore_eos}))")
            ref_steps: list = []
            state["current"] = f"the reference engine: {settings}"
            ref_llm = LLM(model, None, **args)
            ref_out = run(ref_llm, prompts, params, lambda outs: ref_steps.append(_beam_snapshot(ref_llm.engine)))
            plugged = _Plugged(fork_fn, free_fn, cow_fn)
            mine = LLM(model, None, fork_table=plugged.fork_table, copy_on_write=plugged.copy_on_write,
                       free_table=plugged.free_table, **args)
            k = {"i": 0}
            prev_running: dict = {}

            def on_step(outs):
                i = k["i"]
                if plugged.error is not None:
                    raise plugged.error
                eng = mine.engine
                errors = [o for o in outs if getattr(o, "finish_reason", None) == "error"]
                if errors:
                    raise failure(f"{NAME}: at step {i + 1} the engine ended a beam search with an error raised in your code.",
                                  done=settings, got=str(errors[0].error),
                                  hint="read the error: your function raised inside the engine.")
                got = _beam_snapshot(eng)
                running = {q.seq_id for q in eng.scheduler.running}
                forked = bool(running - set(prev_running))
                dropped = bool(set(prev_running) - running)
                prev_running.clear()
                prev_running.update(dict.fromkeys(running))
                try:
                    check_scheduler(eng.scheduler, eng.config.max_num_seqs)
                    bad_inv = None
                except AssertionError as e:
                    bad_inv = str(e)
                exp = ref_steps[i] if i < len(ref_steps) else None
                if bad_inv is not None or exp != got:
                    def text(snap):
                        if snap is None:
                            return "      (the reference had finished)"
                        rows = [f"      {sid}: blocks {b}, {n} token(s)" for sid, (b, n) in snap["tables"].items()]
                        rows.append(f"      ref counts {fmt_list(snap['ref_counts'], limit=64)}; {snap['free']} free; this step "
                                    f"copied {snap['copied']} (copy-on-write); {snap['shared']} block(s) shared")
                        return "\n".join(rows)
                    if bad_inv is not None:
                        title = f"after step {i + 1}, the block invariants break: {bad_inv}."
                        hint = _invariant_hint(bad_inv, eng)
                    else:
                        title = f"after step {i + 1}, the engine with your functions differs from the reference engine."
                        hint = _beam_hint(exp, got, plugged, forked, dropped) if exp is not None else \
                            "the reference had finished: your beams went on."
                    raise failure(f"{NAME}: {title}", done=settings,
                                  expected="the reference, after step " + f"{i + 1}:\n" + text(exp),
                                  got=f"yours, after step {i + 1}:\n" + text(got), hint=hint)
                state["steps"] += 1
                state["copied"] += len(got["copied"])
                k["i"] += 1
                plugged.step = k["i"] + 1

            state["current"] = f"your fork_table, free_table and copy_on_write in the engine: {settings}"
            got_out = run(mine, prompts, params, on_step)
            if plugged.error is not None:
                raise plugged.error
            if k["i"] != len(ref_steps):
                raise failure(f"{NAME}: your engine ran {k['i']} steps, the reference {len(ref_steps)}.", done=settings,
                              hint="the beams must be the reference's: check fork_table and copy_on_write.")
            for p, r, g in zip(prompts, ref_out, got_out):
                exp_b = [(b.tokens, round(b.cum_logprob, 4)) for b in r.sequences]
                got_b = [(b.tokens, round(b.cum_logprob, 4)) for b in g.sequences]
                if [t for t, _ in exp_b] != [t for t, _ in got_b] or any(abs(a.cum_logprob - b.cum_logprob) > 1e-4
                                                                        for a, b in zip(r.sequences, g.sequences)):
                    raise failure(f"{NAME}: the beams of prompt {p} differ from the reference's.", done=settings,
                                  expected=repr(exp_b), got=repr(got_b),
                                  hint="a beam read K/V another beam wrote: copy a shared block before writing into it.")
            pool = mine.engine.allocator
            if pool.num_free_blocks != pool.num_blocks:
                held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
                raise failure(f"{NAME}: the beam searches ended, but blocks {held} are still held (leaked).", done=settings,
                              expected=f"all {pool.num_blocks} blocks free", got=f"{pool.num_free_blocks} free",
                              hint="free_table gives back every block of a beam that falls out, once each.")
            state["beams"] += sum(len(g.sequences) for g in got_out)
            state["forks"] += plugged.calls["fork_table"]
            state["drops"] += plugged.calls["free_table"]
        if not (state["forks"] and state["drops"] and state["copied"]):
            raise CheckFailed(f"{NAME}: the check's beam searches forked {state['forks']}, dropped {state['drops']} and "
                              f"copied {state['copied']} block(s): it could not test your functions. This is a bug of "
                              "minipaged's check, not of your code: please report it.")

    run_guarded("08", NAME, _body, timeout, state)
    passed(f"beam search on your fork_table, free_table and copy_on_write: {len(BEAM_RUNS)} runs of LLM.beam_search "
           f"(widths {', '.join(str(r[0]) for r in BEAM_RUNS)}, 2 prompts each), {state['steps']} steps, "
           f"{state['forks']} forks, {state['drops']} beams dropped, {state['copied']} blocks copied on write; after every "
           "step the tables, ref counts, free blocks and the trace's shared and copied blocks matched the reference and "
           f"the invariants held; the {state['beams']} beams (tokens and cumulative log-probabilities) are the "
           "reference's, and no block leaked.")


def check(cache_cls: type, cow_fn: Callable, fork_fn: Callable | None = None, free_fn: Callable | None = None,
          timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Everything workbook 08 asks (the beam search part when fork_fn and free_fn are given)."""
    check_hash_chain(cache_cls, timeout=timeout)
    check_lookup_and_eviction(cache_cls, timeout=timeout)
    check_copy_on_write(cow_fn, timeout=timeout)
    if fork_fn is not None and free_fn is not None:
        check_beam_search(fork_fn, free_fn, cow_fn, timeout=timeout)


__all__ = ["check", "check_hash_chain", "check_lookup_and_eviction", "check_copy_on_write", "check_beam_search",
           "tiny_model", "BEAM_RUNS"]
