"""Every plot renders to a PNG, and draws what it claims (blocks, bars, slots)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from matplotlib.figure import Figure

from minipaged import BlockAllocator, Scheduler, Sequence
from minipaged import memory as mem
from minipaged import viz
from minipaged.trace import sample_requests, simulate, simulate_static

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
    fig = viz.plot_timeline({"a": runs["continuous"].timeline()}, use="step", cursor=10)
    _png(fig, tmp_path / "tl2.png")
    with pytest.raises(ValueError):
        viz.plot_timeline({"a": runs["static"]}, use="tokens")


def test_kv_usage(runs, tmp_path):
    fig = viz.plot_kv_usage(runs["continuous"])
    _png(fig, tmp_path / "kv.png")
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
