"""Where a submission runs: its own process tree on a private copy, under bubblewrap when the
machine has it, under resource limits always, killed at its wall-clock limit.

Owns the command line of one run (bwrap's options, the limits, the environment) and collecting
what comes back (the result channel, a capped log). Without bwrap a run is the grader's own user: the
grades are then unreadable to it only because grading.Store keeps them mode 0000 while runs go on and
:func:`seal_program` refuses the run whatever could undo that (chmod, ACLs, user namespaces, tracing);
every process it starts dies with it because the grader is its subreaper (:func:`adopt_orphans`). Never decides a grade: grading.py reads the
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


def _user_tasks(uid: int | None = None) -> int:
    """Processes and threads ``uid`` (default: this user) runs now (RLIMIT_NPROC counts them all)."""
    uid, n = (os.getuid() if uid is None else uid), 0
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
    # argv[6]: a seccomp filter (hex) to seal the run with, or '-' (see seal_program)
    "if sys.argv[6] != '-':\n"
    "    import ctypes\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    if os.geteuid() == 0:\n"  # root without bwrap: no capability survives the exec (none to pass 0000 files)
    "        for cap in range(64):\n"
    "            libc.prctl(24, cap, 0, 0, 0)\n"  # PR_CAPBSET_DROP
    "    prog = bytes.fromhex(sys.argv[6])\n"
    "    buf = ctypes.create_string_buffer(prog, len(prog))\n"
    "    class F(ctypes.Structure):\n"
    "        _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]\n"
    "    f = F(len(prog) // 8, ctypes.addressof(buf))\n"
    "    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(f), 0, 0):\n"  # NO_NEW_PRIVS, SECCOMP filter
    "        sys.exit('minipaged grade: could not seal the run (seccomp): errno %d' % ctypes.get_errno())\n"
    "os.execv(sys.argv[7], sys.argv[7:])\n"
)


# -- sealing a run without bwrap: what a process of the same user could otherwise undo ----------------
# The grades are written with mode 0000 while runs go on (Store in grading.py); a process of the same user
# could chmod them back, set an ACL, enter a user namespace (where it holds CAP_DAC_OVERRIDE over its own
# files), or read the grader's memory. The filter makes those system calls fail with EPERM in the run and in
# everything it starts (a filter is inherited and can never be removed); clone3 fails with ENOSYS, so that
# libc falls back to clone, whose flags the filter can read (a new namespace is refused there too).
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SEALED_SYSCALLS = {
    # chmod, fchmod, fchmodat, fchmodat2, setxattr, lsetxattr, fsetxattr, setxattrat, ptrace, process_vm_readv,
    # process_vm_writev, unshare, setns, pidfd_getfd, open_by_handle_at, name_to_handle_at
    "x86_64": (90, 91, 268, 452, 188, 189, 190, 463, 101, 310, 311, 272, 308, 438, 304, 303),
    "aarch64": (52, 53, 452, 5, 6, 7, 463, 117, 270, 271, 97, 268, 438, 265, 264),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def seal_program(machine: str | None = None) -> bytes | None:
    """The seccomp filter (classic BPF, as bytes) that seals a run without bwrap, or None on an architecture it
    does not know. Refused with EPERM: changing a file's mode or ACL, tracing or reading another process, new
    namespaces; clone3 answers ENOSYS (libc then uses clone); another architecture's system calls are refused."""
    import platform
    import struct

    machine = machine or platform.machine()
    arch = _AUDIT_ARCH.get(machine)
    if arch is None:
        return None
    ld_w_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    denied = _SEALED_SYSCALLS[machine]
    # the labels: ALLOW, EPERM, ENOSYS come last; jumps are counted from the next instruction
    prog: list[tuple[int, int, int, int]] = []
    prog.append((ld_w_abs, 0, 0, 4))  # seccomp_data.arch
    body: list = [("jne_arch",), (ld_w_abs, 0, 0, 0)]  # seccomp_data.nr
    if machine == "x86_64":
        body.append(("jge_to", 0x40000000, "EPERM"))  # the x32 ABI
    for nr in denied:
        body.append(("jeq_to", nr, "EPERM"))
    body.append(("jeq_to", _CLONE3, "ENOSYS"))
    body.append(("jeq_next2", _CLONE[machine]))  # clone: look at its flags
    body.append((0x06, 0, 0, allow))
    body.append((ld_w_abs, 0, 0, 16))  # the low 32 bits of args[0], clone's flags
    body.append(("jset_to", _NEW_NAMESPACES, "EPERM"))
    body.append((ret, 0, 0, allow))
    tail = {"EPERM": 0, "ENOSYS": 1}  # offsets after the body
    n = 1 + len(body)
    out: list[tuple[int, int, int, int]] = [prog[0]]
    for i, ins in enumerate(body):
        at = 1 + i  # this instruction's index
        def to(label: str) -> int:
            return n + tail[label] - (at + 1)
        kind = ins[0]
        if kind == "jne_arch":
            out.append((jeq, 0, to("EPERM"), arch))
        elif kind == "jge_to":
            out.append((jge, to(ins[2]), 0, ins[1]))
        elif kind == "jeq_to":
            out.append((jeq, to(ins[2]), 0, ins[1]))
        elif kind == "jeq_next2":
            out.append((jeq, 1, 0, ins[1]))
        elif kind == "jset_to":
            out.append((jset, to(ins[2]), 0, ins[1]))
        else:
            out.append(ins)
    out += [(ret, 0, 0, eperm), (ret, 0, 0, enosys)]
    assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in out)
    return b"".join(struct.pack("<HBBI", c, jt, jf, k) for c, jt, jf, k in out)


def _needed_paths() -> list[str]:
    """What the harness must read: the package, the interpreter and its libraries."""
    paths = {_PACKAGE_PARENT, sys.prefix, sys.base_prefix, sys.exec_prefix}
    cwd = os.path.realpath(os.getcwd())  # on sys.path under `python -m`: the grades may be there, keep it out
    paths |= {p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) != cwd}
    return sorted(paths)


LEARNER_UID = LEARNER_GID = 65534  # "nobody": who learner code runs as inside bwrap when the grader is root


def _hidden_ancestors(paths: list[str]) -> list[str]:
    """The highest folder above each of ``paths`` that LEARNER_UID cannot pass through (no o+x, e.g. a 0700 /root
    holding the interpreter): inside bwrap each becomes an empty tmpfs that every user can pass through, and the
    paths under it are bound back at their own paths (the rest of it stays out of sight)."""
    import stat

    out: set[str] = set()
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts)):  # the proper ancestors below /
            a = str(Path(*parts[:i]))
            try:
                st = os.stat(a)
            except OSError:
                break
            if not st.st_mode & stat.S_IXOTH and st.st_uid != LEARNER_UID:
                out.add(a)
                break
    return sorted(a for a in out if not any(a.startswith(b + "/") for b in out))


def _bwrap_args(workdir: Path, hide: list[str], env: dict, limits: Limits, drop: bool) -> list[str]:
    """bwrap's options for one run, up to and excluding the ``--`` before the command.

    ``drop``: the grader is root and learner code must not be: bwrap then runs as root with no user namespace (a
    user namespace made by root maps root only) and ``setpriv`` inside switches to LEARNER_UID before Python starts,
    so learner code holds no capability and the kernel checks it as LEARNER_UID against the host's files."""
    exe = bwrap_path()
    assert exe is not None
    # all the run writes is in two tmpfs, /tmp and /dev/shm, that share disk_bytes (3/4 and 1/4)
    shm = max(limits.disk_bytes // 4, 2**20)
    sticky = ["--perms", "1777"] if drop else []  # bwrap makes its tmpfs 0755 root: LEARNER_UID must write there
    b = [exe, "--ro-bind", "/", "/", "--dev", "/dev", *sticky, "--size", str(shm), "--tmpfs", "/dev/shm",
         "--proc", "/proc", *sticky, "--size", str(max(limits.disk_bytes - shm, 2**20)), "--tmpfs", "/tmp"]
    for h in hide:  # the class folder and the grader's output: not even readable
        if os.path.isdir(h) and not h.startswith("/tmp/"):
            b += ["--tmpfs", h]
    needed = _needed_paths()
    covered = _hidden_ancestors(needed) if drop else []
    for c in covered:
        b += ["--perms", "0755", "--tmpfs", c]
    shadowed = [h.rstrip("/") for h in hide] + covered
    made: set[str] = set()
    for p in needed:  # under /tmp, a hidden or covered folder, the package must still be there, read-only
        if p.startswith("/tmp/") or any((p + "/").startswith(h + "/") for h in shadowed):
            if drop:  # the folders above it in the tmpfs, which bwrap would make 0700: every user must pass
                for a in map(str, reversed(Path(p).parents)):
                    if a not in made and any(a.startswith(r + "/") for r in ["/tmp", *shadowed]):
                        made.add(a)
                        b += ["--perms", "0755", "--dir", a]
            b += ["--ro-bind", p, p]
    for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU, for workbook 05 on a GPU machine
        b += ["--dev-bind", str(dev), str(dev)]
    # the host's copy is read-only inside: what the run writes stays in its tmpfs, never on the host's disk
    b += ["--ro-bind", str(workdir), SUBMITTED_DIR]
    if drop:
        b += ["--perms", "0777", "--dir", SANDBOX_DIR, "--chdir", SANDBOX_DIR,
              "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
              "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--clearenv"]
    else:
        b += ["--dir", SANDBOX_DIR, "--chdir", SANDBOX_DIR,
              "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for k, v in env.items():
        b += ["--setenv", k, v]
    return b


def _setpriv_args() -> list[str]:
    """Inside bwrap, as root with CAP_SETUID, CAP_SETGID and CAP_SETPCAP only: become LEARNER_UID and keep no
    capability at all, none in the bounding set either (and no_new_privs: no setuid program gives any back)."""
    return [shutil.which("setpriv") or "setpriv", "--reuid", str(LEARNER_UID), "--regid", str(LEARNER_GID),
            "--clear-groups", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"]


@functools.lru_cache(maxsize=1)
def _drop_probe() -> str:
    """Empty when a root grader can run learner code as LEARNER_UID here, else why not: bwrap as root with the run's
    own mounts, setpriv to LEARNER_UID, then the interpreter must start and read the package and the harness."""
    import tempfile

    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if bwrap_path() is None:
        return "bwrap cannot make a sandbox here"
    probe = ("import os, sys, importlib.util as u; open(sys.argv[1]).read(); "
             "[open(u.find_spec(m).origin).read() for m in ('minipaged', 'torch', 'numpy')]; "
             "assert (os.getuid(), os.geteuid(), os.getgid()) == (%d, %d, %d), os.getuid(); "
             "assert os.getgroups() == [], os.getgroups(); "
             "eff = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]; "
             "assert int(eff, 16) == 0, eff; "
             "bnd = [l for l in open('/proc/self/status') if l.startswith('CapBnd')][0].split()[1]; "
             "assert int(bnd, 16) == 0, bnd" % (LEARNER_UID, LEARNER_UID, LEARNER_GID))
    with tempfile.TemporaryDirectory(prefix="minipaged-probe-") as d:
        os.chown(d, LEARNER_UID, LEARNER_GID)
        env = environment(SANDBOX_DIR, use_bwrap=True)
        cmd = (_bwrap_args(Path(d), [], env, Limits(), True) + ["--"] + _setpriv_args()
               + [sys.executable, "-s", "-B", "-c", probe, _HARNESS])
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=120, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the probe did not finish ({e})"
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).decode("utf-8", "replace").strip().splitlines()[-1:]
        return f"user {LEARNER_UID} could not start the interpreter ({sys.executable}) there: " + "".join(tail)
    return ""


def drops_root(use_bwrap: bool) -> bool:
    """True when this run's learner code runs as LEARNER_UID, not as the grader's root."""
    return use_bwrap and hasattr(os, "geteuid") and os.geteuid() == 0 and not _drop_probe()


def why_root() -> str:
    """Why a root grader's learner code would still run as root inside bwrap (empty when it does not)."""
    return _drop_probe() if hasattr(os, "geteuid") and os.geteuid() == 0 else ""


def command(workdir: Path, *, use_bwrap: bool, hide: list[str], env: dict, limits: Limits, procs: int) -> list[str]:
    cpu = limits.cpu_s or int(2 * limits.wall_s) + 1
    # the harness as a script: compiled from its source, never from a __pycache__ a learner could have written
    python = [sys.executable, "-s", "-B", _HARNESS]
    inner = python
    if use_bwrap:
        drop = drops_root(use_bwrap)
        # never root inside: when the grader is root, setpriv makes learner code LEARNER_UID with no capability
        # (root's files, /etc/shadow included, are then out of reach)
        inner = _bwrap_args(workdir, hide, env, limits, drop) + ["--"] + (_setpriv_args() if drop else []) + python
    seal = "-"
    if not use_bwrap and sys.platform.startswith("linux"):
        prog = seal_program()
        seal = prog.hex() if prog is not None else "-"
    return [sys.executable, "-I", "-c", _LAUNCHER, str(limits.memory_bytes), str(cpu), str(limits.file_bytes),
            str(procs), "0", seal, *inner]


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
_SPAWN_LOCK = threading.Lock()  # a run is started and registered, or orphans are swept, never both at once


# -- the grader as the runs' subreaper: nothing a run starts outlives it -------------------------------
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 4, 3, 36, 37
_ADOPTING = {"on": False, "before": frozenset()}


def _prctl(option: int, value: int = 0) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)


def _prctl_get(option: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if option == _PR_GET_CHILD_SUBREAPER:
        out = ctypes.c_int(0)
        return out.value if libc.prctl(option, ctypes.byref(out), 0, 0, 0) == 0 else -1
    return libc.prctl(option, 0, 0, 0, 0)


def _my_children() -> set[int]:
    me, out = os.getpid(), set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def adopt_orphans() -> dict:
    """Make this process (the grader) the child subreaper of every run (``PR_SET_CHILD_SUBREAPER``): a process a
    run starts whose parent dies (a double fork, a native fork through ctypes, a child in its own session after
    setsid) becomes the grader's child instead of init's, and :func:`sweep_orphans` kills it when a run ends.
    The grader is also made non-dumpable, so that a run of the same user cannot read its memory
    (``/proc/<pid>/mem``, its descriptors). Returns what to give :func:`stop_adopting`; a no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return {}
    before = {"subreaper": _prctl_get(_PR_GET_CHILD_SUBREAPER), "dumpable": _prctl_get(_PR_GET_DUMPABLE)}
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_DUMPABLE, 0)
    _ADOPTING.update(on=True, before=frozenset(_my_children()))
    return before


def stop_adopting(before: dict) -> None:
    """Kill what is left (:func:`sweep_orphans`), then give back the subreaper and dumpable settings."""
    if not before:
        return
    sweep_orphans()
    _ADOPTING.update(on=False, before=frozenset())
    if before.get("subreaper", -1) == 0:
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)
    if before.get("dumpable", -1) in (1, 2):
        _prctl(_PR_SET_DUMPABLE, before["dumpable"])


def sweep_orphans() -> list[int]:
    """SIGKILL and reap every process the grader adopted: its children that it did not start as a run and that
    were not its children before grading began. A run's orphan is killed when the next run ends (its own or one
    beside it): honest code leaves none. Returns the pids killed."""
    if not _ADOPTING["on"]:
        return []
    killed: list[int] = []
    with _SPAWN_LOCK:
        for _ in range(50):  # an orphan's own children are adopted in turn when it dies
            orphans = _my_children() - _RUNS_NOW - _ADOPTING["before"]
            if not orphans:
                break
            for pid in orphans:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                killed.append(pid)
            for pid in orphans:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
    return killed


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
    drop = drops_root(use_bwrap)
    base = procs_base if procs_base is not None else _user_tasks(LEARNER_UID if drop else None)
    inner_dir = SANDBOX_DIR if use_bwrap else str(workdir)
    env = environment(inner_dir, use_bwrap=use_bwrap)
    staged = None
    if drop:
        # the learner's copy, owned by LEARNER_UID so that the harness can read it inside (workdir may be 0700)
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
        with _SPAWN_LOCK:  # registered before any sweep can see it
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log_w, stderr=log_w, pass_fds=(wfd,),
                                    cwd=str(workdir), env=env, start_new_session=True, close_fds=True)
            _RUNS_NOW.add(proc.pid)
            _RUNS_EVER.add(proc.pid)
    finally:
        os.close(wfd)
        os.close(log_w)
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
    stopped = False
    while True:
        try:
            proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stop is not None and stop.is_set():  # the grader is stopping: no grace, the run is graded again later
                timed_out = stopped = True
                _end_group(proc.pid)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                break
            if time.monotonic() > deadline:
                timed_out = True
                _kill_group(proc, limits.grace_s)
                break
            if session_rss(proc.pid) > tree_cap:  # RLIMIT_AS is per process: forks could each take all of it
                over_memory = True
                _end_group(proc.pid)
                proc.wait()
                break
    # what the run left behind in its session (a forked child) ends with it, and what it left outside its
    # session whose parent died (adopted by the grader, see adopt_orphans)
    _end_group(proc.pid, reaped=proc.returncode is not None)
    sweep_orphans()
    for t in readers:  # the whole tree is gone: the pipes close at once (a reader is a daemon thread either way)
        t.join(timeout=2 if stopped else limits.grace_s + 5)
    if proc.poll() is None:  # a reader still blocked: something in the group kept a pipe open
        _kill_group(proc, 0)
    _RUNS_NOW.discard(proc.pid)
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
    wall = time.monotonic() - t0
    data = b"".join(lines_raw)
    return Outcome(lines=data.split(b"\n"), output=b"".join(output).decode("utf-8", "replace"),
                   returncode=proc.returncode, timed_out=timed_out, wall_s=wall, bwrap=use_bwrap,
                   extra={"over_memory": over_memory, "tree_memory_bytes": tree_cap})


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _run_tree(sid: int, *, reaped: bool = False) -> set[int]:
    """The run's whole process tree, zombies left out: every descendant of ``sid`` (bwrap's namespaces included,
    whatever session they moved to) and every process still in session ``sid`` (an orphaned fork), with their
    descendants; never this process. ``reaped``: the run's own process was waited for, so its pid may be another
    process's now: only the session's members count then."""
    parent: dict[int, int] = {}
    session: set[int] = set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
            if fields[0] in (b"Z", b"X"):  # dead already: nothing to kill, no memory held
                continue
            parent[int(d)] = int(fields[1])
            if int(fields[3]) == sid:
                session.add(int(d))
        except (OSError, ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree = session if reaped else session | {sid}
    todo = list(tree)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in tree:
                tree.add(c)
                todo.append(c)
    tree.discard(os.getpid())
    return tree


def session_rss(sid: int) -> int:
    """Resident bytes of the run's whole process tree (see _run_tree)."""
    total = 0
    for pid in _run_tree(sid):
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue
    return total


def _end_group(sid: int, *, reaped: bool = False) -> None:
    """SIGKILL the run's whole tree: its process group, every process of its session ``sid`` whatever group it
    moved to, and every descendant whatever session it moved to (bwrap's sandbox, a setsid() child). The tree is
    read before anything is killed (a child killed after its parent would no longer be found by its parent), and
    read again until nothing is left (a fork between the read and the kill)."""
    for _ in range(5):
        tree = _run_tree(sid, reaped=reaped) if os.path.isdir("/proc") else set()
        try:
            os.killpg(sid, signal.SIGKILL)
        except OSError:
            pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not tree - {sid}:
            return


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



__all__ = ["Limits", "Outcome", "SANDBOX_DIR", "SUBMITTED_DIR", "adopt_orphans", "bwrap_path", "run", "resource_summary",
           "seal_program", "stop_adopting", "sweep_orphans"]
