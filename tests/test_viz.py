"""Every plot renders to a PNG, and draws what it claims (blocks, bars, slots)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from minipaged import BlockAllocator, Scheduler, Sequence
from minipaged import memory as mem
from minipaged import viz
from minipaged.bench.simulate import sample_requests, simulate, simulate_static

REQS = sample_requests(24, seed=5)


@pytest.fixture(scope="module")
def runs():
    return {
        "continuous": simulate(REQS, num_blocks=40, block_size=8, max_num_seqs=6),
        "static": simulate_static(REQS, batch_size=6),
    }


def _png(fig: Figure, path) -> bytes:
    assert isinstance(fig, Figure)
    fig.savefig(path, dpi=60)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    return data


def _texts(fig: Figure) -> str:
    parts = [t.get_text() for ax in fig.axes for t in ax.texts]
    parts += [ax.get_title() for ax in fig.axes] + [ax.get_title(loc="left") for ax in fig.axes]
    if fig._suptitle is not None:
        parts.append(fig._suptitle.get_text())
    return "\n".join(parts)


def _cells(fig: Figure, gid: str) -> int:
    """Blocks drawn in the collection named ``gid`` ('free', or 'blocks' for used ones)."""
    return sum(len(c.get_paths()) for ax in fig.axes for c in ax.collections if c.get_gid() == gid)


def _free_cells(fig: Figure) -> int:
    return _cells(fig, "free")


def test_page_table_from_trace_step(runs, tmp_path):
    trace = runs["continuous"]
    k = trace.peak_step
    rec = trace[k]
    fig = viz.plot_page_table(trace)
    _png(fig, tmp_path / "pt.png")
    assert _free_cells(fig) == rec.blocks_free
    # used blocks: once in the pool, once more in the block tables panel
    assert _cells(fig, "blocks") == 2 * rec.blocks_used
    text = _texts(fig)
    assert f"step {k}" in text and f"{rec.blocks_used} of 40 blocks used" in text
    for sid, (blocks, _) in rec.tables.items():
        assert f"seq {sid} (" in text
        for li, b in enumerate(blocks):
            assert f"{sid}:{li}" in text and f"#{b}" in text
    fig0 = viz.plot_page_table(trace, step=0)
    assert _free_cells(fig0) == trace[0].blocks_free
    assert "step 0" in _texts(fig0)
    with pytest.raises(IndexError):
        viz.plot_page_table(trace, step=10_000)
    with pytest.raises(ValueError, match="static"):
        viz.plot_page_table(runs["static"])


def test_page_table_from_other_sources(runs, tmp_path):
    rec = runs["continuous"][3]
    _png(viz.plot_page_table(rec), tmp_path / "rec.png")
    _png(viz.plot_page_table(rec.to_dict()), tmp_path / "dict.png")
    owners = [None, "A", "A", None, "B", "C", "C", "C", None, "B"] + [None] * 10  # the blog's 20 pages
    fig = viz.plot_page_table(owners)
    _png(fig, tmp_path / "owners.png")
    assert _free_cells(fig) == 13 and "7 of 20 blocks used" in _texts(fig)
    alloc = BlockAllocator(12, block_size=4)
    sched = Scheduler(alloc)
    for i, n in enumerate([5, 9, 2]):
        sched.add_request(Sequence(f"r{i}", list(range(n)), max_tokens=4))
    sched.schedule()
    fig = viz.plot_page_table(sched)
    assert _free_cells(fig) == alloc.num_free_blocks == 12 - 2 - 3 - 1
    _png(fig, tmp_path / "sched.png")
    big = simulate(REQS, num_blocks=300, block_size=2, max_num_seqs=30)
    _png(viz.plot_page_table(big), tmp_path / "big.png")  # no labels, no tables: still draws


def test_a_live_scheduler_shows_shared_blocks_as_shared(tmp_path):
    """Copy-on-write forks (n > 1) share their prompt's blocks: a live scheduler's snapshot says so."""
    from minipaged.parts import fork_table

    alloc = BlockAllocator(12, block_size=4)
    sched = Scheduler(alloc)
    sched.add_request(Sequence("a", list(range(9)), max_tokens=4))
    sched.schedule()
    (parent,) = sched.running
    child = Sequence("a#1", list(range(9)), max_tokens=4)
    child.block_table = fork_table(parent.block_table)
    sched.running.append(child)
    snap = viz._snapshot(sched, None)
    shared = [o for o in snap["owners"] if isinstance(o, tuple)]
    assert shared == [("a", "a#1")] * 3, snap["owners"]
    _png(viz.plot_page_table(sched), tmp_path / "shared.png")


def test_memory_bar(tmp_path):
    b = mem.memory_breakdown(24 * mem.GiB, "Llama-2-7B")
    c = mem.concurrency(b.kv_budget_bytes, "Llama-2-7B", 300, 2048)
    fig = viz.plot_memory_bar({"contiguous": b.with_kv(c.contiguous_reserved_bytes, c.contiguous_used_bytes),
                               "paged": b.with_kv(c.paged_reserved_bytes, c.paged_used_bytes)})
    _png(fig, tmp_path / "mem.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["paged", "contiguous"]
    widths = sorted(round(p.get_width(), 2) for p in ax.patches if p.get_width() > 0)
    assert round(b.weights_bytes / mem.GiB, 2) in widths
    assert "12.6" in _texts(fig) and "24 GiB" in _texts(fig)
    nofit = viz.plot_memory_bar(mem.memory_breakdown(8 * mem.GiB, "Llama-3-8B"))
    _png(nofit, tmp_path / "nofit.png")
    assert "does not fit" in _texts(nofit)


def test_concurrency(tmp_path):
    c = mem.concurrency(9 * mem.GiB, "Llama-2-7B", 300, 2048)
    fig = viz.plot_concurrency(c)
    _png(fig, tmp_path / "conc.png")
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [c.contiguous_seqs, c.paged_seqs]
    assert f"{c.gain:.1f}x" in _texts(fig)
    # Rounded the way the lessons print them: the budget as format_bytes does, waste to 0.1% under 10%.
    text = _texts(fig) + "\n" + "\n".join(t.get_text() for t in fig.axes[0].get_xticklabels())
    assert f"KV budget {mem.format_bytes(c.kv_budget_bytes)}" in text
    assert f"{c.paged_waste:.1%} waste" in text and f"{c.contiguous_waste:.0%} waste" in text
    b = mem.memory_breakdown(24 * mem.GiB, "Llama-2-7B")  # lesson 01's calculator: 9.05 GiB, 1.3% paged waste
    c24 = mem.concurrency(b.kv_budget_bytes, "Llama-2-7B", 300, 2048)
    fig24 = viz.plot_concurrency(c24)
    ticks = [t.get_text() for t in fig24.axes[0].get_xticklabels()]
    assert ticks == [f"KV budget {mem.format_bytes(b.kv_budget_bytes)}"] and "1.3% waste" in _texts(fig24)
    assert viz.format_waste(0.853) == "85%" and viz.format_waste(0.0134) == "1.3%" and viz.format_waste(0) == "0%"
    by_bs = {f"block {bs}": mem.concurrency(9 * mem.GiB, "Llama-2-7B", 300, 2048, bs) for bs in (16, 256)}
    fig = viz.plot_concurrency(by_bs)
    _png(fig, tmp_path / "conc2.png")
    assert len(fig.axes[0].patches) == 4


def test_timeline(runs, tmp_path):
    fig = viz.plot_timeline({"static": runs["static"], "continuous": runs["continuous"]})
    _png(fig, tmp_path / "tl.png")
    ax_s, ax_c = fig.axes[:2]
    assert ax_s.get_xlim() == ax_c.get_xlim(), "both panels share one time axis"
    n_static = len(runs["static"].timeline())
    solid = [p for p in ax_s.patches if p.get_hatch() is None]
    assert len(solid) == n_static
    # static holds slots idle; a continuous run never does
    assert any(p.get_hatch() == "///" for p in ax_s.patches)
    assert not any(p.get_hatch() == "///" for p in ax_c.patches)
    assert f"done at {runs['continuous'].total_time:g}" in _texts(fig)
    # The average counts computing slots only: static's held-but-done (hatched) slots are not busy.
    for ax, key in ((ax_s, "static"), (ax_c, "continuous")):
        tl = runs[key].timeline()
        end = max(iv["end_time"] for iv in tl)
        begin = min(iv["start_time"] for iv in tl)
        computing = sum(iv["finish_time"] - iv["start_time"] for iv in tl) / (end - begin)
        ns = max(iv["slot"] for iv in tl) + 1
        assert f"{computing:.1f} of {ns} slots computing on average" in ax.get_title(loc="left")
    held = runs["static"].summary()["mean_concurrency"]  # slots held per step, idle ones included
    static_computing = float(ax_s.get_title(loc="left").split(" of ")[0].rsplit(" ", 1)[-1])
    assert static_computing < held - 0.5, "static's idle (hatched) slots must not count as computing"
    fig = viz.plot_timeline({"a": runs["continuous"].timeline()}, use="step", cursor=10)
    _png(fig, tmp_path / "tl2.png")
    with pytest.raises(ValueError):
        viz.plot_timeline({"a": runs["static"]}, use="tokens")


def test_kv_usage(runs, tmp_path):
    fig = viz.plot_kv_usage(runs["continuous"])
    _png(fig, tmp_path / "kv.png")
    # The legend sits beside the plot, so the dashed whole-pool line does not run through it.
    fig.canvas.draw()
    ax = fig.axes[0]
    legend_box, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend_box.x0 >= axes_box.x1, "the legend must not overlap the plot"
    assert f"{runs['continuous'].kv_waste():.0%}" in _texts(fig)
    fig = viz.plot_kv_usage(runs)
    _png(fig, tmp_path / "kv2.png")
    assert len(fig.axes) == 2


def test_throughput(tmp_path):
    fig = viz.plot_throughput({"naive": {"output_tokens_per_s": 20.0}, "static": {"output_tokens_per_s": 80.0},
                               "continuous": {"output_tokens_per_s": 190.0}, "hf": 50})
    _png(fig, tmp_path / "tp.png")
    text = _texts(fig)
    assert "9.5x naive" in text and "4.0x naive" in text and "continuous wins" in text
    assert [round(p.get_height()) for p in fig.axes[0].patches] == [20, 80, 190, 50]
    fig = viz.plot_throughput({"static": 10, "continuous": 30}, baseline="static")
    assert "3.0x static" in _texts(fig)
    with pytest.raises(KeyError):
        viz.plot_throughput({"a": 1}, baseline="b")
    with pytest.raises(ValueError):
        viz.plot_throughput({})
