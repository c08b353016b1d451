"""Checks for workbook 09: a learner's n-gram proposer and block-table rollback against minipaged's.

- ``check_proposer(propose_ngram)``: the learner's proposer and ``minipaged.spec_decode.propose_ngram``
  get the same token ids, ``k`` and n-gram range (fixed stories, then seeded random ones, short and
  up to 2,048 tokens long (past any window a learner might cap at), small and real-vocabulary ids beside their 16-bit aliases,
  then one list handed in again after it changed in place) and must give the same draft; a difference
  is explained by the rule it breaks (each rule's wrong reading is computed and compared with the
  learner's answer).
- ``check_truncate(MyBlockTable)``: the learner's table and minipaged's BlockTable, each on its own
  BlockAllocator, are driven through the same appends, rollbacks (``truncate(num_tokens)``), forks
  and misuse; after every operation every table's blocks and token count, the pool's free count,
  every ref count and the order the blocks came back in must agree.
- ``check_serving(propose_ngram, MyBlockTable)``: SmolLM2 served with ``speculative_config`` on,
  once with minipaged's parts and once with the learner's proposer and table, step by step in
  lockstep: after every step the running sequences, their block tables, the pool and the
  acceptance counts must agree, and the greedy tokens at the end are the reference's.

Minipaged's own proposer, rollback or block table in the learner's place is refused (statically,
and while the learner's code runs: see _delegation.py).
"""
from __future__ import annotations

import random
import time
import warnings
from typing import Any, Callable

from .. import parts
from ..block_allocator import BlockAllocator, BlockAllocatorError
from ..block_table import BlockTable
from ..interfaces import BlockTableProtocol
from ..spec_decode import propose_ngram as ref_propose
from ..spec_decode import truncate_table as ref_truncate_table
from . import _delegation
from ._core import (
    SITUATIONS,
    Story,
    DEFAULT_TIMEOUT_S,
    CheckFailed,
    Log,
    builds,
    describe_exception,
    failure,
    fmt_list,
    learner_call,
    not_implemented,
    passed,
    plain,
    plural,
    run_with_time_limit,
    watching,
)
from ._delegation import guarded, refuse_package_class, refuse_package_function, refuse_reference_function
from .block_table import _RecordingPool, fork_both, page_table_picture

NAME = "09 speculative decoding"
MUST_WRITE = ("truncate",)

# What workbook 09 must not delegate to: minipaged's proposer and rollback.
_delegation.WATCH.setdefault("09", [("minipaged.spec_decode", "propose_ngram"), ("minipaged.spec_decode", "truncate_table"),
                                     ("minipaged.spec_decode", "rollback")])

# The situations workbook 09's rules name that the shared vocabulary (_core.SITUATIONS) has no word for.
SITUATIONS.update({
    "no earlier occurrence": "no suffix of min_n tokens or more occurs earlier: the answer is no draft ([])",
    "suffix at its own place": "a draft case: the suffix also matches at its own place at the end, where nothing follows it",
    "overlapping occurrence": "the most recent earlier occurrence of the suffix shares tokens with the suffix itself",
    "longer and shorter matches": "the suffix matches earlier at several lengths, a shorter match more recent than the longest",
    "match longer than max_n": "an older occurrence matches more than max_n tokens, a more recent one exactly max_n",
    "match shorter than min_n": "the suffix occurs earlier only in fewer than min_n tokens",
    "several occurrences": "the suffix occurs earlier more than once, each time followed by other tokens",
    "continuation longer than k": "more than k tokens follow the occurrence",
    "continuation shorter than k": "fewer than k tokens follow the most recent occurrence (the sequence ends sooner), more "
                                   "follow an older one",
    "several blocks dropped": "a rollback that gives back more than one block at once, so the order they go back in shows",
    "pool calls recorded": "the pool handed to the learner's part records each call of its contract's members, so a part "
                           "that changes the pool's insides instead shows",
})


# -- the proposer -----------------------------------------------------------------------------------
def _variant(toks: list, k: int, min_n: int, max_n: int | None, *, longest: bool = True, recent: bool = True,
             overlap: bool = True, need_k: bool = False, itself: bool = False, whole: bool = False,
             narrow: bool = False) -> list:
    """The proposer's rules, each of which can be read wrongly: the reference with every flag at its
    default (max_n None: no upper bound; narrow: ids compared in 16 bits). Slow and plain on purpose: it is
    read, not run in the engine."""
    L = len(toks)
    if k < 1 or min_n < 1:
        return []
    seen = [t % 65536 for t in toks] if narrow else toks
    top = L - 1 if max_n is None else max_n
    sizes = range(top, min_n - 1, -1) if longest else range(min_n, top + 1)
    for n in sizes:
        if n > L - (0 if itself else 1):
            continue
        suffix = seen[L - n:]
        last_start = (L - n) if itself else (L - n - 1 if overlap else L - 2 * n)
        starts = range(last_start, -1, -1) if recent else range(0, last_start + 1)
        for i in starts:
            if seen[i:i + n] != suffix:
                continue
            follow = toks[i + n:] if whole else toks[i + n:i + n + k]
            if need_k and len(toks[i + n:]) < k:
                continue
            return list(follow)
    return []


# (flags of the wrong reading, the rule it breaks, a hint)
_READINGS = [
    (dict(longest=False), "the longest n-gram wins",
     "try n = max_n first, then max_n - 1, ... down to min_n, and stop at the first n whose suffix occurs earlier: "
     "a longer match is stronger evidence that the text repeats."),
    (dict(max_n=None), "no n-gram longer than max_n",
     "n runs from max_n down, never above it: with a longer match allowed, an older occurrence can win over a "
     "more recent one that matches max_n tokens."),
    (dict(recent=False), "the most recent earlier occurrence wins",
     "search the earlier positions from the end backwards and take the first match: recent text predicts "
     "the continuation best."),
    (dict(min_n=1), "no n-gram shorter than min_n",
     "when no suffix of at least min_n tokens occurs earlier, return [] (no draft): a 1-token match is weak evidence."),
    (dict(overlap=False), "an earlier occurrence may overlap the suffix",
     "an earlier occurrence may share tokens with the suffix: in [5, 7, 7, 7] the suffix [7, 7] also starts at "
     "position 1, and the draft is what follows it there ([7])."),
    (dict(need_k=True), "fewer than k tokens when the sequence ends sooner",
     "when fewer than k tokens follow the most recent occurrence, propose those few: do not skip to an older occurrence."),
    (dict(whole=True), "at most k tokens",
     "propose at most k tokens: the tokens that follow the occurrence, cut to k."),
    (dict(itself=True), "the suffix itself is not an earlier occurrence",
     "look for the suffix only at positions that END BEFORE the last token (start i <= len(token_ids) - n - 1): "
     "the suffix always matches itself, and nothing follows it."),
]


def _why(got: Any, toks: list, k: int, min_n: int, max_n: int) -> str:
    if isinstance(got, list) and len(got) > k:
        return next(h for f, _, h in _READINGS if f.get("whole"))
    if any(t > 0xFFFF for t in toks):  # a draft found by comparing ids in 16 bits: the ids or their aliases come back
        alt = _variant(toks, k, min_n, max_n, narrow=True)
        if got in (alt, [t % 65536 for t in alt]):
            return ("token ids go up to the vocabulary's size (151,000 in Qwen's), past 16 bits: 70,000 and 4,464 are "
                    "equal modulo 65,536 but are different tokens. Compare the ids themselves; never keep them in 16 "
                    "bits (numpy uint16, array('H'), two bytes per id).")
    fits = []
    for flags, rule, hint in _READINGS:
        kw = {"max_n": max_n, "min_n": min_n, **flags}
        alt_min, alt_max = kw.pop("min_n"), kw.pop("max_n")
        alt = _variant(toks, k, alt_min, alt_max, **kw)
        if alt == got:
            fits.append((rule, hint))
    far = _match_start(toks, min_n, max_n)
    if got == [] and far is not None and len(toks) - far > 256:  # a search over the last tokens only never sees it
        fits.append(("every earlier position, however far back",
                     f"search the whole sequence: the occurrence is {len(toks) - far:,} tokens back, and a window of the "
                     "last tokens (a cap such as 'no prompt is longer than 1,024') never reaches it; SmolLM2-135M serves "
                     "8,192 tokens."))
    # A hint only when the draft identifies the mistake. An empty draft never does: reading "the suffix itself" as an
    # occurrence gives [] on every input, and so does any proposer that gives up too early.
    if len(fits) == 1 and got != []:
        return fits[0][1]
    if fits:
        head = (f"your draft is empty where the reference proposes tokens{_found(toks, min_n, max_n)}: no single "
                "mistake can be named from that. " if got == [] else
                "your draft fits more than one wrong reading, so no single cause can be named. ")
        return head + "The rules that could explain it: " + " ".join(
            f"({i}) {rule}: {hint}" for i, (rule, hint) in enumerate(fits, 1))
    if got == []:
        return (f"your draft is empty where the reference proposes tokens{_found(toks, min_n, max_n)}, and no single "
                "wrong reading of the rules gives that here. Check that you search every n from max_n down to min_n, "
                "every earlier start (overlapping the suffix too, but not the suffix itself), and return what follows "
                "the first match found.")
    return ("find the longest n in max_n..min_n whose last-n tokens occur earlier in token_ids, take the most recent such "
            "occurrence, and return up to k tokens that followed it there.")


def _match(toks: list, min_n: int, max_n: int) -> tuple[int, int] | None:
    """(n, start) of the reference's match: the longest suffix, its most recent earlier occurrence."""
    L = len(toks)
    for n in range(max_n, min_n - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if toks[i:i + n] == toks[L - n:]:
                return n, i
    return None


def _match_start(toks: list, min_n: int, max_n: int) -> int | None:
    m = _match(toks, min_n, max_n)
    return None if m is None else m[1]


def _found(toks: list, min_n: int, max_n: int) -> str:
    """Where the reference's match is, for a learner who found none (a search that stops short shows)."""
    m = _match(toks, min_n, max_n)
    return "" if m is None else f" (it matches the last {plural(m[0], 'token')} at position {m[1]} of {len(toks)})"


def _show(toks: list) -> str:
    return fmt_list(toks, limit=40)


# The fixed cases, played first: (label, token_ids, k, min_n, max_n, the situations it builds).
_D, _X, _W = "suffix at its own place", "continuation longer than k", "no earlier occurrence"  # most cases build them
_FIXED_CASES = [
    ("nothing to look up: too short", [5], 3, 1, 3, (_W,)),
    ("no earlier occurrence", [1, 2, 3, 4], 3, 1, 3, (_W,)),
    ("the last token occurred once before", [1, 2, 3, 1], 2, 1, 3, (_D, _X)),
    ("the suffix itself is not an earlier occurrence", [4, 5, 6, 7, 4], 3, 1, 2, (_D, _X)),
    ("a longer match beats a more recent shorter one", [1, 2, 3, 9, 8, 3, 7, 7, 2, 3], 2, 1, 3,
     ("longer and shorter matches", _D, _X)),
    ("two earlier occurrences: the most recent wins", [1, 2, 8, 1, 2, 9, 1, 2], 1, 2, 2, ("several occurrences", _D, _X)),
    ("no match of min_n tokens: no draft", [1, 2, 3, 4, 5, 9, 5], 3, 2, 4, ("match shorter than min_n", _W)),
    # The oldest [2, 3, 4] (followed by 5) keeps the first-occurrence reading apart from ignoring max_n (6).
    ("max_n caps the match: an older longer match loses to the most recent match of max_n tokens",
     [2, 3, 4, 5, 1, 2, 3, 4, 6, 0, 2, 3, 4, 8, 1, 2, 3, 4], 1, 1, 3,
     ("match longer than max_n", "several occurrences", _D, _X)),
    # An older occurrence that does not overlap (followed by 1), after the oldest (followed by 2): a search that
    # skips overlapping occurrences proposes 1, not the empty draft that many mistakes give.
    ("an occurrence that overlaps the suffix, more recent than one that does not", [7, 7, 2, 7, 7, 1, 5, 7, 7, 7],
     1, 2, 2, ("overlapping occurrence", "several occurrences", _D)),
    ("an occurrence that overlaps the suffix", [5, 7, 7, 7], 1, 2, 2, ("overlapping occurrence", _D)),
    ("a run of one token", [3, 3, 3, 3, 3, 3], 4, 2, 3,
     ("overlapping occurrence", "several occurrences", "continuation shorter than k", _D)),
    ("fewer than k tokens follow the most recent occurrence", [1, 2, 5, 1, 2, 6, 7, 1, 2, 3, 1, 2], 4, 2, 2,
     ("continuation shorter than k", "several occurrences", _D)),
    ("k tokens at most", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 3, 1, 2, (_D, _X)),
    ("a quoted line of code", [10, 11, 12, 13, 14, 15, 16, 99, 10, 11, 12], 4, 1, 4, (_D, _X)),
    ("token ids of a real vocabulary", [151_000, 2, 70_000, 4, 65_537, 151_000, 2, 70_000], 3, 2, 3, (_D, _X)),
    ("no token ids at all", [], 3, 1, 3, ("empty", _W)),
    # A learner who keeps ids in 16 bits sees 151,000 and 70,000 again at positions 4-5 (19,928 and 4,464).
    ("token ids past 16 bits beside their 16-bit aliases (id % 65,536)",
     [151_000, 70_000, 65_537, 9, 19_928, 4_464, 1, 8, 151_000, 70_000], 3, 1, 2, ("ids past 16 bits", _D, _X)),
    # 2,048 distinct ids spread over the vocabulary: the suffix's only earlier occurrence is the very first tokens.
    ("a sequence of 2,048 tokens (past any window a learner might cap at): the only earlier occurrence is at the start",
     [7 + 73 * i for i in range(2046)] + [7, 80], 3, 1, 3, ("max_model_len", _D, _X)),
]


def _random_cases(seed: int, runs: int) -> list:
    """Seeded random cases, in _FIXED_CASES' form: short and long, small vocabularies and a real one's ids."""
    cases = []
    rng = random.Random(seed)
    for i in range(runs):
        vocab = rng.choice([2, 3, 4, 8, 50_000])
        n = rng.randint(0, 40) if i % 10 else rng.randint(100, 400)
        toks = [rng.randrange(vocab) for _ in range(n)]
        if toks and rng.random() < 0.5:  # the text repeats itself: the case the proposer is for
            a = rng.randrange(len(toks))
            toks += toks[a:a + rng.randint(1, 8)]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, lo + 3)
        cases.append((f"random case {i + 1} of {runs} (seed {seed})", toks, rng.randint(1, 6), lo, hi,
                      ("random stories",)))
    return cases


# One list object handed in again and again, changed in place between the calls (a sequence's token list grows
# between the engine's steps): each time the draft differs from the one before, so a draft memoized on
# id(token_ids) or on the list object is stale. (contents, k, min_n, max_n)
_REUSED_LIST = [([1, 2, 3, 1], 2, 1, 3), ([1, 2, 3, 3], 2, 1, 3), ([1, 2, 3, 3, 9], 2, 1, 3), ([7, 7], 2, 1, 3)]


def _refuse_proposer(fn: Any) -> None:
    refuse_reference_function(fn, ref_propose, NAME, "propose_ngram", "minipaged.spec_decode")


def check_proposer(propose_fn: Callable, seed: int = 0, runs: int = 300, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``propose_ngram(token_ids, k, min_n, max_n)`` gives the reference's draft on every case."""
    _refuse_proposer(propose_fn)
    state = {"current": "", "n": 0, "drafts": 0}
    # Every list handed in stays alive until the check ends, so no id() is reused by chance: a draft memoized on
    # id(token_ids) meets a reused id only in the story made for it (_REUSED_LIST), whose hint says so.
    held: list = []

    def ask(label: str, toks: list, k: int, lo: int, hi: int, hint: Callable | None = None) -> list:
        """``propose_fn(toks, ...)`` against the reference's draft; ``hint(got)`` (when given) explains a difference
        before the rules do."""
        held.append(toks)
        shown = list(toks)
        what = f"propose_ngram({_show(shown)}, {k}, {lo}, {hi})"
        state["current"] = f"{what}  ({label})"
        exp = ref_propose(shown, k, lo, hi)
        got = learner_call(propose_fn, toks, k, lo, hi, what=what)
        if isinstance(got, tuple):
            got = list(got)
        if not isinstance(got, list) or not all(type(t) is int for t in got):
            raise failure(f"{NAME}: {what} returned {got!r} ({type(got).__name__}).",
                          done=f"Case: {label}.", expected=f"a list of token ids: {exp}", got=repr(got),
                          hint="return a list of ints, [] when there is no draft (never None).")
        state["n"] += 1
        state["drafts"] += bool(exp)
        if got != exp:
            raise failure(
                f"{NAME}: {what} gives another draft.",
                done=f"Case: {label}.\n    token_ids = {_show(shown)}\n    k = {k}, min_n = {lo}, max_n = {hi}",
                expected=repr(exp), got=repr(got), hint=(hint and hint(got)) or _why(got, shown, k, lo, hi))
        return got

    def body():
        with guarded("09", NAME):
            builds("package code in place")
            for label, toks, k, lo, hi, situations in _FIXED_CASES:
                builds(*situations)
                ask(label, list(toks), k, lo, hi)
            builds("reused object")
            seq: list = []
            before: list | None = None
            for j, (contents, k, lo, hi) in enumerate(_REUSED_LIST, 1):
                seq[:] = contents  # the same list object, its contents changed in place
                label = (f"one list object, handed in {len(_REUSED_LIST)} times and changed in place between the calls "
                         f"(call {j}; the draft differs from the call before)")
                before = ask(label, seq, k, lo, hi, hint=lambda got, prev=before: _stale(got, prev))
            for label, toks, k, lo, hi, situations in _random_cases(seed, runs):
                builds(*situations)
                ask(label, list(toks), k, lo, hi)

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])
    passed(f"n-gram proposer: {state['n']} sequences ({state['drafts']} with a draft); on every one your draft equals "
           "the reference's (the longest n-gram in min_n..max_n, its most recent earlier occurrence, up to k tokens).")


def _stale(got: list, before: list | None) -> str:
    """The hint when your draft for a list changed in place is the one you gave for its old contents."""
    if before is None or got != before:
        return ""
    return ("your draft is the one you gave for this list before it changed: it is the same list object, changed in "
            "place (as the engine's token list grows between steps). Compute the draft from the list's contents on "
            "every call: a draft remembered by id(token_ids) or by the list object is stale.")


# -- the rollback --------------------------------------------------------------------------------
def _own_truncate(cls: Any) -> bool:
    for klass in getattr(cls, "__mro__", ()):
        if "truncate" in vars(klass):
            return True
    return False


def _refuse_table(cls: Any) -> None:
    refuse_package_class(cls, MUST_WRITE, NAME, "block table")
    if not isinstance(cls, type):
        raise CheckFailed(f"{NAME}: pass your block table class (MyBlockTable), not {type(cls).__name__}.")
    if not _own_truncate(cls):
        raise CheckFailed(f"{NAME}: {cls.__name__} has no truncate. Write `def truncate(self, num_tokens)` in the class "
                          "cell above, run it, then run this check again.")
    try:
        parts.check_part(cls, BlockTableProtocol, "block table")
    except TypeError as e:
        raise CheckFailed(f"{NAME}: {e}. Keep the members the workbook's skeleton gives.") from None


class _Run(Story):
    """One story on both sides: minipaged's BlockTable (rolled back by minipaged.spec_decode.truncate_table) and yours."""

    check_name = NAME

    def __init__(self, cls: type, num_blocks: int, block_size: int, label: str, stats: dict) -> None:
        self.cls, self.label, self.stats, self.bs = cls, label, stats, block_size
        self.num_blocks = num_blocks
        self.ref_alloc = BlockAllocator(num_blocks, block_size)
        self.my_alloc = _RecordingPool(num_blocks, block_size)
        self.log = Log(["from minipaged import BlockAllocator", "from minipaged.parts import fork_table",
                        f"pool = BlockAllocator(num_blocks={num_blocks}, block_size={block_size})",
                        f"t0 = {cls.__name__}(pool)"])
        self.ref: list = [BlockTable(self.ref_alloc)]
        self.mine: list = [self.call(cls, self.my_alloc, what=f"{cls.__name__}(pool)")]
        self.emptied: set = set()  # tables rolled back to 0 slots: the same object, its blocks freed
        self.compare("creating the table")

    def compare(self, after: str, hint: str = "", focus: int = 0) -> None:
        order = [focus] + [i for i in range(len(self.ref)) if i != focus]
        for i in order:
            r, m = self.ref[i], self.mine[i]
            try:
                got_blocks = plain(list(m.blocks))
            except TypeError:
                raise self.fail(f"t{i}.blocks is not a list after {after}.", expected=repr(r.blocks),
                                got=repr(m.blocks)) from None
            got_tokens = plain(getattr(m, "num_tokens", None))
            if got_tokens != r.num_tokens:
                raise self.fail(f"t{i}.num_tokens differs after {after}.", expected=str(r.num_tokens), got=repr(got_tokens),
                                hint=hint or f"truncate(num_tokens) keeps the first num_tokens token slots: set "
                                             f"self.num_tokens = num_tokens ({r.num_tokens} here).")
            if got_blocks != r.blocks:
                more = len(got_blocks) - len(r.blocks)
                h = hint
                if not h and more == 1 and got_blocks[:-1] == r.blocks and r.num_tokens % self.bs == 0:
                    h = (f"{r.num_tokens} token slots fill exactly {r.num_tokens // self.bs} block(s) of {self.bs}: a "
                         "block left holding no slot goes back too. Keep ceil(num_tokens / block_size) blocks "
                         "(-(-num_tokens // block_size)), not num_tokens // block_size + 1.")
                elif not h and more == -1 and r.num_tokens % self.bs and r.blocks[:-1] == got_blocks:
                    # One block short, and only where the last block is partly filled: that is num_tokens // block_size.
                    h = (f"the last block kept still holds {r.num_tokens % self.bs} of the {r.num_tokens} "
                         "slots: keep ceil(num_tokens / block_size) blocks (-(-num_tokens // block_size)), not "
                         "num_tokens // block_size.")
                elif not h and more > 0 and got_blocks[:len(r.blocks)] == r.blocks:
                    h = ("keep only the first ceil(num_tokens / block_size) blocks in self.blocks; the others leave the "
                         "table (and go back to the pool).")
                raise self.fail(f"t{i}.blocks differ after {after}.",
                                picture=page_table_picture(r.blocks, got_blocks, f"t{i}'s page table:"),
                                hint=h or "truncate keeps the first ceil(num_tokens / block_size) blocks, in order.")
        exp_rc, got_rc = parts.ref_counts(self.ref_alloc), parts.ref_counts(self.my_alloc)
        if exp_rc != got_rc or self.my_alloc.num_free_blocks != self.ref_alloc.num_free_blocks:
            leaked = [b for b in range(self.num_blocks) if got_rc[b] > exp_rc[b]]
            over = [b for b in range(self.num_blocks) if got_rc[b] < exp_rc[b]]
            if over:
                h = (f"block(s) {fmt_list(over)} lost a reference that another table still holds (ref counts now "
                     f"{fmt_list(got_rc[b] for b in over)}, expected {fmt_list(exp_rc[b] for b in over)}). A forked table "
                     "shares its blocks: truncate drops only this table's reference, allocator.free(b) once per block.")
            else:
                h = (f"block(s) {fmt_list(leaked)} left the table but never went back to the pool: call "
                     "self.allocator.free(b) for every block the rollback drops (clearing them from self.blocks "
                     "alone leaks them, and the pool runs dry after a few rejected drafts).")
            raise self.fail(f"the pool differs after {after}.",
                            expected=f"pool.num_free_blocks == {self.ref_alloc.num_free_blocks}, ref counts {fmt_list(exp_rc)}",
                            got=f"{self.my_alloc.num_free_blocks}, ref counts {fmt_list(got_rc)}", hint=hint or h)

    # -- operations ----------------------------------------------------------------------------
    def append(self, i: int, n: int) -> bool:
        if self.ref[i].blocks_needed(n) > self.ref_alloc.num_free_blocks:
            return False
        self.ref[i].append_tokens(n)
        what = f"t{i}.append_tokens({n})"
        self.call(self.mine[i].append_tokens, n, what=what)
        self.log.add(f"{what}  # now {plural(self.ref[i].num_tokens, 'token slot')} in blocks {self.ref[i].blocks}")
        self.stats["ops"] += 1
        self.compare(what, focus=i)
        return True

    def truncate(self, i: int, n: int, note: str = "") -> None:
        r = self.ref[i]
        what = f"t{i}.truncate({n})"
        to_drop = list(r.blocks[-(-n // self.bs):])
        shared = [b for b in to_drop if self.ref_alloc.ref_count(b) > 1]
        self._builds(i, n, to_drop, shared)
        dropped = ref_truncate_table(r, n)
        exp_order = list(reversed(dropped))
        self.my_alloc.freed = []
        self.call(self.mine[i].truncate, n, what=what)
        order = list(self.my_alloc.freed)
        gives = f"gives back {exp_order}" if exp_order else "gives back nothing"
        self.log.add(f"{what}  # {note + '; ' if note else ''}keeps {r.blocks}, {gives}"
                     + (f" (block(s) {shared} stay held by another table)" if shared else ""))
        self.stats["ops"] += 1
        self.stats["truncates"] += 1
        if exp_order and not order and parts.ref_counts(self.my_alloc) == parts.ref_counts(self.ref_alloc):
            raise self.fail(f"{what} gave blocks back without calling allocator.free(b).",
                            expected=f"allocator.free(b) for {exp_order}, in that order", got="no call to free()",
                            hint="use only the pool's members of the contract: self.allocator.free(b) for each block the "
                                 "rollback drops. Changing the pool's insides (its lists and counts) works on this "
                                 "BlockAllocator only: in the engine the pool is the prefix cache of workbook 08, "
                                 "which keeps cached blocks in lists of its own.")
        if sorted(order) == sorted(exp_order) and order != exp_order:
            raise self.fail(f"{what} gave its blocks back in another order.", expected=f"allocator.free(b) for {exp_order}, in that order",
                            got=f"{order}",
                            hint="give the dropped blocks back last block first, the way free() does: the pool hands "
                                 "out its least recently freed block first, so the order decides which block the next "
                                 "append gets.")
        self.compare(what, focus=i)

    def _builds(self, i: int, n: int, dropped: list, shared: list) -> None:
        """Say which situations ``t{i}.truncate(n)``, about to drop ``dropped``, puts the learner's table in."""
        bs = self.bs
        builds(*[name for name, has in (
            ("empty", n == 0),
            ("block boundary", n > 0 and n % bs == 0),
            # With blocks of 1 or 2 slots every length is at or next to a boundary: only bigger blocks tell them apart.
            ("just below a boundary", bs > 2 and n % bs == bs - 1),
            ("just above a boundary", bs > 2 and n % bs == 1),
            ("max_model_len", n >= 2048),
            ("several blocks dropped", len(dropped) > 1),
            ("out-of-order blocks", len(dropped) > 1 and dropped != sorted(dropped)),
            ("shared block", bool(shared)),
            ("full pool", self.ref_alloc.num_free_blocks == 0),
            ("pool calls recorded", bool(dropped)),
            ("reused object", i in self.emptied and bool(dropped)),
        ) if has])
        if n == 0:
            self.emptied.add(i)

    def misuse(self, i: int, n: int) -> None:
        builds("misuse", "exception type")
        what = f"t{i}.truncate({n})"
        self.log.add(f"{what}  # t{i} holds {plural(self.ref[i].num_tokens, 'token slot')}: must raise ValueError")
        self.stats["current"] = f"{what}  ({self.label})"
        self.my_alloc.freed = []
        try:
            with watching(what):
                self.mine[i].truncate(n)
        except NotImplementedError:
            raise not_implemented(f"{self.cls.__name__}.truncate") from None
        except ValueError as e:
            if type(e) is not ValueError:  # the rule names ValueError itself: a subclass names another mistake
                whose = " (the pool's, for a misused block)" if isinstance(e, BlockAllocatorError) else ""
                raise self.fail(f"{what} raised {type(e).__name__}, not ValueError.", got=describe_exception(e),
                                hint=f"check num_tokens yourself and raise ValueError itself, before changing anything: "
                                     f"{type(e).__name__} is a subclass of ValueError that names another mistake"
                                     f"{whose}.") from e
            self.stats["ops"] += 1
            self.compare(f"{what} (which must change nothing)", focus=i,
                         hint="check the argument before changing anything: a rollback that raises leaves the table "
                              "and the pool as they were.")
            return
        except CheckFailed:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.fail(f"{what} raised {type(e).__name__}, not ValueError.", got=describe_exception(e),
                            hint=f"raise ValueError for a num_tokens outside 0..self.num_tokens, not {type(e).__name__}: "
                                 "the rule names ValueError.") from e
        raise self.fail(f"{what} did not raise.",
                        expected=f"ValueError: a rollback keeps 0..{self.ref[i].num_tokens} slots, it never grows the table",
                        got="it returned normally",
                        hint="a rollback only ever cuts the table back: for num_tokens < 0 or > self.num_tokens raise "
                             "ValueError before changing anything (growing is append_tokens' job).")

    def fork(self, i: int) -> None:
        builds("forked table")
        j = fork_both(self, i, "fork_table")
        self.compare(f"t{j} = fork_table(t{i})", focus=j)

    def verify_step(self, i: int, rng: random.Random, k: int) -> None:
        """What a speculative step does to a table: room for the last token and d drafts, then a rollback
        to the tokens kept."""
        r = self.ref[i]
        d = rng.randint(1, k)
        if not self.append(i, 1 + d):
            return
        kept = rng.randint(0, d)
        self.truncate(i, r.num_tokens - d + kept, note=f"{kept} of {d} draft(s) kept")


# The fixed stories, played before the random runs (short, so a failure is easy to read): the pool's blocks,
# the block size, what the story shows, and its operations in order (a _Run method and its arguments).
_STORIES = [
    (6, 4, "a rollback inside the last block keeps it", [("append", 0, 6), ("truncate", 0, 5)]),
    (6, 4, "a rollback to a block boundary gives the emptied block back",
     [("append", 0, 6), ("truncate", 0, 4), ("append", 0, 3)]),
    (8, 2, "a rollback over several blocks gives them back last block first",
     [("append", 0, 3), ("append", 0, 5), ("truncate", 0, 3), ("append", 0, 4)]),
    (6, 4, "every draft accepted: truncate to the same length changes nothing", [("append", 0, 7), ("truncate", 0, 7)]),
    (6, 2, "truncate(0) gives every block back", [("append", 0, 5), ("truncate", 0, 0), ("append", 0, 1)]),
    (8, 4, "a forked table shares its blocks: a rollback drops only this table's reference",
     [("append", 0, 6), ("fork", 0), ("truncate", 1, 3), ("truncate", 0, 2), ("append", 1, 4)]),
    (6, 4, "a rollback past the end or below 0 raises ValueError and changes nothing",
     [("append", 0, 5), ("misuse", 0, 6), ("misuse", 0, -1), ("truncate", 0, 5)]),
    # truncate(0) sends blocks 1, 0 to the back of the free list, so the regrown table holds [2, ..., 7, 1, 0]: a
    # rollback that gives back by block number (not last block first) shows, and so does a memo kept per table object.
    (8, 2, "a table emptied and grown again, its blocks now out of order: a rollback gives back the last block in the "
           "table first, whatever its number", [("append", 0, 4), ("truncate", 0, 0), ("append", 0, 16), ("truncate", 0, 8)]),
    (32, 64, "a table of 2,048 slots (past any window a learner might cap at) in a full pool, rolled back at, below and above block "
             "boundaries", [("append", 0, 2048), ("truncate", 0, 2048), ("truncate", 0, 2047), ("truncate", 0, 1985),
                            ("truncate", 0, 1984), ("append", 0, 64), ("truncate", 0, 1)]),
]


def _stories(cls, stats) -> None:
    for num_blocks, block_size, label, ops in _STORIES:
        run = _Run(cls, num_blocks, block_size, label, stats)
        for op, *args in ops:
            getattr(run, op)(*args)

def check_truncate(table_cls: type, seed: int = 0, runs: int = 30, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """``truncate(num_tokens)`` on your block table, side by side with minipaged's rollback."""
    _refuse_table(table_cls)
    stats = {"ops": 0, "runs": 0, "truncates": 0, "current": f"creating a {getattr(table_cls, '__name__', '?')}"}

    def body():
        with guarded("09", NAME):
            builds("package code in place")
            _stories(table_cls, stats)
            rng = random.Random(seed)
            for n in range(runs):
                builds("random stories")
                bs = rng.choice([1, 2, 3, 4, 8])
                run = _Run(table_cls, rng.randint(4, 12 + n), bs, f"random run {n + 1} of {runs} (seed {seed})", stats)
                k = rng.randint(1, 5)
                for _ in range(8 + n):
                    i = rng.randrange(len(run.ref))
                    u = rng.random()
                    if u < 0.45:
                        run.verify_step(i, rng, k)
                    elif u < 0.6:
                        run.append(i, rng.randint(0, 2 * bs + 1))
                    elif u < 0.8 and run.ref[i].num_tokens:
                        run.truncate(i, rng.randint(0, run.ref[i].num_tokens))
                    elif u < 0.9 and len(run.ref) < 4 and run.ref[i].num_tokens:
                        run.fork(i)
                    elif u < 0.95:
                        run.misuse(i, run.ref[i].num_tokens + rng.randint(1, 3))
                    else:
                        run.misuse(i, -rng.randint(1, 3))
                stats["runs"] += 1

    run_with_time_limit(body, timeout, NAME, lambda: stats["current"])
    passed(f"rollback: {stats['runs']} random runs and {len(_STORIES)} stories, {stats['truncates']} rollbacks among "
           f"{stats['ops']} operations; after every one your tables, the pool's ref counts and the order blocks came "
           "back in matched the reference.")


# -- serving SmolLM2 with speculation on ---------------------------------------------------------------
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE_ARGS = {"block_size": 4, "num_blocks": 28, "max_num_batched_tokens": 64, "enable_prefix_caching": True}
PROMPTS = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Repeat exactly: the cat sat on the mat, the dog sat on the log,",
]
MAX_TOKENS = 24


def _snapshot(engine, names: dict) -> tuple:
    def name(seq) -> str:
        return names.setdefault(seq.seq_id, f"r{len(names)}")

    sched = engine.scheduler
    running = tuple((name(s), s.num_computed_tokens, len(s.output_token_ids), tuple(s.block_table.blocks),
                     s.block_table.num_tokens) for s in sched.running)
    waiting = tuple(name(s) for s in sched.waiting)
    spec = engine.spec.stats
    return running, waiting, engine.allocator.num_free_blocks, (spec.num_drafts, spec.num_draft_tokens,
                                                               spec.num_accepted_tokens)


def _state_text(state: tuple) -> str:
    running, waiting, free, (drafts, draft_tokens, accepted) = state
    lines = [f"      {r}: {c} token(s) computed, {o} generated, block table {list(b)} ({t} slots)" for r, c, o, b, t in running]
    lines.append(f"      waiting {list(waiting)}; {free} free block(s); {draft_tokens} draft token(s) in {drafts} draft(s), "
                 f"{accepted} accepted")
    return "\n".join(lines)


class _Plugged:
    """The learner's proposer as the engine's ``proposer`` part (``LLM(proposer=...)``, interfaces.ProposerFn):
    each call is watched for delegation and compared with the reference's."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.calls, self.error = fn, 0, None
        self.step = 0

    def __call__(self, token_ids, num_tokens, min_n, max_n):
        self.calls += 1
        toks = list(token_ids)
        what = f"propose_ngram(<{len(toks)} token ids>, {num_tokens}, {min_n}, {max_n})"
        try:
            got = learner_call(self.fn, list(toks), num_tokens, min_n, max_n, what=what)
        except CheckFailed as e:  # the engine would turn it into a request error: the check reports it itself
            self.error = self.error or e
            raise
        got = list(got) if isinstance(got, (list, tuple)) else got
        exp = ref_propose(toks, num_tokens, min_n, max_n)
        if got != exp and self.error is None:
            self.error = failure(
                f"{NAME}: in the engine, at step {self.step}, your proposer gave another draft.",
                done=f"token_ids (the sequence so far) = {fmt_list(toks, limit=60)}\nk = {num_tokens}, min_n = {min_n}, "
                     f"max_n = {max_n}", expected=repr(exp), got=repr(got), hint=_why(got, toks, num_tokens, min_n, max_n))
            raise self.error
        return got


def check_serving(propose_fn: Callable, table_cls: type, timeout: float = 900) -> None:
    """Your proposer and block table serve SmolLM2 with ``speculative_config`` on; after every step the
    engine's state equals the reference engine's, and the greedy tokens are the reference's."""
    _refuse_proposer(propose_fn)
    _refuse_table(table_cls)
    state = {"current": "loading SmolLM2-135M-Instruct", "steps": 0}

    def body():
        from ..llm import LLM
        from ..sampling import SamplingParams
        from .assemble import model_and_tokenizer

        model, tok = model_and_tokenizer()
        # The learner's proposer and table class go into the engine in place of minipaged's, watched at every step.
        builds("package code in place", "different part class")
        plugged = _Plugged(propose_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = LLM(model, tok, speculative_config=dict(SPEC), **ENGINE_ARGS).engine
            try:
                mine = LLM(model, tok, speculative_config=dict(SPEC), block_table_cls=table_cls, proposer=plugged,
                           **ENGINE_ARGS).engine
            except Exception as e:  # noqa: BLE001
                raise CheckFailed(f"{NAME}: the engine refused your block table: {describe_exception(e)}") from e
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        for i, p in enumerate(PROMPTS):
            ref.add_request(f"p{i}", p, params)
            mine.add_request(f"p{i}", p, params)
        ref_names, my_names = {}, {}
        history: list = []
        done_ref, done_mine = {}, {}
        t_ref = t_mine = 0.0
        while ref.has_unfinished_requests() or mine.has_unfinished_requests():
            state["steps"] += 1
            step = state["steps"]
            state["current"] = f"step {step} of the reference engine"
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref_outs = ref.step()
            for o in ref_outs:
                if o.finished:
                    done_ref[o.request_id] = o
            t_ref += time.perf_counter() - t
            state["current"] = f"step {step} of the engine with your proposer and block table"
            plugged.step = step
            t = time.perf_counter()
            with guarded("09", NAME), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a request your code failed warns: the check says what raised
                outs = mine.step()
            t_mine += time.perf_counter() - t
            if plugged.error is not None:
                raise plugged.error
            for o in outs:
                if o.finished:
                    done_mine[o.request_id] = o
            errors = [o for o in outs if getattr(o, "finish_reason", None) == "error"]
            if errors:
                raise CheckFailed(f"{NAME}: at step {step} the engine ended request {errors[0].request_id} with an error "
                                  f"raised in your code:\n    {errors[0].error}\n\nEvery part passed its own check, so look "
                                  "at what only the engine gives it: a pool that is the prefix cache (use only "
                                  "allocator.free(b), never its inner lists), long sequences, many rollbacks in a row.")
            exp, got = _snapshot(ref, ref_names), _snapshot(mine, my_names)
            history.append(exp)
            if exp != got:
                if exp[:2] == got[:2] and exp[2] != got[2]:
                    hint = (f"the sequences and their block tables are the reference's, but the pool has {got[2]} free "
                            f"block(s), not {exp[2]}: a rollback that drops a block must give it back with "
                            "self.allocator.free(b) (in the engine the pool is the prefix cache).")
                else:
                    hint = ("your parts passed their own checks, so look at what the engine adds: a pool that is the "
                            "prefix cache, several sequences sharing the pool, preemption (a table freed and rebuilt), a "
                            "rollback right after a block filled up.")
                prev = f"  after step {step - 1}:\n{_state_text(history[-2])}\n" if len(history) > 1 else ""
                raise CheckFailed(
                    f"{NAME}: after step {step}, the engine with your proposer and block table differs from the reference "
                    f"engine.\n\n{prev}  reference, after step {step}:\n{_state_text(exp)}\n  yours, after step {step}:\n"
                    f"{_state_text(got)}\n\nEngine settings: {ENGINE_ARGS}, speculative_config={SPEC}.\n\nHint: {hint}")
            if step > 2000:
                raise CheckFailed(f"{NAME}: the engines ran 2000 steps without finishing.")
        if plugged.calls == 0 and ref.spec.stats.num_drafts:
            raise CheckFailed(f"{NAME}: the check could not put your proposer in the engine's place (it was never called). "
                              "This is a bug of minipaged's check, not of your code: please report it.")
        exp_t = {k: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for k, o in done_ref.items()}
        got_t = {k: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for k, o in done_mine.items()}
        if exp_t != got_t:
            raise CheckFailed(f"{NAME}: the greedy tokens differ from the reference engine's.\n    expected {exp_t}\n"
                              f"    got      {got_t}")
        s = ref.spec.stats
        for i in range(len(PROMPTS)):
            o = done_mine[f"p{i}"]
            print(f"  {PROMPTS[i][:38]!r:42} -> {o.outputs[0].text!r}")
        total = sum(len(v[0]) for v in got_t.values())
        pre = mine.stats().get("preemptions", "?")
        passed(f"your proposer and block table serve SmolLM2 with speculative_config={SPEC}: {len(PROMPTS)} prompts, "
               f"{total} greedy tokens, the reference's, in {state['steps']} steps ({pre} preemption(s)); {s.num_accepted_tokens} of "
               f"{s.num_draft_tokens} draft tokens accepted ({s.acceptance_rate:.0%}), {s.mean_acceptance_length:.2f} "
               f"tokens per verifying step; after every step the sequences, block tables and pool matched the "
               f"reference. Your engine took {t_mine:.1f} s, the reference {t_ref:.1f} s.")

    run_with_time_limit(body, timeout, NAME, lambda: state["current"])


def check(propose_fn: Callable, table_cls: type, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Everything workbook 09 asks (the serving check loads the model)."""
    check_proposer(propose_fn, timeout=timeout)
    check_truncate(table_cls, timeout=timeout)
    check_serving(propose_fn, table_cls)


__all__ = ["check", "check_proposer", "check_truncate", "check_serving", "SPEC", "ENGINE_ARGS", "PROMPTS"]
