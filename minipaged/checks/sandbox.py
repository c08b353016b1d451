"""Where a submission runs: its own process tree on a private copy, under bubblewrap when the
machine has it, under resource limits always, killed at its wall-clock limit.

Owns the command line of one run (bwrap's options, the limits, the environment) and collecting
what comes back (the result channel, a capped log). Never decides a grade: grading.py reads the
channel; the harness (harness.py) runs inside.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_DIR = "/tmp/submission"  # the private copy's path inside bwrap (a private /tmp, in memory)
SUBMITTED_DIR = "/tmp/.submitted"  # the files handed in, read-only; the harness copies them to SANDBOX_DIR
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)
_HARNESS = str(Path(__file__).resolve().with_name("harness.py"))


@dataclass(frozen=True)
class Limits:
    """What one workbook's run may use; every field is enforced, with or without bwrap."""

    wall_s: float = 900.0  # the whole workbook, model load included; then SIGTERM, grace, SIGKILL
    grace_s: float = 5.0
    memory_bytes: int = 4 * 2**30  # RLIMIT_AS
    cpu_s: int = 0  # RLIMIT_CPU; 0: twice wall_s
    file_bytes: int = 64 * 2**20  # RLIMIT_FSIZE: any one file the run writes
    procs: int = 256  # RLIMIT_NPROC, on top of what the user runs already (not enforced for root)
    disk_bytes: int = 512 * 2**20  # with bwrap: all the run writes (its /tmp, its copy, /dev/shm) is in tmpfs this size
    tree_memory_bytes: int = 0  # resident memory of the run's whole process tree (every fork); 0: memory_bytes
    output_bytes: int = 256 * 2**10  # of stdout and stderr kept; the rest is read and dropped
    result_bytes: int = 4 * 2**20  # of the result channel kept

    def __post_init__(self) -> None:
        for name in ("wall_s", "memory_bytes", "file_bytes", "procs", "disk_bytes", "output_bytes", "result_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class Outcome:
    lines: list[bytes]  # the result channel, one line each, unverified
    output: str  # stdout and stderr, capped
    returncode: int | None
    timed_out: bool
    wall_s: float
    bwrap: bool
    extra: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str | None:
    """The bwrap binary if it is installed and can make a sandbox here (user namespaces allowed)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None
    try:
        ok = subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-all", "--cap-drop", "ALL", "--", "true"],
                            capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return exe if ok else None


def _user_tasks() -> int:
    """Processes and threads this user runs now (RLIMIT_NPROC counts them all)."""
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                pass
    return n


_LAUNCHER = (
    "import os, resource, signal, sys\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"  # the grader blocks SIGINT/SIGTERM to read them with their sender
    "for name, value in zip(('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_NPROC', 'RLIMIT_CORE'), sys.argv[1:6]):\n"
    "    v = int(value)\n"
    "    hard = resource.getrlimit(getattr(resource, name))[1]\n"
    "    v = v if hard == resource.RLIM_INFINITY else min(v, hard)\n"
    "    resource.setrlimit(getattr(resource, name), (v, v))\n"
    "os.execv(sys.argv[6], sys.argv[6:])\n"
)


def _needed_paths() -> list[str]:
    """What the harness must read: the package, the interpreter and its libraries."""
    paths = {_PACKAGE_PARENT, sys.prefix, sys.base_prefix, sys.exec_prefix}
    cwd = os.path.realpath(os.getcwd())  # on sys.path under `python -m`: the grades may be there, keep it out
    paths |= {p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) != cwd}
    return sorted(paths)


LEARNER_UID = LEARNER_GID = 65534  # "nobody": who learner code runs as inside bwrap when the grader is root


@functools.lru_cache(maxsize=1)
def _setpriv() -> str | None:
    """setpriv (util-linux), to start bwrap as LEARNER_UID when the grader runs as root, if it works here."""
    import shutil

    exe = shutil.which("setpriv")
    if exe is None or bwrap_path() is None:
        return None
    try:
        # the unprivileged user must reach the interpreter and the package (a venv under a 0700 /root cannot be)
        r = subprocess.run([exe, "--reuid", str(LEARNER_UID), "--regid", str(LEARNER_GID), "--clear-groups",
                            bwrap_path(), "--ro-bind", "/", "/", "--unshare-all", "--", sys.executable, "-I", "-c",
                            f"import os; os.listdir({_PACKAGE_PARENT!r}); open({_HARNESS!r}).read()"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return exe if r.returncode == 0 else None


def drops_root(use_bwrap: bool) -> bool:
    """True when this run's learner code runs as LEARNER_UID, not as the grader's root."""
    return use_bwrap and hasattr(os, "geteuid") and os.geteuid() == 0 and _setpriv() is not None


def command(workdir: Path, *, use_bwrap: bool, hide: list[str], env: dict, limits: Limits, procs: int) -> list[str]:
    cpu = limits.cpu_s or int(2 * limits.wall_s) + 1
    # the harness as a script: compiled from its source, never from a __pycache__ a learner could have written
    python = [sys.executable, "-s", "-B", _HARNESS]
    inner = python
    if use_bwrap:
        exe = bwrap_path()
        assert exe is not None
        # all the run writes is in two tmpfs, /tmp and /dev/shm, that share disk_bytes (3/4 and 1/4)
        shm = max(limits.disk_bytes // 4, 2**20)
        b = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--size", str(shm), "--tmpfs", "/dev/shm", "--proc", "/proc",
             "--size", str(max(limits.disk_bytes - shm, 2**20)), "--tmpfs", "/tmp"]
        for h in hide:  # the class folder and the grader's output: not even readable
            if os.path.isdir(h) and not h.startswith("/tmp/"):
                b += ["--tmpfs", h]
        for p in _needed_paths():  # under /tmp or a hidden folder, the package must still be there, read-only
            if p.startswith("/tmp/") or any((p + "/").startswith(h.rstrip("/") + "/") for h in hide):
                b += ["--ro-bind", p, p]
        for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU, for workbook 05 on a GPU machine
            b += ["--dev-bind", str(dev), str(dev)]
        # the host's copy is read-only inside: what the run writes stays in its tmpfs, never on the host's disk
        b += ["--ro-bind", str(workdir), SUBMITTED_DIR, "--dir", SANDBOX_DIR, "--chdir", SANDBOX_DIR,
              "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
        for k, v in env.items():
            b += ["--setenv", k, v]
        inner = b + ["--"] + python
        if drops_root(use_bwrap):
            # never root inside: bwrap itself starts as an unprivileged user (root's files, /etc/shadow included,
            # are then out of reach), in a user namespace of its own
            inner = [_setpriv(), "--reuid", str(LEARNER_UID), "--regid", str(LEARNER_GID), "--clear-groups"] + inner
    return [sys.executable, "-I", "-c", _LAUNCHER, str(limits.memory_bytes), str(cpu), str(limits.file_bytes),
            str(procs), "0", *inner]


def environment(workdir: str, *, use_bwrap: bool) -> dict:
    home = "/tmp" if use_bwrap else workdir
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home, "TMPDIR": home, "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "PYTHONPATH": _PACKAGE_PARENT, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "MINIPAGED_WORKBOOKS": workdir, "HF_HUB_OFFLINE": "1",
    }
    for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "MINIPAGED_CHECK_NO_ALARM"):
        if k in os.environ:
            env[k] = os.environ[k]
    return env


# every run's process (its session leader), running or ever started: whose signals the grader ignores
_RUNS_NOW: set = set()
_RUNS_EVER: set = set()


def sent_by_a_run(pid: int) -> bool:
    """True when ``pid`` is (or was) a learner's run or is in the session of one running now."""
    if pid in _RUNS_EVER:
        return True
    try:
        return os.getsid(pid) in _RUNS_NOW
    except OSError:
        return False


def _drain(fd: int, cap: int, out: list[bytes]) -> None:
    kept = 0
    with os.fdopen(fd, "rb", buffering=0) as f:
        while True:
            chunk = f.read(65536)
            if not chunk:
                return
            if kept < cap:
                out.append(chunk[: cap - kept])
                kept += len(out[-1])


def run(job: bytes, workdir: Path, *, use_bwrap: bool, limits: Limits, hide: list[str] = (),
        procs_base: int | None = None, stop: threading.Event | None = None) -> Outcome:
    """Run the harness on ``workdir`` with ``job`` on its stdin; wait for it within the limits.

    ``job`` must hold ``"result_fd": RESULT_FD_PLACEHOLDER``; it is set to the channel's descriptor here.
    ``stop``, when set (Ctrl-C in the grader), ends the run like a time-out."""
    rfd, wfd = os.pipe()
    os.set_inheritable(wfd, True)
    job = job.replace(b'"result_fd": -1', b'"result_fd": %d' % wfd)
    base = procs_base if procs_base is not None else _user_tasks()
    inner_dir = SANDBOX_DIR if use_bwrap else str(workdir)
    env = environment(inner_dir, use_bwrap=use_bwrap)
    staged = None
    if drops_root(use_bwrap):
        # the learner's copy, where the unprivileged user bwrap runs as can read it (workdir's parents may be 0700)
        import shutil
        import tempfile

        staged = Path(tempfile.mkdtemp(prefix="minipaged-learner-"))
        for f in Path(workdir).iterdir():
            if f.is_file() and not f.is_symlink():
                shutil.copyfile(f, staged / f.name)
                os.chown(staged / f.name, LEARNER_UID, LEARNER_GID)
        os.chown(staged, LEARNER_UID, LEARNER_GID)
        os.chmod(staged, 0o700)
    cmd = command(staged or workdir, use_bwrap=use_bwrap, hide=list(hide), env=env, limits=limits,
                  procs=base + limits.procs)
    tree_cap = limits.tree_memory_bytes or limits.memory_bytes
    over_memory = False
    t0 = time.monotonic()
    log_r, log_w = os.pipe()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log_w, stderr=log_w, pass_fds=(wfd,),
                                cwd=str(workdir), env=env, start_new_session=True, close_fds=True)
    finally:
        os.close(wfd)
        os.close(log_w)
    _RUNS_NOW.add(proc.pid)
    _RUNS_EVER.add(proc.pid)
    lines_raw: list[bytes] = []
    output: list[bytes] = []
    readers = [threading.Thread(target=_drain, args=(rfd, limits.result_bytes, lines_raw), daemon=True),
               threading.Thread(target=_drain, args=(log_r, limits.output_bytes, output), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    timed_out = False
    deadline = t0 + limits.wall_s
    while True:
        try:
            proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                timed_out = True
                _kill_group(proc, limits.grace_s)
                break
            if session_rss(proc.pid) > tree_cap:  # RLIMIT_AS is per process: forks could each take all of it
                over_memory = True
                _end_group(proc.pid)
                proc.wait()
                break
    _end_group(proc.pid)  # what the run left behind in its session (a forked child) ends with it
    for t in readers:
        t.join(timeout=limits.grace_s + 5)
    if proc.poll() is None:  # a reader still blocked: something in the group kept a pipe open
        _kill_group(proc, 0)
    _RUNS_NOW.discard(proc.pid)
    if staged is not None:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
    wall = time.monotonic() - t0
    data = b"".join(lines_raw)
    return Outcome(lines=data.split(b"\n"), output=b"".join(output).decode("utf-8", "replace"),
                   returncode=proc.returncode, timed_out=timed_out, wall_s=wall, bwrap=use_bwrap,
                   extra={"over_memory": over_memory, "tree_memory_bytes": tree_cap})


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def session_rss(sid: int) -> int:
    """Resident bytes of the run's whole process tree: every descendant of ``sid`` (bwrap's namespaces included,
    whatever session they moved to) and every process still in session ``sid`` (an orphaned fork)."""
    parent: dict[int, int] = {}
    session: set[int] = set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
            parent[int(d)] = int(fields[1])
            if int(fields[3]) == sid:
                session.add(int(d))
        except (OSError, ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree = session | {sid}
    todo = list(tree)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in tree:
                tree.add(c)
                todo.append(c)
    tree.discard(os.getpid())
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue
    return total


def _end_group(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (the run's), whatever group it moved to."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid and int(d) != os.getpid():
                    os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the run's process group, then SIGKILL it after ``grace`` seconds, whatever it ignores."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def resource_summary(limits: Limits) -> str:
    return (f"{limits.memory_bytes / 2**30:.1f} GiB address space per process, "
            f"{(limits.tree_memory_bytes or limits.memory_bytes) / 2**30:.1f} GiB resident for the whole run, "
            f"{limits.cpu_s or int(2 * limits.wall_s) + 1} s CPU, "
            f"{limits.file_bytes // 2**20} MiB per file, {limits.wall_s:.0f} s wall clock")



__all__ = ["Limits", "Outcome", "SANDBOX_DIR", "SUBMITTED_DIR", "bwrap_path", "run", "resource_summary"]
