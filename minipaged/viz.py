"""Pictures of the memory story: page table, memory bar, concurrency, batching Gantt, KV use, throughput.

Owns drawing only; the numbers come from memory.py and trace.py. Every function returns a
matplotlib Figure built without pyplot (so nothing is shown twice in a notebook and no global
state leaks); show it by leaving it last in a cell, or save it with ``fig.savefig(path)``.
Functions that take ``ax=`` draw into that axes instead, and return its figure.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .memory import GiB, Concurrency, MemoryBreakdown, format_bytes
from .trace import StepRecord, Trace

# Ten strong hues, then their light partners (tab20 reordered, its greys left out: grey means free).
_TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896",
          "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7",
          "#bcbd22", "#dbdb8d", "#17becf", "#9edae5"]
PALETTE = [_TAB20[i] for i in list(range(0, 20, 2)) + list(range(1, 20, 2)) if i not in (14, 15)]
FREE = "#ececec"
COLORS = {"weights": "#4c72b0", "kv_used": "#55a868", "kv_wasted": "#dd8452", "free": "#d9d9d9",
          "overhead": "#8172b2", "static": "#dd8452", "continuous": "#55a868", "paged": "#55a868",
          "contiguous": "#dd8452", "naive": "#c44e52", "hf": "#8172b2"}


def _ensure_png_formatter() -> None:
    """Let IPython show a pyplot-free Figure as a PNG.

    IPython learns to render Figures only once the inline backend is loaded, which happens on
    the first pyplot import; a notebook that only uses minipaged.viz never does that, and would
    show ``<Figure size ...>`` instead of the picture. The inline backend, if it loads later,
    puts its own formatter in place of this one.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or not hasattr(ip, "display_formatter"):
        return
    png = ip.display_formatter.formatters.get("image/png")
    if png is None:
        return
    try:
        png.lookup_by_type(Figure)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


_ensure_png_formatter()


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _new(figsize: tuple[float, float], nrows: int = 1, ncols: int = 1, **kw) -> tuple[Figure, Any]:
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _tidy(ax: Axes) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


# -- page table --------------------------------------------------------------------------
def _snapshot(source: Any, step: int | None) -> dict:
    """Normalise a Trace, StepRecord, Scheduler, owners list or step dict into one shape."""
    if isinstance(source, Trace):
        if not source.steps:
            raise ValueError("the trace has no steps yet: run the engine (or simulate) first")
        if source.kind != "paged":
            raise ValueError("a static-batching trace has no page table: pass a paged trace (simulate(...))")
        k = source.peak_step if step is None else step
        if not -len(source.steps) <= k < len(source.steps):
            raise IndexError(f"step {k} is outside this trace's steps 0..{len(source.steps) - 1}")
        snap = _snapshot(source.steps[k], None)
        snap["block_size"] = source.block_size
        return snap
    if isinstance(source, StepRecord):
        return {"owners": list(source.owners), "tables": dict(source.tables), "slots": dict(source.slots),
                "step": source.step, "waiting": len(source.waiting), "block_size": None}
    if hasattr(source, "allocator") and hasattr(source, "running"):  # a live Scheduler
        alloc = source.allocator
        owners: list = [None] * alloc.num_blocks
        tables = {}
        for seq in source.running:
            if seq.block_table is None:
                continue
            tables[seq.seq_id] = (tuple(seq.block_table.blocks), seq.block_table.num_tokens)
            for b in seq.block_table.blocks:  # a block several sequences share: a tuple of them, as in a Trace
                o = owners[b]
                owners[b] = seq.seq_id if o is None else (o + (seq.seq_id,) if isinstance(o, tuple) else (o, seq.seq_id))
        return {"owners": owners, "tables": tables, "slots": {sid: i for i, sid in enumerate(tables)},
                "step": None, "waiting": len(source.waiting), "block_size": alloc.block_size}
    if isinstance(source, Mapping) and "owners" in source:  # StepRecord.to_dict()
        tables = {t["request"]: (tuple(t["blocks"]), t["num_tokens"]) for t in source.get("tables", [])}
        owners = [tuple(o) if isinstance(o, list) else o for o in source["owners"]]
        return {"owners": owners, "tables": tables, "slots": {k: v for k, v in source.get("slots", [])},
                "step": source.get("step"), "waiting": len(source.get("waiting", [])), "block_size": None}
    owners = list(source)  # a bare owners list: logical order and fill are unknown
    tables: dict = {}
    for b, o in enumerate(owners):
        if o is not None:
            tables.setdefault(o, ([], None))[0].append(b)
    tables = {k: (tuple(bl), None) for k, (bl, _) in tables.items()}
    return {"owners": owners, "tables": tables, "slots": {k: i for i, k in enumerate(tables)},
            "step": None, "waiting": None, "block_size": None}


def _label(ax: Axes, x: float, y: float, text: str, **kw) -> None:
    """Text inside the axes that the layout engine need not measure (hundreds of them are slow)."""
    kw.setdefault("ha", "center")
    ax.text(x, y, text, va="center", **kw).set_in_layout(False)


def _draw_cells(ax: Axes, cells: list) -> None:
    """Blocks as three collections (pale whole block, solid filled part, outline): fast for big pools."""
    if not cells:
        return
    pale = [to_rgba(c, 0.22) for *_, c, _, _ in cells]
    solid = [to_rgba(c, 0.8) for *_, c, _, _ in cells]
    ax.add_collection(PatchCollection([Rectangle((x, y), w, h) for x, y, w, h, *_ in cells],
                                      facecolor=pale, edgecolor="none", gid="blocks"))
    ax.add_collection(PatchCollection([Rectangle((x, y), w * f, h) for x, y, w, h, _, f, _ in cells],
                                      facecolor=solid, edgecolor="none", gid="filled"))
    ax.add_collection(PatchCollection([Rectangle((x, y), w, h) for x, y, w, h, *_ in cells], facecolor="none",
                                      edgecolor="#333333", linewidths=[lw for *_, lw in cells], gid="outlines"))


def plot_page_table(trace_or_snapshot: Any, step: int | None = None, show_tables: bool = True,
                    title: str | None = None) -> Figure:
    """Physical KV blocks as a grid, coloured by the sequence that owns each; free ones grey.

    Accepts a Trace (``step=None``: the step with the fullest page table), one StepRecord, a live
    Scheduler, or a bare owners list. On the left, each running sequence's block table (logical
    block -> physical id); on the right, the pool itself. The light part of a block is slots not
    yet holding a token: with paging only a sequence's last block has one.
    """
    snap = _snapshot(trace_or_snapshot, step)
    owners, tables, slots = snap["owners"], snap["tables"], snap["slots"]
    bs = snap["block_size"]
    n = len(owners)
    if n == 0:
        raise ValueError("no blocks to draw: the pool is empty")
    ncols = max(4, min(40, math.ceil(math.sqrt(n * 1.6))))
    nrows = math.ceil(n / ncols)

    # per block: (owner colour, logical index, filled fraction)
    cinfo = {}
    order = sorted(tables, key=lambda sid: (slots.get(sid, 0), str(sid)))
    for sid in order:
        blocks, ntok = tables[sid]
        c = color(slots.get(sid, 0))
        for li, b in enumerate(blocks):
            fill = 1.0
            if ntok is not None and bs:
                fill = min(1.0, max(0.0, (ntok - li * bs) / bs))
            cinfo.setdefault(b, (c, li, fill))

    draw_tables = show_tables and tables and len(tables) <= 24
    max_logical = max((len(b) for b, _ in tables.values()), default=0)
    grid_w = max(5.0, min(12.0, ncols * 0.55))
    grid_h = max(2.2, min(9.0, nrows * 0.55 + 1.0))
    if draw_tables:
        tab_w = max(3.5, min(8.0, 1.6 + min(max_logical, 16) * 0.42))
        tab_h = 1.0 + len(tables) * 0.38
        fig, axes = _new((tab_w + grid_w, max(grid_h, tab_h)), 1, 2, width_ratios=[tab_w, grid_w])
        ax_t, ax = axes[0]
    else:
        fig, axes = _new((grid_w, grid_h))
        ax = axes[0][0]

    labels = n <= 160
    fs = 9 if ncols <= 12 else 7 if ncols <= 20 else 5.5
    cells, free = [], []
    for b, o in enumerate(owners):
        r, c = divmod(b, ncols)
        x, y = c + 0.04, nrows - 1 - r + 0.04
        if o is None:
            free.append((x, y))
        else:
            col, li, fill = cinfo.get(b, (color(0), 0, 1.0))
            shared = isinstance(o, tuple)
            cells.append((x, y, 0.92, 0.92, col, fill, 1.8 if shared else 0.8))
            if labels:
                who = "+".join(map(str, o)) if shared else str(o)
                _label(ax, x + 0.46, y + 0.36, f"{who}:{li}", fontsize=fs, fontweight="bold")
        if labels:
            _label(ax, x + 0.46, y + 0.76, f"#{b}", fontsize=fs * 0.75, color="#222222")
    _draw_cells(ax, cells)
    ax.add_collection(PatchCollection([Rectangle(xy, 0.92, 0.92) for xy in free], facecolor=FREE,
                                      edgecolor="#bbbbbb", linewidth=0.8, linestyle=(0, (2, 2)), gid="free"))
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, nrows)
    ax.set_aspect("equal")
    ax.axis("off")
    used = sum(o is not None for o in owners)
    ax.set_title(f"Physical KV pool: {used} of {n} blocks used"
                 + (f", {bs} token slots each" if bs else "") + "\n#id = physical block, 'a:i' = logical block i of seq a",
                 fontsize=10)

    if draw_tables:
        ax_t.axis("off")
        shown = min(max_logical, 16)
        rows: list = []
        for row, sid in enumerate(order):
            blocks, ntok = tables[sid]
            y = len(order) - 1 - row
            c = color(slots.get(sid, 0))
            label = f"seq {sid}" + (f" ({ntok} tok)" if ntok is not None else "")
            _label(ax_t, -0.15, y + 0.45, label, ha="right", fontsize=9)
            for li, b in enumerate(blocks[:shown]):
                fill = 1.0 if ntok is None or not bs else min(1.0, max(0.0, (ntok - li * bs) / bs))
                rows.append((li + 0.05, y + 0.08, 0.9, 0.78, c, fill, 0.8))
                _label(ax_t, li + 0.5, y + 0.47, f"#{b}", fontsize=8)
            if len(blocks) > shown:
                _label(ax_t, shown + 0.2, y + 0.47, f"… +{len(blocks) - shown}", ha="left", fontsize=8)
        _draw_cells(ax_t, rows)
        ax_t.set_xlim(-3.2, shown + 1.2)
        ax_t.set_ylim(-0.2, max(len(order), 1) + 0.1)
        ax_t.set_title("Block tables: logical block i -> physical block id", fontsize=10)

    if title is None:
        where = f"step {snap['step']}" if snap["step"] is not None else "now"
        waiting = f", {snap['waiting']} waiting" if snap["waiting"] else ""
        title = (f"Page table at {where}: {len(tables)} sequences running{waiting}\n"
                 "a sequence's blocks can lie anywhere in the pool; only its last block is part-empty (light)")
    fig.suptitle(title, fontsize=11)
    return fig


# -- memory ------------------------------------------------------------------------------
def plot_memory_bar(breakdown: MemoryBreakdown | Mapping[str, MemoryBreakdown], ax: Axes | None = None,
                    title: str | None = None) -> Figure:
    """One stacked bar per breakdown: weights | KV holding tokens | KV reserved but empty | free | overhead."""
    items = list(breakdown.items()) if isinstance(breakdown, Mapping) else [(breakdown.label or "", breakdown)]
    if ax is None:
        fig, axes = _new((10, 1.2 + 0.9 * len(items)))
        ax = axes[0][0]
    fig = ax.figure
    parts = [("weights", "weights"), ("kv_used", "KV holding tokens"), ("kv_wasted", "KV reserved, empty"),
             ("free", "free for more KV"), ("overhead", "activations + runtime")]
    device = max(b.device_bytes for _, b in items) / GiB
    for row, (label, b) in enumerate(items):
        y = len(items) - 1 - row
        g = b.as_gib()
        left = 0.0
        for key, _ in parts:
            w = g[key]
            if w <= 0:
                continue
            over = key == "weights" and not b.fits
            ax.barh(y, w, left=left, height=0.6, color="#c44e52" if over else COLORS[key], edgecolor="white",
                    hatch="//" if key == "kv_wasted" else None, linewidth=1)
            if w / device > 0.045:
                ax.text(left + w / 2, y, f"{w:.1f}", ha="center", va="center", fontsize=9,
                        color="white" if key in ("weights", "overhead", "kv_used") else "black")
            left += w
        if not b.fits:
            ax.text(0.0, y + 0.36, f"does not fit: weights alone need {g['weights']:.1f} GiB",
                    ha="left", va="bottom", fontsize=9, color="#c44e52", fontweight="bold")
    ax.axvline(device, color="black", lw=1, ls="--")
    ax.text(device, len(items) - 0.45, f" device: {device:.0f} GiB", ha="left", va="bottom", fontsize=8)
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels([lab for lab, _ in reversed(items)])
    ax.set_xlabel("GiB of device memory")
    ax.set_xlim(0, max(device, max(b.weights_bytes + b.overhead_bytes for _, b in items) / GiB) * 1.02)
    ax.set_ylim(-0.6, len(items) - 0.4 + (0.25 if any(not b.fits for _, b in items) else 0))
    ax.legend(handles=[Patch(facecolor=COLORS[k], hatch="//" if k == "kv_wasted" else None, label=lab)
                       for k, lab in parts], loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)
    _tidy(ax)
    if title is None:
        title = f"Where {device:.0f} GiB of device memory go (hatched: KV reserved but holding no token)"
    ax.set_title(title, fontsize=11)
    return fig


def format_waste(fraction: float) -> str:
    """A waste fraction as the lessons print it: one decimal under 10% (1.3%), none above (85%)."""
    return f"{fraction:.1%}" if 0 < fraction < 0.1 else f"{fraction:.0%}"


def plot_concurrency(result: Concurrency | Mapping[str, Concurrency], ax: Axes | None = None,
                     title: str | None = None) -> Figure:
    """Sequences that fit one KV budget: contiguous max-length reservation vs paged blocks.

    One Concurrency (from memory.concurrency) gives two bars; a dict {label: Concurrency}
    (e.g. one per block size or per model) gives a pair per label.
    """
    items = list(result.items()) if isinstance(result, Mapping) else [("", result)]
    if ax is None:
        fig, axes = _new((max(5.0, 1.6 + 1.8 * len(items)), 4.2))
        ax = axes[0][0]
    fig = ax.figure
    w = 0.38
    top = max(max(c.paged_seqs, c.contiguous_seqs) for _, c in items) or 1
    for i, (_, c) in enumerate(items):
        for dx, n, waste, key in ((-w / 2, c.contiguous_seqs, c.contiguous_waste, "contiguous"),
                                  (w / 2, c.paged_seqs, c.paged_waste, "paged")):
            ax.bar(i + dx, n, width=w * 0.95, color=COLORS[key])
            ax.text(i + dx, n + top * 0.02, f"{n:,}\n{format_waste(waste)} waste", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(items)))
    ax.set_xticklabels([lab or f"KV budget {format_bytes(c.kv_budget_bytes)}" for lab, c in items])
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("sequences that fit at once")
    c0 = items[0][1]
    ax.legend(handles=[Patch(color=COLORS["contiguous"], label=f"contiguous: reserve max_len={c0.max_len} each"),
                       Patch(color=COLORS["paged"], label=f"paged: blocks of {c0.block_size} as needed")],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    _tidy(ax)
    if title is None:
        g = c0.gain
        title = (f"Same KV budget: paging fits {g:.1f}x more sequences" if math.isfinite(g)
                 else "Same KV budget: only paging fits any sequence")
    ax.set_title(title, fontsize=11)
    return fig


# -- batching ----------------------------------------------------------------------------
def _timeline_of(t: Any) -> tuple[list[dict], dict | None, str]:
    if isinstance(t, Trace):
        return t.timeline(), t.summary(), t.meta.get("time_unit", "s")
    return list(t), None, "s"


def plot_timeline(timelines: Mapping[str, Any], use: str = "time", cursor: float | None = None,
                  title: str | None = None) -> Figure:
    """Gantt of which request holds which batch slot over time, one panel per system, same time axis.

    ``timelines`` maps a name to a Trace or to ``trace.timeline()``. Solid: the request is being
    computed; hatched grey: its slot is held although it is done (static batching waits for the
    batch's longest request); red edge: preempted (its KV freed, to be recomputed later). Each
    panel's title gives the slots computing on average over its run (solid bars only: a slot held
    by a finished request does not count).
    ``use="step"`` puts step indices on the x axis instead of times; ``cursor`` draws a line.
    """
    if use not in ("time", "step"):
        raise ValueError(f"use must be 'time' or 'step', got {use!r}")
    names = list(timelines)
    data = [_timeline_of(timelines[k]) for k in names]
    nslots = [max((iv["slot"] for iv in tl), default=0) + 1 for tl, _, _ in data]
    fig, axes = _new((11, 1.4 + sum(0.22 * s + 0.9 for s in nslots)), len(names), 1, sharex=True,
                     height_ratios=[s + 3 for s in nslots])
    s0, s1, f1 = ("start_time", "end_time", "finish_time") if use == "time" else ("start", "end", "finish")
    xmax = max((iv[s1] for tl, _, _ in data for iv in tl), default=1)
    unit = data[0][2] if use == "time" else "steps"
    for ax, name, (tl, summ, _), ns in zip(axes[:, 0], names, data, nslots):
        ids = sorted({iv["request"] for iv in tl}, key=str)
        rank = {r: i for i, r in enumerate(ids)}
        for iv in tl:
            y = iv["slot"]
            c = color(rank[iv["request"]])
            a, f, e = iv[s0], iv[f1], iv[s1]
            pre = iv.get("outcome") == "preempted"
            ax.barh(y, f - a, left=a, height=0.8, color=c, edgecolor="#c44e52" if pre else "white",
                    linewidth=1.5 if pre else 0.6)
            if e > f:
                ax.barh(y, e - f, left=f, height=0.8, color="#e0e0e0", edgecolor="#9a9a9a", hatch="///", linewidth=0.4)
            if (f - a) / xmax > 0.025 and ns <= 40:
                ax.text((a + f) / 2, y, str(iv["request"]), ha="center", va="center", fontsize=7)
        end = max((iv[s1] for iv in tl), default=0)
        begin = min((iv[s0] for iv in tl), default=0)
        computing = sum(iv[f1] - iv[s0] for iv in tl) / (end - begin) if end > begin else 0.0
        ax.axvline(end, color="black", lw=1, ls=":")
        label = f"{name}: done at {end:.4g} {unit}, {computing:.1f} of {ns} slot{'s' if ns != 1 else ''} computing on average"
        if summ is not None:
            label += f", KV waste {summ['kv_waste']:.0%}"
        ax.set_title(label, fontsize=10, loc="left")
        ax.set_ylabel("batch slot")
        ax.set_ylim(-0.6, ns - 0.4)
        ax.invert_yaxis()
        if ns <= 20:
            ax.set_yticks(range(ns))
        if cursor is not None:
            ax.axvline(cursor, color="#c44e52", lw=1.5)
        _tidy(ax)
    axes[-1, 0].set_xlabel(f"{'time' if use == 'time' else 'step'} ({unit})")
    axes[-1, 0].set_xlim(0, xmax * 1.01)
    axes[0, 0].legend(handles=[Patch(color=color(0), label="request computing (number = request id)"),
                               Patch(facecolor="#e0e0e0", edgecolor="#9a9a9a", hatch="///", label="slot held, request done"),
                               Patch(facecolor="white", edgecolor="#c44e52", label="preempted")],
                      loc="lower right", bbox_to_anchor=(1.0, 1.12), ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title or "Who holds each batch slot over time: static batching idles until its longest request "
                 "ends,\ncontinuous batching refills a slot the step it frees", fontsize=11)
    return fig


def plot_kv_usage(trace: Trace | Mapping[str, Trace], use: str = "step", title: str | None = None) -> Figure:
    """KV slots reserved vs slots holding a token, per step; the gap between them is waste."""
    items = list(trace.items()) if isinstance(trace, Mapping) else [(trace.kind, trace)]
    fig, axes = _new((10, 1.0 + 2.6 * len(items)), len(items), 1, sharex=True, sharey=True)
    for ax, (name, t) in zip(axes[:, 0], items):
        if not t.steps:
            raise ValueError(f"trace {name!r} has no steps")
        xs = [r.step if use == "step" else r.time for r in t.steps]
        res = [r.reserved_slots for r in t.steps]
        usd = [r.used_slots for r in t.steps]
        ax.fill_between(xs, 0, res, step="post", color=COLORS["kv_wasted"], alpha=0.35, label="reserved, empty (waste)")
        ax.fill_between(xs, 0, usd, step="post", color=COLORS["kv_used"], alpha=0.9, label="holding a token")
        ax.step(xs, res, where="post", color=COLORS["kv_wasted"], lw=1.2, label="reserved")
        if t.num_blocks and t.block_size:
            ax.axhline(t.num_blocks * t.block_size, color="black", ls="--", lw=1, label="whole pool")
        ax.set_ylabel("KV token slots")
        ax.set_title(f"{name}: {t.kv_waste():.0%} of reserved slots held no token (averaged over steps)",
                     fontsize=10, loc="left")
        # Beside the plot, not on it: the whole-pool line and the curves run under the top right.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        _tidy(ax)
    axes[-1, 0].set_xlabel("step" if use == "step" else "time")
    fig.suptitle(title or "KV cache: reserved vs really used", fontsize=11)
    return fig


def plot_throughput(results: Mapping[str, Any], baseline: str | None = None, title: str | None = None) -> Figure:
    """Bars of output tokens/s per system, each labelled with its ratio to ``baseline``.

    ``results`` maps a name to a number or a dict with ``output_tokens_per_s`` (what
    ``LLMEngine.stats()`` and the baselines return). ``baseline`` defaults to 'naive' if
    present, else the first entry.
    """
    if not results:
        raise ValueError("no results to plot: pass e.g. {'naive': {...}, 'continuous': {...}}")
    names = list(results)
    vals = [float(v["output_tokens_per_s"] if isinstance(v, Mapping) else v) for v in results.values()]
    base = baseline or ("naive" if "naive" in results else names[0])
    if base not in results:
        raise KeyError(f"baseline {base!r} is not one of {names}")
    bval = vals[names.index(base)]
    fig, axes = _new((max(5.0, 1.5 + 1.5 * len(names)), 4.2))
    ax = axes[0][0]
    for i, (n, v) in enumerate(zip(names, vals)):
        ax.bar(i, v, color=COLORS.get(n, color(i)), width=0.65)
        ratio = f"\n{v / bval:.1f}x {base}" if bval > 0 and n != base else ""
        ax.text(i, v, f"{v:,.1f} tok/s{ratio}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("output tokens per second")
    ax.set_ylim(0, max(vals) * 1.25 or 1)
    _tidy(ax)
    best = names[max(range(len(vals)), key=vals.__getitem__)]
    ax.set_title(title or f"Throughput on the same requests (higher is better): {best} wins", fontsize=11)
    return fig
