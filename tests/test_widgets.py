"""The widget apps: built, their controls moved programmatically, their numbers and pictures checked.

Runs against the installed ipywidgets (8 here); the apps use only APIs that 7.7 (Colab) has too.
The static fallback (MINIPAGED_STATIC=1, or no ipywidgets) is tested as well, and one test runs
the apps inside a real kernel to see what a notebook would store.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import sys

import pytest
from matplotlib.figure import Figure

from minipaged import memory as mem
from minipaged import widgets
from minipaged.bench.simulate import sample_requests, simulate, simulate_static
from minipaged.trace import StepRecord, Trace

ipywidgets = pytest.importorskip("ipywidgets")
REQS = sample_requests(24, seed=11)


@pytest.fixture(autouse=True)
def _widget_mode(monkeypatch):
    monkeypatch.delenv("MINIPAGED_STATIC", raising=False)


@pytest.fixture(scope="module")
def runs():
    return simulate(REQS, num_blocks=48, block_size=8, max_num_seqs=6), simulate_static(REQS, batch_size=6)


def _suptitle(fig: Figure) -> str:
    return fig._suptitle.get_text()


def test_memory_calculator_controls_move_the_numbers():
    app = widgets.memory_calculator(device_gib=24, model="Llama-2-7B", seq_len=300, max_len=2048)
    assert not app.static and isinstance(app.widget, ipywidgets.VBox)
    for name in ("device_gib", "model", "seq_len", "max_len", "block_size", "kv_dtype", "weights_dtype",
                 "overhead_fraction", "custom_params_b", "custom_layers", "custom_kv_heads", "custom_head_dim"):
        assert getattr(app, name) is app.controls[name]
    r0 = dict(app.result)
    assert (r0["contiguous_seqs"], r0["paged_seqs"], r0["kv_bytes_per_token"]) == (9, 60, 512 * 1024)
    assert "contiguous fits 9" in _suptitle(app.figure) and "paged fits 60" in _suptitle(app.figure)
    assert app.custom_layers.disabled, "custom sliders are off unless the model is 'custom'"

    renders, fig = app.renders, app.figure
    app.seq_len.value = 1000  # longer sequences: fewer fit paged, contiguous reserves max_len anyway
    assert app.renders == renders + 1 and app.figure is not fig
    assert app.result["contiguous_seqs"] == 9 and app.result["paged_seqs"] == 1158 // 63 == 18
    assert "paged fits 18" in _suptitle(app.figure)

    app.max_len.value = 4096  # a bigger reservation: fewer contiguous sequences
    assert app.result["contiguous_seqs"] == 4
    app.device_gib.value = 80
    assert app.result["contiguous_seqs"] > 4 and app.result["paged_seqs"] > 18
    n16 = app.result["paged_seqs"]
    app.kv_dtype.value = "float32"  # twice the bytes per token
    assert app.result["kv_bytes_per_token"] == 1024 * 1024 and app.result["paged_seqs"] < n16
    app.kv_dtype.value = "float16"
    app.block_size.value = 256
    assert app.result["paged_waste"] == pytest.approx(1 - 1000 / 1024)
    app.weights_dtype.value = "int4"
    assert app.result["weights_bytes"] == mem.weights_bytes("Llama-2-7B", "int4")

    app.model.value = "custom"
    assert not app.custom_layers.disabled
    app.custom_layers.value = 32
    bpt = app.result["kv_bytes_per_token"]
    assert bpt == 2 * 32 * 8 * 64 * 2
    app.custom_kv_heads.value = 16
    assert app.result["kv_bytes_per_token"] == 2 * bpt
    app.model.value = "Llama-3-8B"
    assert app.custom_layers.disabled and app.result["kv_bytes_per_token"] == 128 * 1024


def test_memory_calculator_set_and_edges():
    app = widgets.memory_calculator()
    n = app.renders
    app.set(device_gib=12, seq_len=100)  # two controls, one redraw
    assert app.renders == n + 1 and app.device_gib.value == 12
    assert not app.result["fits"] and app.result["paged_seqs"] == 0
    # no fake "0% waste, 1.0x" for a model that does not fit: no numbers, and a sentence instead
    assert app.result["gain"] is None and app.result["contiguous_waste"] is None and app.result["paged_waste"] is None
    assert "does not fit" in _suptitle(app.figure) and "does not fit" in app.readout.value
    assert "1.0x" not in app.readout.value and "0%" not in app.readout.value
    texts = [t.get_text() for ax in app.figure.axes for t in ax.texts]
    assert "no sequence fits" in texts and not any("waste" in t for t in texts), texts
    app.set(device_gib=40, seq_len=5000, max_len=2048)  # longer than the reservation: capped, and said so
    assert app.result["seq_len"] == 2048 and app.result["contiguous_waste"] == 0.0
    assert app.result["clamped"] and app.result["seq_len_asked"] == 5000
    assert "clamped to 2,048" in app.readout.value and "clamped to 2,048" in _suptitle(app.figure)
    app.set(seq_len=2048)  # exactly max_len is not clamped
    assert not app.result["clamped"] and "clamped" not in app.readout.value
    with pytest.raises(KeyError, match="unknown control"):
        app.set(colour="red")


def test_memory_calculator_columns_wrap():
    """Two 460 px columns side by side overflow a narrow screen: the row must wrap, each column shrink."""
    app = widgets.memory_calculator()
    row = app.widget.children[0]
    assert isinstance(row, ipywidgets.HBox) and row.layout.flex_flow == "row wrap"
    for col in row.children:
        assert col.layout.max_width == "100%" and col.layout.width == "460px"
        for c in col.children:
            assert c.layout.max_width == "100%", c.description


def test_readout_text_follows_the_controls():
    app = widgets.memory_calculator(device_gib=24, seq_len=300, max_len=2048)
    assert "contiguous fits 9, paged fits 60 (6.7x)" in app.readout.value
    app.seq_len.value = 1000
    assert "paged fits 18" in app.readout.value


def test_page_table_explorer(runs):
    trace, _ = runs
    app = widgets.page_table_explorer(trace)
    assert app.step.value == trace.peak_step and app.result["step"] == trace.peak_step
    assert isinstance(app.play, ipywidgets.Play) and app.play.max == app.step.max == len(trace) - 1
    assert app.link.source == (app.play, "value") and app.link.target == (app.step, "value")
    for k in (0, 5, len(trace) - 1):
        app.step.value = k
        assert app.result["step"] == k
        assert app.result["blocks_used"] == trace[k].blocks_used
        assert app.result["running"] == list(trace[k].running)
        assert f"step {k}" in _suptitle(app.figure)
    with pytest.raises(ValueError, match="paged Trace"):
        widgets.page_table_explorer(runs[1])


def test_batching_timeline(runs):
    cont, stat = runs
    app = widgets.batching_timeline(stat, cont)
    n = len(REQS)
    # starts where the continuous run is done and static batching is not
    assert app.result["continuous"]["done"] == n and app.result["static"]["done"] < n
    assert app.result["time"] == pytest.approx(cont.total_time)
    app.tick.value = 0
    assert app.result["static"]["done"] == app.result["continuous"]["done"] == 0
    assert app.result["static"]["computing"] == 6 == app.result["continuous"]["computing"]
    app.tick.value = app.ticks
    assert app.result["static"]["done"] == n and app.result["static"]["computing"] == 0
    mid = app.tick_of(stat.total_time / 2)
    app.tick.value = mid
    assert app.result["static"]["held_idle"] + app.result["static"]["computing"] == 6
    assert "At time" in _suptitle(app.figure)
    assert isinstance(app.play, ipywidgets.Play)
    # Play drives the slider's index; the slider reads out times in the traces' unit, not tick numbers
    assert app.link.target == (app.tick, "index")
    assert app.tick.label == app.label_of(mid) == f"{app.time_at(mid):.4g} steps"


def _timed_static_trace(start: float, finishes: list[float], end: float) -> Trace:
    """One static batch as baselines.run_static records it: every slot starts a little after 0."""
    t = Trace(kind="static")
    t.steps.append(StepRecord(step=0, time=end, running=(), waiting=(), batch=(), prefill_tokens=0, decode_tokens=0,
                              sampled_tokens=0, preemptions=0, reserved_slots=0, used_slots=0, slots={}))
    t.meta["time_unit"] = "s"
    for slot, f in enumerate(finishes):
        t._closed.append({"request": slot, "slot": slot, "start": 0, "end": 1, "start_time": start,
                          "end_time": end, "finish": 1, "finish_time": f, "outcome": "length"})
    return t


def test_batching_timeline_first_tick_shows_the_first_batch_computing():
    """A real run's first batch starts ~7e-5 s in: the cursor at its first tick must count it."""
    stat = _timed_static_trace(7e-5, [0.4, 1.0, 2.5, 3.0], end=3.0)
    cont = _timed_static_trace(0.0, [0.5, 0.9, 1.2, 1.5], end=1.5)
    app = widgets.batching_timeline(stat, cont)
    app.tick.value = 0
    assert app.result["time"] == 0.0
    assert app.result["static"]["computing"] == 4 and app.result["continuous"]["computing"] == 4
    assert "static: 0/4 done, 4 computing" in app.readout.value
    assert app.tick.label == "0 s" and app.label_of(app.ticks) == "3 s"
    app.tick.value = app.tick_of(1.1)  # static: 1 of 4 finished, its slot idles until the batch ends
    r = app.result["static"]
    assert (r["done"], r["computing"], r["held_idle"]) == (2, 2, 2)
    assert app.tick.label.endswith(" s") and float(app.tick.label.split()[0]) == pytest.approx(app.result["time"], rel=1e-3)
    app.tick.value = app.ticks
    assert app.result["static"]["done"] == 4 and app.result["static"]["computing"] == 0
    app.values["tick"] = app.ticks + 1
    with pytest.raises(IndexError, match="tick_of"):
        app.compute()


def test_static_fallback_with_env(monkeypatch, runs):
    monkeypatch.setenv("MINIPAGED_STATIC", "1")
    assert widgets.static_mode()
    trace, stat = runs
    for app in (widgets.memory_calculator(), widgets.page_table_explorer(trace), widgets.batching_timeline(stat, trace)):
        assert app.static and app.widget is None and app.controls == {}
        assert isinstance(app.figure, Figure) and app.renders == 1
        shown = []
        monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
        app._ipython_display_()
        assert shown == [app.figure], "a static app shows its picture, nothing to wait on"
    calc = widgets.memory_calculator()
    assert calc.seq_len is None
    calc.set(seq_len=1000)  # still usable from code
    assert calc.result["paged_seqs"] == 18


def test_static_fallback_without_ipywidgets(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    assert widgets.static_mode()
    app = widgets.memory_calculator()
    assert app.static and app.widget is None and app.result["paged_seqs"] == 60


def test_widget_mode_displays_the_container(monkeypatch):
    app = widgets.memory_calculator()
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    app._ipython_display_()
    assert shown == [app.widget]


@pytest.mark.slow
def test_in_a_kernel_widgets_and_static_pictures():
    """What a notebook stores: a widget view normally, a PNG under MINIPAGED_STATIC=1.

    No pyplot import anywhere: the figures must still show as pictures, not as '<Figure ...>'.
    """
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    setup = ("from minipaged import widgets, viz\n"
             "from minipaged.bench.simulate import simulate, simulate_static\n"
             "R = [(20, 12), (8, 30), (40, 5), (16, 16)]\n"
             "t, s = simulate(R, num_blocks=16, block_size=8), simulate_static(R, batch_size=2)")
    apps = ["widgets.memory_calculator()", "widgets.page_table_explorer(t)", "widgets.batching_timeline(s, t)"]
    cells = [setup, "import os; os.environ.pop('MINIPAGED_STATIC', None)",
             "app = widgets.page_table_explorer(t); app.step.value = 2; app",
             "os.environ['MINIPAGED_STATIC'] = '1'", *apps, "viz.plot_page_table(t)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    kinds = [[set(o.get("data", {})) for o in c.outputs] for c in nb.cells]
    widget_mime = "application/vnd.jupyter.widget-view+json"
    assert any(widget_mime in d for d in kinds[2]), f"widget mode should store a widget view, got {kinds[2]}"
    # each redraw went into the app's Output widget as a PNG, replacing the one before
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    outs = [m["state"].get("outputs", []) for m in state.values() if m["model_name"] == "OutputModel"]
    assert outs and all(len(o) == 1 and "image/png" in o[0]["data"] for o in outs), outs
    for k in kinds[4:8]:
        assert any("image/png" in d for d in k) and not any(widget_mime in d for d in k), k
