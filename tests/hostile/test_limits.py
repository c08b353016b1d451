"""The bwrap run's stated limits that need no class folder: learner code is never root inside, and the memory
cap covers the run's whole process tree (RLIMIT_AS alone is per process). Each runs a tiny harness job."""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minipaged.checks import sandbox  # noqa: E402
from minipaged.checks.canonical import Cell  # noqa: E402

HAVE_BWRAP = sandbox.bwrap_path() is not None


def _job(workdir: str, code: str, use_bwrap: bool) -> bytes:
    cells = [{"kind": "code", "source": code, "label": "cell 1", "check": ""},
             {"kind": "check", "source": "# CHECK: x\npass", "label": "check 'x'", "check": "x"}]
    return json.dumps({"result_fd": -1, "key": secrets.token_bytes(32).hex(), "workdir": workdir, "guard": not use_bwrap,
                       "preload": [], "copy_from": sandbox.SUBMITTED_DIR if use_bwrap else "", "cells": cells}).encode()


def _run(tmp_path: Path, code: str, use_bwrap: bool, **limits) -> sandbox.Outcome:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    inner = sandbox.SANDBOX_DIR if use_bwrap else str(work)
    return sandbox.run(_job(inner, code, use_bwrap), work, use_bwrap=use_bwrap,
                       limits=sandbox.Limits(wall_s=120, **limits))


@pytest.mark.skipif(not HAVE_BWRAP, reason="bwrap is not installed or cannot create namespaces here")
@pytest.mark.skipif(os.geteuid() != 0, reason="the grader is not root here: nothing to drop")
def test_learner_code_is_not_root_inside_bwrap(tmp_path: Path) -> None:
    if not sandbox.drops_root(True):
        pytest.skip("setpriv is missing, or the unprivileged user cannot reach the interpreter or the package here "
                    "(e.g. a Python under a 0700 /root): the grader then warns that learner code runs as root")
    code = ("import os\nprint('UID', os.getuid(), os.geteuid(), flush=True)\n"
            "try:\n    open('/etc/shadow').read()\n    print('SHADOW READ', flush=True)\n"
            "except OSError as e:\n    print('SHADOW REFUSED', e.errno, flush=True)\n"
            "open('mine.txt', 'w').write('the learner copy is writable')\nprint('WROTE', flush=True)\n")
    out = _run(tmp_path, code, True)
    assert f"UID {sandbox.LEARNER_UID} {sandbox.LEARNER_UID}" in out.output, out.output
    assert "SHADOW REFUSED" in out.output and "SHADOW READ" not in out.output, out.output
    assert "WROTE" in out.output, out.output


@pytest.mark.skipif(not HAVE_BWRAP, reason="bwrap is not installed or cannot create namespaces here")
def test_memory_cap_covers_the_whole_process_tree(tmp_path: Path) -> None:
    use_bwrap = True  # without bwrap the guard refuses fork() itself
    # four children of 200 MiB each: each is under RLIMIT_AS (1 GiB), together over the tree's 400 MiB
    code = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = bytearray(200 * 2**20)\n        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
            "        time.sleep(60)\n        os._exit(0)\n    kids.append(pid)\n"
            "for k in kids:\n    os.waitpid(k, 0)\nprint('SURVIVED', flush=True)\n")
    out = _run(tmp_path, code, use_bwrap, memory_bytes=2**30, tree_memory_bytes=400 * 2**20)
    assert out.extra.get("over_memory") is True, out.output
    assert "SURVIVED" not in out.output
    assert out.wall_s < 100  # ended by the cap, not by the wall-clock limit (120 s)


def test_session_rss_counts_children() -> None:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 * 2**20); b[::4096] = b'1' * len(b[::4096]); "
                          "time.sleep(30)"], start_new_session=True)
    try:
        import time

        for _ in range(100):
            if sandbox.session_rss(p.pid) > 60 * 2**20:
                break
            time.sleep(0.1)
        assert sandbox.session_rss(p.pid) > 60 * 2**20
    finally:
        p.kill()
        p.wait()
