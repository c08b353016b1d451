"""Start ``minipaged serve`` (or ``minipaged proxy``) in a child process and wait until it answers (lessons, tests, benches).

Owns one child process: a free port on 127.0.0.1, the command line, waiting for ``/health``,
and stopping it by its pid (SIGTERM, then SIGKILL after a grace period). It never imports the
server or the engine itself, so the notebook or test that calls it stays light. Several children
can start side by side: ``spawn()`` each, then ``wait_ready()`` each (``start()`` does both).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _prctl() -> Any:
    """libc's ``prctl`` on Linux (loaded here, in the parent, not in the forked child), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class ServerProcess:
    """``with ServerProcess(model=..., max_num_seqs=8) as srv: srv.url`` -> "http://127.0.0.1:PORT/v1".

    Keyword arguments become flags (``max_num_seqs=8`` -> ``--max-num-seqs 8``; True -> the bare
    flag, False -> ``--no-...``). The child's output goes to ``log_path``; ``tail()`` shows it.
    ``command="proxy"`` runs ``minipaged proxy`` instead (``prefill=URL, decode=URL``, no model).
    ``own_group=True`` starts the child in a process group of its own: a Ctrl-C at the terminal then
    reaches only the parent (which stops the child itself), and ``stop()`` also ends anything the
    child started (``survivors()`` says whether any is left); on Linux the child is also sent
    SIGTERM if the parent dies without stopping it (killed with SIGKILL, say).
    """

    def __init__(self, model: str | os.PathLike | None = None, host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None, startup_timeout_s: float = 180.0, command: str = "serve", own_group: bool = False,
                 **flags: Any) -> None:
        if command not in ("serve", "proxy"):
            raise ValueError(f"command must be 'serve' or 'proxy', got {command!r}")
        self.host, self.port = host, port or free_port(host)
        self.cmd = [sys.executable, "-m", "minipaged", command, "--host", host, "--port", str(self.port)]
        if model is not None:
            self.cmd += ["--model", str(model)]
        for k, v in flags.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                self.cmd.append(flag)
            elif v is False:
                self.cmd.append("--no-" + k.replace("_", "-"))
            elif isinstance(v, (list, tuple)):
                self.cmd += [flag, *map(str, v)]
            elif v is not None:
                self.cmd += [flag, str(v)]
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.startup_timeout_s = startup_timeout_s
        self.own_group = own_group
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="minipaged-serve-", suffix=".log")[1])

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not started"
        return self.proc.pid

    def start(self) -> "ServerProcess":
        """``spawn()``, then ``wait_ready()``."""
        return self.spawn().wait_ready()

    def spawn(self) -> "ServerProcess":
        """Start the child and return at once (``wait_ready()`` waits for its ``/health``)."""
        log = open(self.log_path, "wb")
        prctl = _prctl() if self.own_group else None
        # PR_SET_PDEATHSIG (1): the kernel sends the child SIGTERM when this thread's process dies
        before = (lambda: prctl(1, signal.SIGTERM)) if prctl is not None else None
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=self.own_group, preexec_fn=before)
        log.close()
        return self

    def wait_ready(self) -> "ServerProcess":
        """Wait until ``/health`` answers 200; stop the child and raise if it exits or does not answer in time."""
        assert self.proc is not None, "spawn() the server first"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`minipaged {self.cmd[3]}` exited with code {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"`minipaged {self.cmd[3]}` did not answer /health within {self.startup_timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM by pid, wait up to ``grace_s``, then SIGKILL. Returns the exit code. With
        ``own_group``, whatever is left of the child's process group is then killed too."""
        try:
            return self._stop(grace_s)
        finally:
            if self.own_group and self.proc is not None and self.survivors():
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def survivors(self) -> bool:
        """True while the child, or (with ``own_group``) anything in its process group, is alive."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return True
        if not self.own_group:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _stop(self, grace_s: float) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(grace_s)
        except ProcessLookupError:  # it exited between the poll and the signal
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def metrics(self) -> dict[str, float]:
        """``GET /metrics``, parsed: {"vllm:num_requests_running": 0.0, ...} (labels summed)."""
        from .metrics import parse_metrics

        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def rss_mib(self) -> float:
        """The server process's resident memory (Linux), in MiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise OSError("no VmRSS line: resident memory is read from /proc on Linux only")

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
