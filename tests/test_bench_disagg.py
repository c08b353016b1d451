"""minipaged bench disagg: colocated against disaggregated prefill on the simulated GPU (no model runs)."""
from minipaged.bench.disagg import LINKS, format_sweep, goodput, run_sweep, simulate


def test_every_request_is_served_and_goodput_never_exceeds_throughput():
    for system in ("colocated", "disaggregated"):
        res = simulate(system, rate=4, n=60)
        assert len(res["rows"]) == 60 and all(r["ttft"] > 0 and r["tpot"] >= 0 for r in res["rows"])
        assert goodput(res, 1e9, 1e9) == 60 / res["duration"] >= goodput(res, 0.25, 0.05)


def test_the_transfer_is_priced_from_bytes_per_token_and_the_link():
    fast = simulate("disaggregated", rate=4, n=60, link="nvlink")
    slow = simulate("disaggregated", rate=4, n=60, link="rdma100")
    assert fast["transfer_bytes_per_token"] == slow["transfer_bytes_per_token"] > 0
    assert LINKS["rdma100"] < LINKS["nvlink"]
    # the first token comes from the prefill GPU: the link changes TPOT, never TTFT
    assert [r["ttft"] for r in fast["rows"]] == [r["ttft"] for r in slow["rows"]]
    assert sum(r["tpot"] for r in slow["rows"]) > sum(r["tpot"] for r in fast["rows"])


def test_the_sweep_names_a_winner_and_disaggregation_does_not_raise_throughput():
    r = run_sweep(rates=(1, 4), n=60)
    for row in r["rows"]:
        assert row["wins"] in row
        assert row["disagg_nvlink"]["throughput"] <= row["colocated"]["throughput"] * 1.05
    assert "does not raise throughput" in format_sweep(r)


def test_the_disagg_arrivals_are_the_benchs_one_poisson_process():
    from minipaged.bench.clock import poisson_arrivals
    from minipaged.bench.disagg import _arrivals

    arr = _arrivals(rate=3.0, n=40, seed=5, max_len=2048)
    assert [t for t, _, _ in arr] == poisson_arrivals(40, 3.0, 5)
    assert all(p >= 1 and o >= 2 for _, p, o in arr)


def test_each_gpu_is_the_benchs_clock_loop_and_a_decode_gpu_starts_where_the_prefill_left_off():
    """bench disagg runs clock.run_clock with OneGPU as the scheduler: whole prompts within the token budget (the
    first one whatever its size), decodes never counted against it; a request that arrived over the link (arrived)
    decodes from its prompt's end on, one position further each step, and stops after its output length in all."""
    from minipaged.bench.clock import run_clock
    from minipaged.bench.disagg import OneGPU, arrived

    starts = []
    cost = lambda scheduled: starts.append([(s.start, s.num_new_tokens) for s in scheduled]) or 1.0  # noqa: E731
    run = run_clock(OneGPU(budget=8, max_num_seqs=4), [(6, 3), (5, 2), (4, 2)], [0.0, 0.0, 0.0], cost)
    # step 1: request 0's prompt (6 + 5 > 8 holds request 1 back); step 2: 0 decodes (not budgeted), 1's prompt
    # (5 + 4 > 8 holds 2 back); step 3: 0 and 1 decode, 2's prompt
    assert starts[:3] == [[(0, 6)], [(6, 1), (0, 5)], [(7, 1), (5, 1), (0, 4)]]
    assert run.first_token == [1.0, 2.0, 3.0] and run.finish == [3.0, 3.0, 4.0]
    starts.clear()
    run = run_clock(OneGPU(budget=8, max_num_seqs=4), [(10, 3)], [0.5], cost, make_request=arrived)
    assert starts == [[(10, 1)], [(11, 1)]]  # the first token came from the prefill GPU: two more here
    assert run.finish == [2.5]
