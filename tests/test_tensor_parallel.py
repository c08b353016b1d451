"""Tensor parallelism (minipaged/distributed.py): one scheduler, N worker processes over gloo.

- the sharding rule: heads and MLP columns split; KV heads split when they divide, replicated
  when N is a multiple of them, refused otherwise, with the numbers;
- greedy tokens at N = 2 (KV heads split) and N = 4 (KV heads replicated) equal N = 1's, except at
  a near-tie the changed order of the sums can flip (then the plain model's top two logits there
  are within a hair of each other), with chunked prefill, preemption, prefix caching and n > 1;
- each rank's KV cache holds only its heads; the workers stop when the engine shuts down;
- no worker outlives its driver: not after the interpreter exits without shutdown(), nor after a
  Ctrl-C mid-generation (which ends the driver at once), nor after the driver is killed outright;
  a worker that dies before it starts is a clear error at once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from minipaged import SamplingParams
from minipaged.distributed import COLLECTIVE_TIMEOUT_S, _wait_started, kv_heads_per_rank, shard_rule
from minipaged.engine import LLMEngine

PROMPTS = [[5, 9, 14, 3, 8, 22, 41, 7, 13, 2, 19, 30, 11], [101, 7, 55], [64, 3, 200, 17, 9, 4, 88], [5, 9, 14, 3, 8, 22, 41, 7, 1]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_the_sharding_rule():
    s = shard_rule(num_heads=4, num_kv_heads=2, intermediate_size=96, size=2)
    assert [x.heads for x in s] == [(0, 2), (2, 4)] and [x.kv_heads for x in s] == [(0, 1), (1, 2)]
    assert [x.inter for x in s] == [(0, 48), (48, 96)]
    s = shard_rule(num_heads=4, num_kv_heads=2, intermediate_size=96, size=4)  # KV heads replicated
    assert [x.kv_heads for x in s] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_heads_per_rank(9, 3, 1536, 3) == 1 and kv_heads_per_rank(32, 8, 11008, 2) == 4
    with pytest.raises(ValueError, match="must divide the model's 9 attention heads: use one of \\[1, 3\\]"):
        shard_rule(9, 3, 1536, 2)
    with pytest.raises(ValueError, match="MLP width 102"):
        shard_rule(4, 2, 102, 4)
    with pytest.raises(ValueError, match="neither divides the 4 KV heads nor is a multiple"):
        shard_rule(12, 4, 96, 6)


def _plain_logits(model, ids: list[int]) -> torch.Tensor:
    from conftest import run_paged

    return run_paged(model, ids)[-1]


def assert_same_but_near_ties(model, prompts, got, want, gap: float = 1e-3):
    """Equal tokens, or a first difference where the plain model's top two logits nearly tie."""
    for p, g, w in zip(prompts, got, want):
        if g == w:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        top = _plain_logits(model, p + w[:i]).topk(2).values
        assert float(top[0] - top[1]) <= gap * max(1.0, float(top[0].abs())), (p, g, w, top)


def run(model, tok, prompts=PROMPTS, params=GREEDY, **kw):
    eng = LLMEngine(model, tok, block_size=4, num_blocks=kw.pop("num_blocks", 24), max_num_batched_tokens=8, **kw)
    try:
        ids = [eng.add_request(p, params) for p in prompts]
        done = eng.run()
        return [[s.token_ids for s in done[i].outputs] for i in ids], eng
    finally:
        eng.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_greedy_tokens_equal_one_device(tiny_model, size):
    model, tok = tiny_model
    want, _ = run(model, tok, fast_paths=False)
    got, eng = run(model, tok, tensor_parallel_size=size)
    assert_same_but_near_ties(model, PROMPTS, [g[0] for g in got], [w[0] for w in want])
    assert set(k.split("+")[0] for k in eng.route_counts) == {"tensor_parallel"}
    assert "tensor_parallel_size" in eng.plan.refused["fast_paths"]
    assert eng.kv_cache.num_kv_heads == 1  # 2 KV heads: split over 2 ranks, replicated over 4
    assert all(not p.is_alive() for p in eng.executor._group.procs)  # shut down


@pytest.mark.slow
def test_preemption_prefix_caching_and_n_samples(tiny_model):
    model, tok = tiny_model
    params = SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    kw = dict(num_blocks=14, enable_prefix_caching=True)  # a pool too small for all: preemption
    want, ref = run(model, tok, params=params, fast_paths=False, **kw)
    got, eng = run(model, tok, params=params, tensor_parallel_size=2, **kw)
    assert eng.scheduler.num_preemptions > 0 or ref.scheduler.num_preemptions > 0
    assert eng.stats()["prefix_hit_tokens"] > 0  # two prompts share a prefix
    # sampled with the same seeds: equal wherever no near-tie flips a draw; at least most samples agree
    same = sum(g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert same >= len(PROMPTS) * 2 - 1, (got, want)


def test_bad_settings_are_refused_before_any_process_starts(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="takes attention by name"):
        LLMEngine(model, tok, tensor_parallel_size=2, num_blocks=8,
                  attention=lambda q, k, v, bt, cl, qsl, scale, out=None: q)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLMEngine(model, tok, tensor_parallel_size=3, num_blocks=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLMEngine(model, tok, tensor_parallel_size=0, num_blocks=8)


@pytest.mark.slow
def test_a_dead_worker_fails_the_step_with_its_name_and_nothing_hangs(tiny_model):
    model, tok = tiny_model
    eng = LLMEngine(model, tok, tensor_parallel_size=2, block_size=4, num_blocks=24)
    try:
        first = eng.add_request(PROMPTS[0], GREEDY)
        eng.step()
        worker = eng.executor._group.procs[0]
        worker.kill()
        worker.join(10)
        with pytest.warns(UserWarning):
            done = eng.run()
        assert done[first].finish_reason == "error" and "rank 1" in done[first].error and str(worker.pid) in done[first].error
        later = eng.add_request(PROMPTS[1], GREEDY)  # refused at its step, at once, not hung
        with pytest.warns(UserWarning):
            done = eng.run()
        assert done[later].finish_reason == "error" and "build a new engine" in done[later].error
    finally:
        eng.shutdown()
    assert not any(p.is_alive() for p in eng.executor._group.procs)


# ----- processes are owned: no worker outlives its driver, however the driver ends ---------------

# The driver: the default model (SmolLM2: 9 heads, 3 KV heads, so N = 3; N = 2 divides neither),
# a few tokens generated, the workers' pids written, then either a normal exit without
# shutdown() (the engine is never closed) or generation in a loop until a signal ends it.
DRIVER = """
import faulthandler, os, signal, sys
from minipaged import LLM, SamplingParams

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that gives up asks where it hung
# Ctrl-C as in a terminal: a test run started in the background (`make test &`, a CI job) hands
# its children SIGINT ignored, and Python then never installs its KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)

def main():
    mode, pidfile = sys.argv[1], sys.argv[2]
    llm = LLM(tensor_parallel_size=3)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["Hello"], params)[0].outputs[0].token_ids) == 3
    with open(pidfile + ".tmp", "w") as f:
        f.write(" ".join(str(p.pid) for p in llm.engine.executor._group.procs))
    os.replace(pidfile + ".tmp", pidfile)
    while mode == "loop":
        llm.generate(["Hello there", "One two three"], params)

if __name__ == "__main__":  # spawn re-imports this script in every worker
    main()
"""


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (a reaped-late orphan counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")  # with /proc, its absence already said "gone"


def _start_driver(tmp_path, mode: str):
    script, pidfile = tmp_path / "driver.py", tmp_path / "pids"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(pidfile)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600  # the model loads and the workers start on shared cores
    while not pidfile.exists():
        if proc.poll() is not None:
            pytest.fail(f"the driver exited ({proc.returncode}) before it generated:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the driver did not generate within 600 s")
        time.sleep(0.2)
    pids = [int(x) for x in pidfile.read_text().split()]
    assert len(pids) == 2 and all(_running(p) for p in pids)
    return proc, pids


def _assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for p in left:  # the test leaves no orphan of its own either
        os.kill(p, signal.SIGKILL)
    assert not left, f"worker(s) {left} outlived their driver by {within} s"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and /proc")
def test_no_worker_outlives_an_interpreter_that_exits_without_shutdown(tmp_path):
    proc, pids = _start_driver(tmp_path, "exit")
    try:
        out, _ = proc.communicate(timeout=COLLECTIVE_TIMEOUT_S - 15)  # a goodbye, not a collective timeout
    except subprocess.TimeoutExpired:
        proc.kill()
        _assert_gone(pids, 0)
        pytest.fail("the interpreter did not exit: the engine's workers held it")
    assert proc.returncode == 0, out[-3000:]
    _assert_gone(pids)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and /proc")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_no_worker_outlives_a_driver_stopped_mid_generation(tmp_path, sig):
    """Ctrl-C (SIGINT to the driver alone, most likely mid-step while the workers wait in an
    all-reduce) ends the driver at once, not after the collective timeout, and takes the workers
    with it; a driver killed outright (SIGKILL: no cleanup runs at all) leaves none behind either."""
    proc, pids = _start_driver(tmp_path, "loop")
    time.sleep(1.0)  # well into the loop
    t = time.monotonic()
    proc.send_signal(getattr(signal, sig))
    try:
        out, _ = proc.communicate(timeout=COLLECTIVE_TIMEOUT_S - 15)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # its threads' stacks, for the message
        time.sleep(2)
        proc.kill()
        out, _ = proc.communicate()
        _assert_gone(pids, 0)
        pytest.fail(f"the driver did not exit within {COLLECTIVE_TIMEOUT_S - 15} s of {sig}; it said:\n{out[-4000:]}")
    assert proc.returncode == -getattr(signal, sig) or (sig == "SIGINT" and proc.returncode == 1), out[-3000:]
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in out and "Timed out" not in out, out[-3000:]
    _assert_gone(pids)
    assert time.monotonic() - t < COLLECTIVE_TIMEOUT_S - 15


@pytest.mark.slow
def test_a_worker_that_dies_before_it_starts_is_a_clear_error_at_once():
    """(A script without the ``__main__`` guard: spawn re-imports it and the worker fails.)"""
    ctx = torch.multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=os._exit, args=(3,), daemon=True)  # dies before it says it started
    proc.start()
    writer.close()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code 3 before it started.*__main__"):
        _wait_started([proc], [reader], timeout=COLLECTIVE_TIMEOUT_S)
    assert time.monotonic() - t < 30 and not proc.is_alive()
