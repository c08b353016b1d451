"""Free functions over the parts' Protocols, and the check that a part fits its Protocol.

Owns what the engine, trace, viz and invariant checks need beyond the members a learner
writes (see interfaces.py): allocating several blocks, counting used blocks, forking a table,
checking invariants. Each works on any part that has the Protocol's members, the reference
classes and a learner's alike, so no workbook has to paste package code.
"""
from __future__ import annotations

import inspect
from typing import Any

from .data import SequenceStatus
from .interfaces import PROTOCOL_MEMBERS, BlockPool, BlockTableProtocol, KVConnector, PrefixCacheProtocol, SchedulerProtocol


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots hold ``a`` tokens."""
    return -(-a // b)


# -- the block pool ----------------------------------------------------------------------
def num_used_blocks(pool: BlockPool) -> int:
    return pool.num_blocks - pool.num_free_blocks


def ref_counts(pool: BlockPool) -> list[int]:
    """Every block's ref count, through ``ref_count(b)``."""
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def allocate_many(pool: BlockPool, n: int) -> list[int]:
    """``n`` blocks, all or none: raises OutOfBlocksError before taking any if fewer are free."""
    from .block_allocator import OutOfBlocksError

    if n > pool.num_free_blocks:
        raise OutOfBlocksError(f"asked for {n} KV blocks but only {pool.num_free_blocks} of {pool.num_blocks} are free")
    return [pool.allocate() for _ in range(n)]


def check_pool(pool: BlockPool) -> None:
    """Every ref count is >= 0, and the free count equals the number of blocks with ref count 0."""
    internal = getattr(pool, "_check_internal", None)  # the reference also checks its free list
    if internal is not None:
        internal()
    counts = ref_counts(pool)
    neg = [b for b, rc in enumerate(counts) if rc < 0]
    assert not neg, f"block(s) {neg[:5]} have a negative ref count"
    zero = sum(1 for rc in counts if rc == 0)
    assert zero == pool.num_free_blocks, (
        f"{zero} blocks have ref count 0 but the pool says {pool.num_free_blocks} are free "
        "(a block leaked, or is free and in use at once)"
    )


# -- the block table ---------------------------------------------------------------------
def num_reserved_slots(table: BlockTableProtocol) -> int:
    return len(table.blocks) * table.block_size


def fork_table(table: BlockTableProtocol) -> BlockTableProtocol:
    """A second table of the same class sharing every block of ``table`` (ref counts go up)."""
    child = type(table)(table.allocator)
    child.blocks, child.num_tokens = list(table.blocks), table.num_tokens
    for b in child.blocks:  # one more holder of each
        table.allocator.incref(b)
    return child


def free_table(table: BlockTableProtocol) -> None:
    """Give every block of ``table`` back at once (one reference each: blocks other tables share
    stay with them); the table then holds nothing."""
    table.free()


def check_table(table: BlockTableProtocol) -> None:
    blocks = list(table.blocks)
    assert len(blocks) == len(set(blocks)), f"a block appears twice in one table: {blocks}"
    need = cdiv(table.num_tokens, table.block_size)
    assert len(blocks) == need, (
        f"{table.num_tokens} tokens need {need} blocks of {table.block_size}, the table holds {len(blocks)}"
    )
    for b in blocks:
        assert table.allocator.ref_count(b) >= 1, f"the table holds block {b}, but the allocator says it is free"


# -- the scheduler -----------------------------------------------------------------------
def check_scheduler(sched: Any, max_num_seqs: int | None = None) -> None:
    """Queues and block tables agree with the allocator's ref counts: no leak, no over-free."""
    pool = sched.allocator
    check_pool(pool)
    if max_num_seqs is not None:
        assert len(sched.running) <= max_num_seqs, f"{len(sched.running)} running > max_num_seqs={max_num_seqs}"
    refs: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING, f"{seq} is in the running queue"
        assert seq.block_table is not None, f"running {seq} has no block table"
        check_table(seq.block_table)
        assert seq.block_table.num_tokens >= seq.num_computed_tokens, f"{seq}: KV computed past its block table"
        for b in seq.block_table.blocks:
            refs[b] = refs.get(b, 0) + 1
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING, f"{seq} is in the waiting queue"
        assert seq.block_table is None, f"waiting {seq} still holds blocks {seq.block_table}"
    ids = [s.seq_id for s in sched.running] + [s.seq_id for s in sched.waiting]
    assert len(ids) == len(set(ids)), "a sequence is queued twice"
    extra = getattr(sched, "extra_block_refs", None)  # references held outside running tables (e.g. a cache)
    if extra is not None:
        for b, n in extra().items():
            refs[b] = refs.get(b, 0) + n
    for b in range(pool.num_blocks):
        rc = pool.ref_count(b)
        assert rc == refs.get(b, 0), (
            f"block {b}: allocator ref count {rc} but {refs.get(b, 0)} running block table(s) hold it "
            "(leaked or over-freed)"
        )


# -- fitting a part to its Protocol ------------------------------------------------------
_ROLE_NAMES = {BlockPool: "allocator", BlockTableProtocol: "block table", SchedulerProtocol: "scheduler",
               PrefixCacheProtocol: "prefix cache", KVConnector: "KV connector"}


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The Protocol members that ``obj`` (an instance or a class) lacks."""
    out = []
    for name in PROTOCOL_MEMBERS[protocol]:
        if inspect.isclass(obj):
            # attributes set in __init__ are not on the class: only methods/properties are checked there
            attr = inspect.getattr_static(obj, name, None)
            if attr is None and not (callable(getattr(protocol, name, None)) or isinstance(getattr(protocol, name, None), property)):
                continue
            if attr is None:
                out.append(name)
        elif not hasattr(obj, name):
            out.append(name)
    return out


def check_part(obj: Any, protocol: type, role: str | None = None) -> None:
    """Raise TypeError naming every member ``obj`` lacks: "your allocator has no `incref`"."""
    role = role or _ROLE_NAMES.get(protocol, "part")
    missing = missing_members(obj, protocol)
    if missing:
        name = obj.__name__ if inspect.isclass(obj) else type(obj).__name__
        listed = ", ".join(f"`{m}`" for m in missing)
        raise TypeError(
            f"your {role} {name} has no {listed}: the engine needs every member of "
            f"minipaged.interfaces.{protocol.__name__} ({', '.join(PROTOCOL_MEMBERS[protocol])})"
        )


def declared_support(cls: type, method: str) -> frozenset[str]:
    """The ``supports`` set declared by the class in ``cls``'s MRO that defines ``method``."""
    for klass in inspect.getmro(cls):
        if method in vars(klass):
            return frozenset(vars(klass).get("supports", ()))
    return frozenset()


def require_support(cls: type, method: str, feature: str, setting: str, role: str) -> None:
    """Refuse, at build time, a setting the part's own ``method`` does not declare it handles."""
    if feature not in declared_support(cls, method):
        raise ValueError(
            f"{setting} needs a {role} whose {method}() handles it, and {cls.__name__}.{method} does not "
            f"declare it: handle it there and set `supports = {{{feature!r}}}` on {cls.__name__}, "
            "or leave the setting at its default"
        )


__all__ = [
    "cdiv", "num_used_blocks", "ref_counts", "allocate_many", "check_pool", "num_reserved_slots",
    "fork_table", "free_table", "check_table", "check_scheduler", "missing_members", "check_part",
    "declared_support", "require_support",
]
