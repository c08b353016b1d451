"""Interactive front ends for the pictures: a memory calculator, a page-table explorer, a batching Gantt.

Owns the controls and their wiring only; the numbers come from memory.py and trace.py, the
pictures from viz.py. Only core ipywidgets (sliders, dropdowns, Play + jslink, Output, boxes)
that behave the same in ipywidgets 7.7 (Colab) and 8.x. Where widgets cannot render (no
ipywidgets, or ``MINIPAGED_STATIC=1`` as the notebook runner and nbval set it), every app shows
the picture for its initial values instead and never waits for input.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
import os
from typing import Any

from matplotlib.figure import Figure

from . import memory as mem
from . import viz
from .trace import Trace


def static_mode() -> bool:
    """True when widgets cannot be shown: MINIPAGED_STATIC is set, or ipywidgets is missing."""
    if os.environ.get("MINIPAGED_STATIC", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    return False


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


class App(ABC):
    """A small interactive picture: ``values`` in, ``result`` (numbers) and ``figure`` out.

    In widget mode each control is an attribute (``app.seq_len.value = 900`` recomputes) and
    ``app.widget`` is the container; in static mode the attributes are None and ``app.widget``
    is None. ``app.set(name=value, ...)`` works in both, and ``app.update()`` recomputes.
    Leave the app last in a cell to show it.
    """

    def __init__(self, values: dict[str, Any], static: bool | None = None) -> None:
        self.static = static_mode() if static is None else bool(static)
        self.values: dict[str, Any] = dict(values)
        self.result: dict[str, Any] = {}
        self.figure: Figure | None = None
        self.renders = 0
        self.widget = None
        self.out = None
        self.controls: dict[str, Any] = {}
        self.readout = None
        self._holding = False

    # -- subclasses fill these in ----------------------------------------------------------
    @abstractmethod
    def _controls(self, w) -> list:
        """Build the controls into self.controls; return the rows of the layout."""

    @abstractmethod
    def compute(self) -> dict[str, Any]:
        """The numbers the picture shows, for the current control values."""

    @abstractmethod
    def draw(self) -> Figure:
        """The picture for self.result."""

    def summary(self) -> str:
        """The result as one line of plain text: what the readout under the controls says."""
        return ""

    # -- the machinery ---------------------------------------------------------------------
    def _build(self) -> "App":
        if not self.static:
            import ipywidgets as w

            rows = self._controls(w)
            for name, c in self.controls.items():
                setattr(self, name, c)
                if hasattr(c, "value") and name in self.values:
                    c.observe(self._on_change, names="value")
            self.out = w.Output()
            # The numbers as text too: readable without the picture, and what a browser test reads.
            self.readout = w.HTML(value="")
            self.readout.add_class("minipaged-readout")
            self.widget = w.VBox(rows + [self.readout, self.out])
            self.widget.add_class("minipaged-app")
            self.widget.add_class(f"minipaged-{type(self).__name__.lower()}")
        else:
            for name in self._control_names():
                setattr(self, name, None)
        self.update()
        return self

    def _control_names(self) -> list[str]:
        return list(self.values)

    def _on_change(self, change=None) -> None:
        if not self._holding:
            self.update()

    def set(self, **values: Any) -> "App":
        """Change several values at once (moving the controls too), then recompute once."""
        unknown = set(values) - set(self.values)
        if unknown:
            raise KeyError(f"unknown control(s) {sorted(unknown)}: this app has {sorted(self.values)}")
        self._holding = True
        try:
            for k, v in values.items():
                if k in self.controls:
                    self.controls[k].value = v
                else:
                    self.values[k] = v
        finally:
            self._holding = False
        self.update()
        return self

    def update(self, *_: Any) -> dict[str, Any]:
        """Read the controls, recompute the numbers, redraw the picture; return the numbers."""
        for k, c in self.controls.items():
            if k in self.values:
                self.values[k] = c.value
        self._sync_controls()
        self.result = self.compute()
        self.figure = self.draw()
        self.renders += 1
        if self.out is not None and _in_kernel():
            from IPython.display import display

            self.out.clear_output(wait=True)
            with self.out:
                display(self.figure)
        if self.readout is not None:  # after the picture, so text and picture never disagree for long
            import html

            self.readout.value = f"<span class='minipaged-summary'>{html.escape(self.summary())}</span>"
        return self.result

    def _sync_controls(self) -> None:
        """Hook: enable/disable or re-range controls after a change."""

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if self.widget is not None:
            display(self.widget)
        else:
            display(self.figure)

    def __repr__(self) -> str:
        mode = "static picture" if self.static else "widgets"
        return f"{type(self).__name__}({mode}, {self.result})"


_SLIDER_STYLE = {"description_width": "150px"}


def _layout(w, width: str = "460px"):
    # max_width: on a narrow screen a control shrinks to its column instead of overflowing it
    return w.Layout(width=width, max_width="100%")


# -- memory calculator -------------------------------------------------------------------
_KV_DTYPES = [("fp32", "float32"), ("fp16 / bf16", "float16"), ("fp8", "fp8"), ("fp8 e5m2", "fp8_e5m2"),
              ("int8 (a scale per block)", "int8")]  # kv_cache_dtype's names (kv_quant.py)
_W_DTYPES = [("fp32", "float32"), ("fp16 / bf16", "float16"), ("int8", "int8"), ("int4", "int4")]
_BLOCK_SIZES = [1, 8, 16, 32, 64, 128, 256]


class MemoryCalculator(App):
    """Device memory, model, lengths, block size, dtypes -> memory bar, sequences that fit, waste."""

    def _controls(self, w) -> list:
        v = self.values
        st = _SLIDER_STYLE

        def slider(cls, name, desc, lo, hi, step, **kw):
            self.controls[name] = cls(value=v[name], min=lo, max=hi, step=step, description=desc,
                                      continuous_update=False, style=st, layout=_layout(w), **kw)
            return self.controls[name]

        def dropdown(name, desc, options):
            self.controls[name] = w.Dropdown(options=options, value=v[name], description=desc, style=st,
                                             layout=_layout(w))
            return self.controls[name]

        left = [
            slider(w.IntSlider, "device_gib", "device memory (GiB)", 1, 192, 1),
            dropdown("model", "model", list(mem.MODEL_CONFIGS) + ["custom"]),
            dropdown("weights_dtype", "weights dtype", _W_DTYPES),
            slider(w.FloatSlider, "overhead_fraction", "overhead fraction", 0.0, 0.5, 0.01),
            slider(w.IntSlider, "seq_len", "actual length (tokens)", 1, 32768, 1),
            slider(w.IntSlider, "max_len", "contiguous max_len", 16, 32768, 16),
            dropdown("block_size", "block size", _BLOCK_SIZES),
            dropdown("kv_dtype", "KV dtype", _KV_DTYPES),
        ]
        right = [
            slider(w.FloatSlider, "custom_params_b", "custom: params (B)", 0.05, 120.0, 0.05),
            slider(w.IntSlider, "custom_layers", "custom: layers", 1, 128, 1),
            slider(w.IntSlider, "custom_kv_heads", "custom: KV heads", 1, 128, 1),
            slider(w.IntSlider, "custom_head_dim", "custom: head dim", 16, 256, 16),
        ]
        # Two columns side by side when there is room, one under the other below ~950 px.
        col = dict(width="460px", max_width="100%")
        return [w.HBox([w.VBox(left, layout=w.Layout(**col)), w.VBox(right, layout=w.Layout(**col))],
                       layout=w.Layout(flex_flow="row wrap", width="100%"))]

    def _sync_controls(self) -> None:
        custom = self.values["model"] == "custom"
        for name in ("custom_params_b", "custom_layers", "custom_kv_heads", "custom_head_dim"):
            if name in self.controls:
                self.controls[name].disabled = not custom

    def model_config(self) -> mem.ModelConfig:
        v = self.values
        if v["model"] == "custom":
            return mem.custom_model(v["custom_params_b"] * 1e9, v["custom_layers"], v["custom_kv_heads"],
                                    v["custom_head_dim"], name=f"custom {v['custom_params_b']:g}B")
        return mem.get_model(v["model"])

    def compute(self) -> dict[str, Any]:
        v = self.values
        cfg = self.model_config()
        asked, max_len = int(v["seq_len"]), int(v["max_len"])
        # A sequence never outgrows its contiguous reservation: longer ones are cut to max_len,
        # and the result says so (``clamped``) rather than quietly showing another length.
        seq_len = min(asked, max_len)
        b = mem.memory_breakdown(int(v["device_gib"]) * mem.GiB, cfg, v["weights_dtype"], float(v["overhead_fraction"]))
        c = mem.concurrency(b.kv_budget_bytes, cfg, seq_len, max_len, int(v["block_size"]), v["kv_dtype"])
        self._breakdown, self._concurrency = b, c
        fits = b.fits
        # A model that does not fit has no waste and no gain to speak of: None, never 0% and 1.0x.
        return {
            "model": cfg.name, "fits": fits, "weights_bytes": b.weights_bytes, "kv_budget_bytes": b.kv_budget_bytes,
            "kv_bytes_per_token": c.bytes_per_token, "num_blocks": c.num_blocks,
            "seq_len": seq_len, "seq_len_asked": asked, "clamped": asked > max_len,
            "contiguous_seqs": c.contiguous_seqs, "paged_seqs": c.paged_seqs,
            "gain": c.gain if fits and c.paged_seqs else None,
            "contiguous_waste": c.contiguous_waste if fits else None,
            "paged_waste": c.paged_waste if fits else None,
        }

    def notes(self) -> list[str]:
        """What the numbers do not say by themselves: a clamped length, a model that does not fit."""
        r, b = self.result, self._breakdown
        out = []
        if not r["fits"]:
            out.append(f"{r['model']} does not fit this device: its weights ({mem.format_bytes(b.weights_bytes)}) and "
                       f"overhead ({mem.format_bytes(b.overhead_bytes)}) need more than {mem.format_bytes(b.device_bytes)}; "
                       "no sequence fits. Pick a larger device, a smaller model or a smaller weights dtype.")
        elif r["paged_seqs"] == 0:
            out.append(f"the KV budget ({mem.format_bytes(b.kv_budget_bytes)}) holds no sequence of {r['seq_len']} tokens, "
                       "paged or contiguous")
        if r["clamped"]:
            out.append(f"actual length {r['seq_len_asked']:,} > max_len {self.values['max_len']:,}: clamped to "
                       f"{r['seq_len']:,} (a contiguous reservation cannot hold more); raise max_len to see longer sequences")
        return out

    def summary(self) -> str:
        r = self.result
        notes = self.notes()
        if not r["fits"] or not r["paged_seqs"]:
            return " | ".join(notes)
        gain = f"{r['gain']:.1f}x" if math.isfinite(r["gain"]) else "only paging fits any"
        head = (f"{r['model']}: KV budget {mem.format_bytes(r['kv_budget_bytes'])}, "
                f"{mem.format_bytes(r['kv_bytes_per_token'])} per token; sequences of {r['seq_len']:,} tokens: "
                f"contiguous fits {r['contiguous_seqs']:,}, paged fits {r['paged_seqs']:,} ({gain}); "
                f"waste {viz.format_waste(r['contiguous_waste'])} vs {viz.format_waste(r['paged_waste'])}")
        return " | ".join([head] + notes)

    def draw(self) -> Figure:
        b, c, r = self._breakdown, self._concurrency, self.result
        fig = Figure(figsize=(13, 4.2), layout="constrained")
        ax_m, ax_c = fig.subplots(1, 2, width_ratios=[2.3, 1])
        viz.plot_memory_bar({"contiguous": b.with_kv(c.contiguous_reserved_bytes, c.contiguous_used_bytes),
                             "paged": b.with_kv(c.paged_reserved_bytes, c.paged_used_bytes)}, ax=ax_m,
                            title="Memory with as many sequences as fit (hatched: reserved, no token)")
        notes = self.notes()
        if r["fits"] and r["paged_seqs"]:
            viz.plot_concurrency(c, ax=ax_c, title=f"Sequences of {r['seq_len']} tokens that fit")
            gain = f"{r['gain']:.1f}x" if math.isfinite(r["gain"]) else "only paging fits any"
            head = (f"{r['model']}: {mem.format_bytes(c.bytes_per_token)} of KV per token, "
                    f"{mem.format_bytes(b.kv_budget_bytes)} left for KV → contiguous fits {c.contiguous_seqs:,}, "
                    f"paged fits {c.paged_seqs:,} ({gain})")
        else:
            ax_c.axis("off")
            ax_c.text(0.5, 0.5, "no sequence fits", ha="center", va="center", fontsize=14, color="#c44e52",
                      transform=ax_c.transAxes)
            head = notes.pop(0)
        if notes:
            head += "\n" + "\n".join(notes)
        fig.suptitle(head, fontsize=12 if len(head) < 140 else 10)
        return fig


def memory_calculator(
    device_gib: int = 24,
    model: str = "Llama-2-7B",
    seq_len: int = 300,
    max_len: int = 2048,
    block_size: int = 16,
    kv_dtype: str = "float16",
    weights_dtype: str = "float16",
    overhead_fraction: float = 0.1,
    static: bool | None = None,
) -> MemoryCalculator:
    """How many sequences fit on a device, contiguous vs paged, and what each wastes.

    ``seq_len`` is what a sequence really holds; a contiguous cache reserves ``max_len`` for
    each. Pick "custom" as the model to set its size and shape with the custom sliders.
    ``app.result`` holds the numbers; ``static=True`` forces the picture-only fallback.
    """
    if model != "custom":
        model = mem.get_model(model).name
    values = dict(device_gib=device_gib, model=model, weights_dtype=weights_dtype,
                  overhead_fraction=overhead_fraction, seq_len=seq_len, max_len=max_len, block_size=block_size,
                  kv_dtype=kv_dtype, custom_params_b=1.0, custom_layers=16, custom_kv_heads=8, custom_head_dim=64)
    return MemoryCalculator(values, static)._build()


# -- page table explorer -----------------------------------------------------------------
class PageTableExplorer(App):
    """A step slider (and Play button) over a Trace; each step redraws the page table."""

    def __init__(self, trace: Trace, values: dict, static: bool | None = None) -> None:
        super().__init__(values, static)
        self.trace = trace

    def _controls(self, w) -> list:
        n = len(self.trace.steps)
        self.controls["step"] = w.IntSlider(value=self.values["step"], min=0, max=n - 1, step=1, description="step",
                                            continuous_update=False, style=_SLIDER_STYLE, layout=_layout(w, "600px"))
        self.controls["play"] = w.Play(value=self.values["step"], min=0, max=n - 1, step=1, interval=700,
                                       description="play")
        self.link = w.jslink((self.controls["play"], "value"), (self.controls["step"], "value"))
        return [w.HBox([self.controls["play"], self.controls["step"]])]

    def _control_names(self) -> list[str]:
        return ["step", "play"]

    def compute(self) -> dict[str, Any]:
        k = int(self.values["step"])
        if not 0 <= k < len(self.trace.steps):
            raise IndexError(f"step {k} is outside this trace's steps 0..{len(self.trace.steps) - 1}")
        r = self.trace.steps[k]
        return {"step": k, "time": r.time, "blocks_used": r.blocks_used, "blocks_free": r.blocks_free,
                "running": list(r.running), "waiting": list(r.waiting),
                "reserved_slots": r.reserved_slots, "used_slots": r.used_slots}

    def summary(self) -> str:
        r = self.result
        return (f"step {r['step']}: {r['blocks_used']} blocks used, {r['blocks_free']} free; "
                f"{len(r['running'])} running, {len(r['waiting'])} waiting; "
                f"{r['used_slots']} of {r['reserved_slots']} reserved slots hold a token")

    def draw(self) -> Figure:
        return viz.plot_page_table(self.trace, step=self.result["step"])


def page_table_explorer(trace: Trace, step: int | None = None, static: bool | None = None) -> PageTableExplorer:
    """Step through a paged run (from ``simulate`` or an engine's ``trace``) and watch the pool.

    Starts at ``step`` (default: the step with the fullest page table).
    """
    if not isinstance(trace, Trace) or trace.kind != "paged" or not trace.steps:
        raise ValueError("page_table_explorer needs a paged Trace with at least one step: "
                         "use minipaged.bench.simulate.simulate(...) or an engine's .trace")
    start = trace.peak_step if step is None else int(step)
    return PageTableExplorer(trace, {"step": start}, static)._build()


# -- batching timeline -------------------------------------------------------------------
class BatchingTimeline(App):
    """The static vs continuous Gantt with a time cursor; the numbers say who is busy at that time.

    The cursor moves in ``ticks`` equal steps from the moment the first slot starts computing
    (``t_lo``, a few microseconds after 0 in a real run) to the end of the longer run; the
    slider shows each tick's time, in the traces' unit (seconds, or steps for a simulation).
    """

    def __init__(self, traces: dict[str, Trace], values: dict, static: bool | None = None) -> None:
        super().__init__(values, static)
        self.traces = traces
        self.timelines = {k: t.timeline() for k, t in traces.items()}
        ivs = [iv for tl in self.timelines.values() for iv in tl]
        self.unit = next((t.meta.get("time_unit", "s") for t in traces.values()), "s")
        self.t_max = max((iv["end_time"] for iv in ivs), default=1.0)
        whole = all(float(iv["end_time"]).is_integer() and float(iv["start_time"]).is_integer() for iv in ivs)
        # Whole steps start at step 0; a timed run starts where its first slot starts computing,
        # so the first tick never reads "0 computing" while the picture shows the first batch.
        self.t_lo = 0.0 if whole else min((iv["start_time"] for iv in ivs), default=0.0)
        # The slider is an int underneath (so Play can drive it): one tick per step when times are
        # whole steps, else 200 ticks over the run.
        span = self.t_max - self.t_lo
        self.ticks = max(1, int(span)) if whole and span <= 5000 else 200
        self.values.setdefault("tick", self.ticks)

    def time_at(self, tick: int) -> float:
        """The time (in the traces' unit) the cursor stands at on ``tick``."""
        return self.t_lo + (self.t_max - self.t_lo) * int(tick) / self.ticks

    def tick_of(self, t: float) -> int:
        """The tick nearest to time ``t`` (clamped to the run)."""
        span = self.t_max - self.t_lo
        return max(0, min(self.ticks, int(round((float(t) - self.t_lo) / span * self.ticks)))) if span > 0 else 0

    def label_of(self, tick: int) -> str:
        t = self.time_at(tick)
        return f"{t:.4g} {self.unit}"

    def _controls(self, w) -> list:
        # A SelectionSlider reads out the time ("1.23 s"), not the tick index; Play drives its index.
        options = [(self.label_of(k), k) for k in range(self.ticks + 1)]
        self.controls["tick"] = w.SelectionSlider(options=options, value=self.values["tick"], description="time cursor",
                                                  continuous_update=False, style=_SLIDER_STYLE,
                                                  layout=_layout(w, "700px"))
        self.controls["play"] = w.Play(value=self.values["tick"], min=0, max=self.ticks,
                                       step=max(1, self.ticks // 50), interval=900, description="play")
        self.link = w.jslink((self.controls["play"], "value"), (self.controls["tick"], "index"))
        return [w.HBox([self.controls["play"], self.controls["tick"]], layout=w.Layout(flex_flow="row wrap"))]

    def _control_names(self) -> list[str]:
        return ["tick", "play"]

    def compute(self) -> dict[str, Any]:
        tick = int(self.values["tick"])
        if not 0 <= tick <= self.ticks:
            raise IndexError(f"tick {tick} is outside 0..{self.ticks}: use tick_of(seconds) to find one")
        t = self.time_at(tick)
        # Half a tick of tolerance on starts: the cursor cannot stand nearer than one tick to any
        # moment, so a slot that starts within half a tick of it already counts as computing.
        eps = 0.5 * (self.t_max - self.t_lo) / self.ticks
        res: dict[str, Any] = {"time": t, "tick": tick}
        for name, tl in self.timelines.items():
            computing = sum(1 for iv in tl if iv["start_time"] <= t + eps and t < iv["finish_time"])
            held_idle = sum(1 for iv in tl if iv["finish_time"] <= t < iv["end_time"])
            done = len({iv["request"] for iv in tl if iv["outcome"] != "preempted" and iv["finish_time"] <= t})
            res[name] = {"computing": computing, "held_idle": held_idle, "done": done,
                         "requests": len({iv["request"] for iv in tl})}
        return res

    def _parts(self) -> list[str]:
        return [f"{k}: {v['done']}/{v['requests']} done, {v['computing']} computing"
                + (f", {v['held_idle']} slot{'s' if v['held_idle'] != 1 else ''} held idle" if v["held_idle"] else "")
                for k, v in self.result.items() if k not in ("time", "tick")]

    def summary(self) -> str:
        return f"at {self.result['time']:.4g} {self.unit}: " + "; ".join(self._parts())

    def draw(self) -> Figure:
        r = self.result
        return viz.plot_timeline(self.traces, cursor=r["time"],
                                 title=f"At time {r['time']:.4g} {self.unit} (red line): " + "; ".join(self._parts()))


def batching_timeline(static_trace: Trace, continuous_trace: Trace, time: float | None = None,
                      static: bool | None = None) -> BatchingTimeline:
    """Static vs continuous batching on the same requests, one Gantt each, with a time cursor.

    The cursor starts where the continuous run has finished (default), the moment that shows
    how far behind static batching still is.
    """
    for name, t in (("static_trace", static_trace), ("continuous_trace", continuous_trace)):
        if not isinstance(t, Trace) or not t.steps:
            raise ValueError(f"{name} must be a Trace with steps (simulate_static(...) / simulate(...))")
    app = BatchingTimeline({"static": static_trace, "continuous": continuous_trace}, {}, static)
    t0 = continuous_trace.steps[-1].time if time is None else time
    app.values["tick"] = app.tick_of(t0)
    return app._build()
