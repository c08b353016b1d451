"""The bwrap run's stated limits that need no class folder: learner code is never root inside (no capability, no
read of root's files, no write outside its copy, even with the interpreter under a 0700 /root), and the memory cap
covers the run's whole process tree (RLIMIT_AS alone is per process). Each runs a tiny harness job."""
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
    # a root grader whose interpreter lies under a 0700 /root (pyenv, a venv in root's home) must still drop root:
    # the sandbox covers such a folder with an empty tmpfs and binds the interpreter back at its own path
    assert sandbox.drops_root(True), sandbox.why_root()
    import tempfile

    # outside /tmp (a tmpfs of its own inside): a file of root's, 0600, and a folder every user may write to
    host = Path(tempfile.mkdtemp(prefix="minipaged-hostile-", dir="/var/tmp" if os.path.isdir("/var/tmp") else str(ROOT)))
    try:
        _not_root(tmp_path, host)
    finally:
        import shutil

        shutil.rmtree(host, ignore_errors=True)


def _not_root(tmp_path: Path, host: Path) -> None:
    secret = host / "root_only.txt"
    secret.write_text("root's own")
    secret.chmod(0o600)
    host.chmod(0o777)
    code = ("import os\nprint('UID', os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), flush=True)\n"
            "st = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')}\n"
            "print('CAPS', int(st['CapEff'], 16), int(st['CapPrm'], 16), int(st['CapBnd'], 16), flush=True)\n"
            "for path in ('/etc/shadow', %r):\n"
            "    try:\n        open(path).read()\n        print('READ', path, flush=True)\n"
            "    except OSError as e:\n        print('REFUSED', e.errno, flush=True)\n"
            "for path in (%r, %r, '/etc/minipaged-was-here', '/tmp/.submitted/x'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('WROTE OUTSIDE', path, flush=True)\n"
            "    except OSError as e:\n        print('WRITE REFUSED', e.errno, flush=True)\n"
            "try:\n    os.setuid(0)\n    print('BECAME ROOT', flush=True)\nexcept OSError:\n    print('STAYED', flush=True)\n"
            "print('ROOT HOLDS', sorted(os.listdir('/root')), flush=True)\n"
            "open('mine.txt', 'w').write('the learner copy is writable')\nprint('WROTE', flush=True)\n"
            % (str(secret), str(host / "planted.txt"), str(ROOT / "planted.txt")))
    out = _run(tmp_path, code, True)
    L = sandbox.LEARNER_UID
    assert f"UID {L} {L} {sandbox.LEARNER_GID} []" in out.output, out.output
    assert "CAPS 0 0 0" in out.output, out.output
    assert out.output.count("REFUSED 13") == 2 and "READ " not in out.output, out.output  # EACCES for both
    assert out.output.count("WRITE REFUSED") == 4 and "WROTE OUTSIDE" not in out.output, out.output
    assert not (host / "planted.txt").exists() and not (ROOT / "planted.txt").exists()
    assert "STAYED" in out.output and "BECAME ROOT" not in out.output, out.output
    # a covered /root shows only the way to what the run needs (the interpreter), nothing else of root's home
    import ast

    holds = ast.literal_eval(out.output.split("ROOT HOLDS", 1)[1].splitlines()[0].strip())
    assert set(holds) <= {p.split("/")[2] for p in sandbox._needed_paths() if p.startswith("/root/")}, holds
    assert "WROTE" in out.output, out.output


def test_without_bwrap_the_run_still_works(tmp_path: Path) -> None:
    out = _run(tmp_path, "open('mine.txt', 'w').write('x')\nprint('WROTE', flush=True)\n", False)
    assert "WROTE" in out.output and (tmp_path / "work" / "mine.txt").read_text() == "x", out.output


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
