"""The bench's own pictures: the factorial with its attribution, the online sweep, the roofline.

Owns only drawing from a ``run_bench`` result (a dict); it measures nothing. The pictures of
traces (timelines, KV usage, page tables) are ``minipaged.viz``'s.
"""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt

LABELS = {
    "static_contiguous": "static\ncontiguous", "static_paged": "static\npaged",
    "continuous_contiguous": "continuous\ncontiguous", "continuous_paged": "continuous\npaged",
    "naive": "naive", "hf": "transformers\ngenerate",
}
COLORS = {"static_contiguous": "#9e9e9e", "static_paged": "#64b5f6", "continuous_contiguous": "#ffb74d",
          "continuous_paged": "#43a047", "naive": "#e57373", "hf": "#ba68c8"}


def plot_factorial(result: dict) -> Any:
    """Bars of output tokens/s for every system; arrows name the ratio each idea buys."""
    S = result["systems"]
    names = [n for n in ("naive", "static_contiguous", "static_paged", "continuous_contiguous", "continuous_paged", "hf") if n in S]
    vals = [S[n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    ax.bar(range(len(names)), vals, color=[COLORS[n] for n in names], width=0.65)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([LABELS[n] for n in names], fontsize=9)
    ax.set_ylabel("output tokens per second")
    ax.set_ylim(0, max(vals) * 1.35)
    att = result.get("attribution", {})
    text = "\n".join(f"{k.replace('_', ' ')}: {a['ratio']:.2f}x" for k, a in att.items())
    ax.text(0.01, 0.98, text, transform=ax.transAxes, va="top", fontsize=9, family="monospace",
            bbox=dict(boxstyle="round", fc="white", ec="#cccccc"))
    kb = result["kv_budget"]
    ax.set_title(f"Same requests, same KV budget ({kb['blocks']} blocks = {kb['mib']:.0f} MiB): what paging and refilling each buy",
                 fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig


def plot_online(result: dict) -> Any:
    """Throughput, TTFT p50 and goodput against the request rate, one line per system."""
    on = result["online"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, rows in on["systems"].items():
        x = [r["rate_per_s"] for r in rows]
        kw = dict(marker="o", color=COLORS.get(name), label=LABELS.get(name, name).replace("\n", " "))
        axes[0].plot(x, [r["output_tokens_per_s"] for r in rows], **kw)
        axes[1].plot(x, [r["ttft_p50_s"] for r in rows], **kw)
        axes[2].plot(x, [r["goodput_req_per_s"] for r in rows], **kw)
    axes[1].axhline(on["slo"]["ttft_s"], color="#999999", ls="--", lw=1, label="SLO")
    for ax, t in zip(axes, ("output tokens/s", "TTFT p50 (s)", "goodput (requests/s within SLO)")):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(t, fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Online: {on['num_requests']} requests with Poisson arrivals", fontsize=11)
    fig.tight_layout()
    return fig


def plot_roofline(rf: dict) -> Any:
    """Measured time per decode step's matmuls vs batch, beside the roofline's prediction."""
    rows = rf["by_batch"]
    b = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(b, [r["seconds"] * 1e3 for r in rows], "o-", color="#1e88e5", label="measured (linear layers)")
    ax.plot(b, [r["roofline_seconds"] * 1e3 for r in rows], "--", color="#555555", label="roofline: max(weights/BW, flops/GEMM)")
    ax.axvline(rf["predicted_compute_bound_batch"], color="#e53935", lw=1, ls=":", label="predicted compute-bound batch")
    if rf.get("measured_compute_bound_batch"):
        ax.axvline(rf["measured_compute_bound_batch"], color="#43a047", lw=1, ls="-.", label="measured knee")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences in the decode step (batch)")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    ax.set_title(f"Decode roofline: ridge {rf['ridge_flops_per_byte']:.1f} flops/byte", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
