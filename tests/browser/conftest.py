"""A JupyterLab server and a headless Chromium for the browser tests.

The server runs on 127.0.0.1 at a free port, token-less, from a temporary folder that holds
copies of the lessons (the lab autosaves; the repository's notebooks are never opened), with
its own config, runtime and settings folders, and is stopped at the end. Chromium is Debian's
(/usr/bin/chromium, or ``MINIPAGED_CHROMIUM``) driven by Playwright for Python, headless, with
a fresh profile; Playwright's own browser download is never used. Without a Chromium, or
without Playwright or JupyterLab, every browser test is skipped and says why.
Screenshots go to tests/browser/artifacts/ (ignored by git).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for cand in (os.environ.get("MINIPAGED_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def _why_skip() -> str | None:
    if chromium_path() is None:
        return "no Chromium found (install Debian's `chromium`, or set MINIPAGED_CHROMIUM): browser tests skipped"
    for mod, pkg in (("playwright.sync_api", "playwright"), ("jupyterlab", "jupyterlab"), ("ipywidgets", "ipywidgets")):
        try:
            __import__(mod)
        except ImportError:
            return f"{pkg} is not installed (pip install -e '.[course,browser]'): browser tests skipped"
    return None


def pytest_collection_modifyitems(config, items):
    why = _why_skip()
    if why:
        for item in items:
            if "tests/browser" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(pytest.mark.skip(reason=why))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Settings a fresh lab reads from JUPYTERLAB_SETTINGS_DIR: render every cell (no windowing, so
# the test sees all outputs) and fetch no news (the machine may have no network).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


@pytest.fixture(scope="package")
def lab(tmp_path_factory):
    """(base URL, folder the lab serves) for a JupyterLab started for this session."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    root.mkdir()
    for name, content in LAB_SETTINGS.items():
        f = base / "settings" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(content))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MINIPAGED_STATIC", "JUPYTER_TOKEN")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_RUNTIME_DIR=str(base / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(base / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
           "--ServerApp.open_browser=False", "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    log = open(base / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                pytest.fail(f"JupyterLab did not start on {url}:\n{(base / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="package")
def browser_context(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield ctx
        finally:
            ctx.close()
    # Playwright's sync API drives an asyncio loop from this thread; once it is stopped, make sure
    # no loop is left marked as running here, or later tests' asyncio.run() would refuse to start.
    import asyncio

    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)


@pytest.fixture
def shots(request):
    """shots("name") saves a screenshot of the page under tests/browser/artifacts/<test>/."""
    folder = ARTIFACTS / request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
