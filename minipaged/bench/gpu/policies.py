"""The paper's baselines as reservation policies, wrapped around any scheduler.

Owns one idea: how much KV memory a request holds from admission to finish. vLLM (paged)
holds what it has written, block by block, and nothing more. The baselines allocate each
request a contiguous span up front, so memory is *reserved* at admission:

* ``orca_max``: for the most the model allows (prompt + output = ``max_len``, 2,048 for OPT);
* ``orca_pow2``: for the prompt plus the output length rounded up to a power of two;
* ``orca_oracle``: for the prompt plus the true output length (it knows the future);
* ``fastertransformer``: as ``orca_max``, and request-level (static) batching: a batch is
  formed only when the previous one has wholly finished.

:class:`ReservingScheduler` expresses that through the scheduler seam: it wraps a scheduler
(minipaged's or a learner's, anything meeting ``SchedulerProtocol``) and hands it a waiting
request only when the request's reservation fits beside those already held, in arrival order.
The wrapped scheduler then runs as usual (iteration-level batching, its token budget), on a
pool given one spare block per sequence, so the reservation is the only memory limit.

A reservation is a *contiguous* span of the cache's token slots, as a contiguous KV cache
must be. Where it goes is the placement: ``buddy`` (the default, :class:`BuddySpans`), the
paper's stated assumption for its Orca (§6.1), rounds each span up to a power of two and
merges only buddies; ``first_fit`` (:class:`ContiguousSpans`) places the exact size in the
first hole large enough. Either way freed spans leave holes that a later, larger reservation
cannot use (external fragmentation, the third kind of waste of the paper's Fig. 2);
``placement=None`` counts only the total reserved.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from ...sequence import FinishReason, Sequence, SequenceStatus


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class Reservation:
    """How many KV token slots a request of ``prompt`` tokens and ``output`` tokens holds for
    its whole life under policy ``kind`` (``max``, ``pow2``, ``oracle`` or ``peak``), on a model
    whose sequences stop at ``max_len`` tokens.

    ``peak`` is what a paged request holds at its largest, ``prompt + output - 1`` slots (the
    last token sampled is never fed back, so its K and V are never written): the size by which
    ``minipaged bench``'s static paged batches are formed, so that a batch never preempts.
    ``block_size``: reservations come in whole blocks of this many slots (1, the default: slot
    exact, as the paper's contiguous spans; ``minipaged bench``'s contiguous block tables
    reserve whole blocks)."""

    kind: str
    block_size: int = 1

    def tokens(self, prompt: int, output: int, max_len: int) -> int:
        if self.kind == "max":
            n = max_len
        elif self.kind == "pow2":
            n = min(max_len, prompt + next_pow2(output))
        elif self.kind == "oracle":
            n = min(max_len, prompt + output)
        elif self.kind == "peak":
            n = min(max_len, prompt + output - 1)
        else:
            raise ValueError(f"unknown reservation {self.kind!r}: max, pow2, oracle or peak")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        return -(-n // self.block_size) * self.block_size


@dataclass(frozen=True)
class System:
    """One serving system of the paper: a reservation (None: paged, no reservation) and
    whether batching is request-level (static) rather than iteration-level."""

    name: str
    label: str
    reservation: Optional[Reservation]
    static: bool = False


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("fastertransformer", "FasterTransformer", Reservation("max"), static=True),
    System("orca_max", "Orca (Max)", Reservation("max")),
    System("orca_pow2", "Orca (Pow2)", Reservation("pow2")),
    System("orca_oracle", "Orca (Oracle)", Reservation("oracle")),
    System("vllm", "vLLM", None),
)}


class ContiguousSpans:
    """First-fit placement of spans in ``size`` slots: ``place(n)`` -> start or None; ``release``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[list[int]] = [[0, size]]  # [start, length], sorted by start, never adjacent

    def place(self, n: int) -> Optional[int]:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = [start + n, length - n]
                return start
        return None

    def release(self, start: int, n: int) -> None:
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, [start, n])
        if i + 1 < len(free) and start + n == free[i + 1][0]:  # merge with the next hole
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # and with the previous one
            free[i - 1][1] += free.pop(i)[1]

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.free), default=0)


class BuddySpans:
    """Binary buddy placement of spans in ``size`` slots, as the paper assumes its Orca does
    (Kwon et al., SOSP 2023, §6.1: the buddy allocation algorithm picks where a request's KV
    goes): a span of ``n`` slots takes a free block of ``next_pow2(n)`` slots, split off the
    smallest larger free block (lowest address first), and on release merges back with its
    buddy while that is free. ``size`` need not be a power of two: the slots are cut into
    power-of-two arenas, largest first (15,455 = 8,192 + 4,096 + 2,048 + 1,024 + 64 + ...),
    each aligned to its size, and a block never merges past its arena. The rounding up is
    internal fragmentation, unmerged buddies are external: both waste that paging avoids."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: dict[int, list[int]] = {}  # order -> sorted starts of free blocks of 2**order slots
        self.arena_order: list[tuple[int, int, int]] = []  # (start, end, order) of each arena
        start = 0
        for order in range(size.bit_length() - 1, -1, -1):
            if size & (1 << order):
                self.arena_order.append((start, start + (1 << order), order))
                self.free.setdefault(order, []).append(start)
                start += 1 << order
        self.held: dict[int, int] = {}  # start -> order of each placed block

    @staticmethod
    def order_of(n: int) -> int:
        return max(0, (int(n) - 1).bit_length())

    def place(self, n: int) -> Optional[int]:
        want = self.order_of(n)
        have = next((o for o in sorted(self.free) if o >= want and self.free[o]), None)
        if have is None:
            return None
        start = self.free[have].pop(0)
        while have > want:  # split: keep the lower half, free the upper buddy
            have -= 1
            _insort(self.free.setdefault(have, []), start + (1 << have))
        self.held[start] = want
        return start

    def _arena(self, start: int) -> int:
        return next(o for a, e, o in self.arena_order if a <= start < e)

    def release(self, start: int, n: int) -> None:
        order = self.held.pop(start)
        top = self._arena(start)
        while order < top:
            buddy = start ^ (1 << order)
            lst = self.free.get(order, [])
            i = _index(lst, buddy)
            if i is None:
                break
            lst.pop(i)
            start = min(start, buddy)
            order += 1
        _insort(self.free.setdefault(order, []), start)

    @property
    def largest_hole(self) -> int:
        return max((1 << o for o, lst in self.free.items() if lst), default=0)


def _insort(lst: list, x: int) -> None:
    import bisect

    bisect.insort(lst, x)


def _index(lst: list, x: int) -> Optional[int]:
    import bisect

    i = bisect.bisect_left(lst, x)
    return i if i < len(lst) and lst[i] == x else None


PLACEMENTS = {"buddy": BuddySpans, "first_fit": ContiguousSpans}


class ReservingScheduler:
    """``SchedulerProtocol`` around ``inner``: admission only within ``capacity`` reserved tokens.

    ``add_request`` queues a request here (rejecting one whose reservation exceeds the whole
    capacity); each ``schedule`` first passes queued requests on to ``inner`` in arrival order
    while their reservations fit (with ``static``, only when ``inner`` has nothing left, and at
    most ``max_batch`` at once), then lets ``inner`` schedule; ``update`` returns the
    reservations of the requests that finished. With a ``placement`` (``buddy``, the default,
    or ``first_fit``) a reservation must find one free span, not just enough slots in all.
    """

    def __init__(self, inner: Any, reservation: Reservation, capacity: int, max_len: int,
                 static: bool = False, max_batch: int | None = None, placement: str | None = "buddy") -> None:
        self.inner, self.reservation, self.capacity, self.max_len = inner, reservation, capacity, max_len
        self.static, self.max_batch = static, max_batch
        if placement is not None and placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}: {', '.join(PLACEMENTS)} or None")
        self.spans = PLACEMENTS[placement](capacity) if placement is not None else None
        self.held: deque[Sequence] = deque()
        self.reserved: dict[Any, int] = {}  # seq_id -> tokens reserved
        self._start: dict[Any, int] = {}  # seq_id -> first slot of its span

    # SchedulerProtocol: the queue the caller sees holds both what waits here and in ``inner``
    @property
    def waiting(self) -> deque:
        return deque(list(self.held) + list(self.inner.waiting))

    @property
    def running(self) -> list:
        return self.inner.running

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reserved.values())

    def reservation_of(self, seq: Sequence) -> int:
        return self.reservation.tokens(seq.num_prompt_tokens, seq.max_tokens, self.max_len)

    def add_request(self, seq: Sequence) -> bool:
        need = self.reservation_of(seq)
        if need > self.capacity:
            seq.status, seq.finish_reason = SequenceStatus.REJECTED, FinishReason.REJECTED
            seq.reject_reason = (f"reserves {need} KV token slots ({self.reservation.kind}) but the cache holds "
                                 f"{self.capacity}: it can never run")
            return False
        seq.status = SequenceStatus.WAITING
        self.held.append(seq)
        return True

    def _release(self) -> None:
        if self.static and (self.inner.has_unfinished() or self.reserved):
            return  # request-level batching: the running batch must finish first
        used = sum(self.reserved.values())
        passed = 0
        while self.held and (self.max_batch is None or passed < self.max_batch):
            seq = self.held[0]
            need = self.reservation_of(seq)
            if used + need > self.capacity:
                break
            if self.spans is not None:
                start = self.spans.place(need)
                if start is None:
                    break  # enough slots in all, but no hole large enough: fragmentation
            self.held.popleft()
            if not self.inner.add_request(seq):
                if self.spans is not None:
                    self.spans.release(start, need)
                continue  # the inner scheduler says it can never run: its reason stands
            if self.spans is not None:
                self._start[seq.seq_id] = start
            self.reserved[seq.seq_id] = need
            used += need
            passed += 1

    def schedule(self):
        self._release()
        return self.inner.schedule()

    def update(self, out, sampled: dict) -> list:
        finished = self.inner.update(out, sampled)
        for seq in finished:
            self._unreserve(seq.seq_id)
        return finished

    def _unreserve(self, seq_id: Any) -> None:
        need = self.reserved.pop(seq_id, None)
        if need is not None and self.spans is not None:
            self.spans.release(self._start.pop(seq_id), need)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.held:
            self.held.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.inner.finish(seq, reason)
        self._unreserve(seq.seq_id)

    def abort(self, seq_id: Any) -> Optional[Sequence]:
        for seq in self.held:
            if seq.seq_id == seq_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        self._unreserve(seq_id)
        return self.inner.abort(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.held) or self.inner.has_unfinished()
