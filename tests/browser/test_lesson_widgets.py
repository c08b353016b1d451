"""Lessons 01, 03 and 06 in JupyterLab in a real Chromium: run every cell, move each widget's
controls, and read the numbers the widgets display back against values worked out by hand.

What a learner sees is checked, not what Python thinks it drew: each app writes its numbers
as text under its controls (``.minipaged-summary``), and the test reads that text from the
page. Screenshots of each state are kept in tests/browser/artifacts/. Run time: about a
minute a lesson on 2 cores (the lessons load the real model).
"""
from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

RUN_TIMEOUT_MS = 240_000
UPDATE_MS = 60_000
GiB = 2**30


def open_and_run(page, lab, name: str, folder: Path):
    """Open a copy of lesson ``name`` in the lab, run all its cells, wait until every one has run."""
    url, root = lab
    src = ROOT / "notebooks" / f"{name}.ipynb"
    nb = json.loads(src.read_text(encoding="utf-8"))
    for c in nb["cells"]:  # a fresh copy: no stored outputs or counts to mistake for this run's
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    # the kernel this test's server has, so the lab asks nothing before running
    nb.setdefault("metadata", {})["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                                   "language": "python"}
    (root / src.name).write_text(json.dumps(nb), encoding="utf-8")
    n_code = sum(c["cell_type"] == "code" for c in nb["cells"])
    # Start the notebook's kernel through the REST API first: the lab then attaches to it instead
    # of asking, in a dialog, which kernel to start.
    req = urllib.request.Request(f"{url}/api/sessions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"path": src.name, "name": src.name, "type": "notebook",
                                                  "kernel": {"name": "python3"}}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status in (200, 201), r.status
    page.goto(f"{url}/lab/tree/{src.name}?reset")  # ?reset: a fresh workspace, only this notebook open
    # every cell rendered (the lab's settings turn windowing off), and the kernel idle, before Run All
    try:
        page.wait_for_function(f"() => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length === {n_code}",
                               timeout=UPDATE_MS)
    except Exception:
        _dump(page, folder, "open-timeout")
        raise
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle'], .jp-Toolbar-kernelStatus").first.wait_for(
        timeout=RUN_TIMEOUT_MS)
    dialog = page.locator(".jp-Dialog").get_by_role("button", name="Select")
    if dialog.count():
        dialog.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()
    # done when every code cell shows an execution count and none is queued or running ([*]),
    # or as soon as a cell fails (Run All stops there)
    try:
        page.wait_for_function(
            """() => {
                const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')];
                const failed = document.querySelector(".jp-Notebook [data-mime-type='application/vnd.jupyter.error']");
                return failed || (prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent)));
            }""",
            timeout=RUN_TIMEOUT_MS,
        )
    except Exception:
        _dump(page, folder, "run-timeout")
        raise
    errors = page.locator(".jp-Notebook [data-mime-type='application/vnd.jupyter.error']")
    if errors.count():
        _dump(page, folder, "cell-error")
        pytest.fail(f"{name}: a cell failed in the browser:\n{errors.first.inner_text()[:3000]}")


def stop_kernels(lab) -> None:
    """Shut every kernel of the lab down (each lesson loads the model: free its memory for the next)."""
    url, _ = lab
    with urllib.request.urlopen(f"{url}/api/sessions", timeout=30) as r:
        sessions = json.loads(r.read())
    for sess in sessions:
        req = urllib.request.Request(f"{url}/api/sessions/{sess['id']}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


@pytest.fixture
def page(browser_context, lab):
    p = browser_context.new_page()
    p.set_viewport_size({"width": 1400, "height": 1000})
    yield p
    p.close()
    stop_kernels(lab)


def _dump(page, folder: Path, what: str) -> None:
    page.screenshot(path=str(folder / f"{what}.png"), full_page=True)
    (folder / f"{what}.html").write_text(page.content(), encoding="utf-8")


def app_box(page, cls: str, folder: Path):
    box = page.locator(f".{cls}")
    try:
        box.first.wait_for(timeout=UPDATE_MS)
    except Exception:
        _dump(page, folder, "no-widget")
        raise
    assert box.count() == 1, f"expected one {cls} widget on the page, found {box.count()}"
    box.scroll_into_view_if_needed()
    return box


def summary(box) -> str:
    return box.locator(".minipaged-summary").inner_text()


def wait_summary(box, pattern):
    from playwright.sync_api import expect

    expect(box.locator(".minipaged-summary")).to_contain_text(pattern, timeout=UPDATE_MS)
    return summary(box)


def control(box, label: str):
    """The widget row whose description is ``label``."""
    return box.locator(".widget-inline-hbox", has=box.page.locator(".widget-label", has_text=label)).first


def type_into_slider(box, label: str, value) -> None:
    """Set a slider the way a learner can without dragging: edit its readout, press Enter."""
    readout = control(box, label).locator(".widget-readout")
    readout.click()
    readout.press("Control+a")
    readout.type(str(value))
    readout.press("Enter")


def shot(page, box, folder: Path, name: str) -> None:
    # the kernel idle: the picture for the text under the controls has been drawn
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=UPDATE_MS)
    box.scroll_into_view_if_needed()
    page.screenshot(path=str(folder / f"{name}.png"), full_page=False)


# -- lesson 01: the memory calculator ------------------------------------------------------
def kv_budget(device_gib: int, params: int, overhead: float = 0.1) -> int:
    return device_gib * GiB - params * 2 - int(device_gib * GiB * overhead)


LLAMA2 = 6_738_415_616
LLAMA3 = 8_030_261_248


def test_lesson_01_memory_calculator(page, lab, shots):
    open_and_run(page, lab, "01_kv_cache", shots)
    box = app_box(page, "minipaged-memorycalculator", shots)

    # starting values: 24 GiB, Llama-2-7B fp16 (512 KiB of KV per token), 300 of 2048 tokens
    per_tok = 2 * 32 * 32 * 128 * 2
    b = kv_budget(24, LLAMA2)
    contiguous, paged = b // (2048 * per_tok), (b // (16 * per_tok)) // math.ceil(300 / 16)
    assert (contiguous, paged) == (9, 60)
    wait_summary(box, f"contiguous fits {contiguous}, paged fits {paged} ({paged / contiguous:.1f}x)")
    shot(page, box, shots, "01-start")

    type_into_slider(box, "actual length", 1000)
    wait_summary(box, f"paged fits {(b // (16 * per_tok)) // math.ceil(1000 / 16)} ")  # 1158 // 63 = 18
    shot(page, box, shots, "02-seq-1000")

    control(box, "model").locator("select").select_option(label="Llama-3-8B")  # GQA: 8 KV heads
    per_tok3, b3 = 2 * 32 * 8 * 128 * 2, kv_budget(24, LLAMA3)
    text = wait_summary(box, f"contiguous fits {b3 // (2048 * per_tok3)}, paged fits {(b3 // (16 * per_tok3)) // 63} ")
    assert "128 KiB per token" in text, text
    shot(page, box, shots, "03-llama3")

    type_into_slider(box, "actual length", 5000)  # above max_len = 2048: clamped, and it says so
    wait_summary(box, "clamped to 2,048")
    assert "actual length 5,000 > max_len 2,048" in summary(box)
    shot(page, box, shots, "04-clamped")

    type_into_slider(box, "device memory", 12)  # 16 GB of weights on 12 GiB: does not fit
    text = wait_summary(box, "does not fit this device")
    assert "1.0x" not in text and "waste" not in text, text
    shot(page, box, shots, "05-does-not-fit")

    # Narrow screen: the two columns wrap instead of overflowing
    cols = box.locator(".widget-hbox").first.locator(":scope > .widget-vbox")
    assert cols.count() == 2
    y0, y1 = (cols.nth(i).bounding_box()["y"] for i in range(2))
    assert abs(y0 - y1) < 2, "side by side at 1400 px"
    page.set_viewport_size({"width": 800, "height": 1000})
    page.wait_for_timeout(500)
    a, c = cols.nth(0).bounding_box(), cols.nth(1).bounding_box()
    assert c["y"] >= a["y"] + a["height"] - 1, f"the columns did not wrap at 800 px: {a} {c}"
    overflow = box.evaluate("el => el.scrollWidth - el.clientWidth")
    assert overflow <= 1, f"the calculator overflows its box by {overflow} px at 800 px"
    shot(page, box, shots, "06-narrow")


# -- lesson 03: the page-table explorer ----------------------------------------------------
def test_lesson_03_page_table_explorer(page, lab, shots):
    open_and_run(page, lab, "03_page_table", shots)
    box = app_box(page, "minipaged-pagetableexplorer", shots)
    text = summary(box)
    m = re.match(r"step (\d+): (\d+) blocks used, (\d+) free", text)
    assert m, text
    start, used, free = map(int, m.groups())
    assert used + free == 20, f"the pool has 20 blocks: {text}"  # LLM(num_blocks=20, ...)
    shot(page, box, shots, "01-start")

    type_into_slider(box, "step", 0)  # the first step: 4 sequences admitted (max_num_seqs=4), 8 waiting
    text = wait_summary(box, "step 0:")
    assert "4 running, 8 waiting" in text, text
    shot(page, box, shots, "02-step-0")

    type_into_slider(box, "step", 10_000)  # past the end: the slider stops at the last step
    text = wait_summary(box, "0 running, 0 waiting")
    assert "0 blocks used, 20 free" in text and "0 of 0 reserved slots" in text, text  # every block returned
    shot(page, box, shots, "03-last-step")

    type_into_slider(box, "step", 0)
    wait_summary(box, "step 0:")
    box.locator(".widget-play button, .jupyter-widgets.widget-play button").first.click()  # ▶
    # Play advances the step (700 ms a step; the text may skip steps while the kernel draws)
    wait_summary(box, re.compile(r"step [1-9]\d*:"))
    shot(page, box, shots, "04-playing")


# -- lesson 06: the batching timeline ------------------------------------------------------
def test_lesson_06_batching_timeline(page, lab, shots):
    open_and_run(page, lab, "06_continuous_batching", shots)
    box = app_box(page, "minipaged-batchingtimeline", shots)
    # starts just after continuous batching finished: all 8 of its requests done, static not yet
    text = summary(box)
    assert "continuous: 8/8 done" in text and "static: 8/8 done" not in text, text
    readout = control(box, "time cursor").locator(".widget-readout")
    assert re.fullmatch(r"\d+(\.\d+)?(e-?\d+)? s", readout.inner_text().strip()), (
        f"the slider must read out seconds, not a tick index: {readout.inner_text()!r}")
    shot(page, box, shots, "01-start")

    handle = control(box, "time cursor").locator(".noUi-handle").first
    handle.focus()
    handle.press("Home")  # the first tick: the first batch of 4 is computing (batch_size=4)
    text = wait_summary(box, "static: 0/8 done, 4 computing")
    assert re.search(r"continuous: 0/8 done, [1-8] computing", text), text
    assert readout.inner_text().strip().endswith(" s")
    shot(page, box, shots, "02-first-tick")

    handle.press("End")
    text = wait_summary(box, "static: 8/8 done, 0 computing")
    assert "continuous: 8/8 done, 0 computing" in text, text
    shot(page, box, shots, "03-last-tick")
