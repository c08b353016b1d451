"""The simulated GPU: the cost model's arithmetic, each reservation policy, and learner-style
parts driving the simulation to the same result as minipaged's own."""
from __future__ import annotations

import math

import pytest

from minipaged.bench.gpu.cost import Calibration, StepCostModel, activation_reserve_bytes, memory_plan
from minipaged.bench.clock import poisson_arrivals
from minipaged.bench.gpu.datasets import sample_lengths
from minipaged.bench.gpu.paper import format_table, max_rate_from_curve, paper_checks, readme_block
from minipaged.bench.gpu.policies import BuddySpans, ContiguousSpans, Reservation, ReservingScheduler, next_pow2
from minipaged.bench.gpu.simulator import LengthStop, build_scheduler, run
from minipaged.bench.gpu.specs import GPUS, MODELS, get_gpu, get_model
from minipaged.sequence import Sequence

NO_OVERHEAD = Calibration(bandwidth_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0, seq_overhead_s=0.0)


# -- specs and memory --------------------------------------------------------------------------
def test_every_spec_table_entry_has_a_source_and_a_shape_that_matches_its_parameter_count():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "l4", "t4"} <= set(GPUS)
    assert {"opt-13b", "llama-2-7b", "llama-2-13b", "smollm2-135m"} <= set(MODELS)
    for g in GPUS.values():
        assert "datasheet" in g.source and g.bandwidth > 1e11 and g.peak_flops > 1e13
    for m in MODELS.values():
        assert m.source
        assert abs(m.shape_params() / m.num_params - 1) < 0.01, m.name


def test_kv_bytes_per_token_is_two_x_layers_x_kv_heads_x_head_dim_x_dtype():
    assert get_model("opt-13b").kv_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200  # the paper's "800 KB"
    assert get_model("smollm2-135m").kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_memory_plan_subtracts_weights_and_activations_from_usable_memory():
    p = memory_plan("a100-40gb", "opt-13b")
    assert p.usable_bytes == int(40 * 2**30 * 0.9)
    assert p.weight_bytes == 12_853_000_000 * 2
    assert p.activation_bytes == activation_reserve_bytes(get_model("opt-13b"))
    assert p.kv_bytes == p.usable_bytes - p.weight_bytes - p.activation_bytes
    assert p.kv_tokens == p.kv_bytes // 819_200
    assert abs(p.kv_tokens - 15_700) / 15_700 < 0.03  # the paper's Table 1: 15.7K KV slots for OPT-13B


def test_unknown_names_list_the_known_ones_and_a_model_that_does_not_fit_says_by_how_much():
    with pytest.raises(ValueError, match="a100-40gb"):
        get_gpu("a100-40")
    with pytest.raises(ValueError, match="opt-13b"):
        get_model("opt13")
    with pytest.raises(ValueError, match=r"llama-2-13b does not fit on t4: .*GB of weights"):
        memory_plan("t4", "llama-2-13b")


# -- step time ---------------------------------------------------------------------------------
def test_a_decode_step_is_weights_plus_context_over_bandwidth_when_memory_bound():
    m = StepCostModel("a100-40gb", "opt-13b", NO_OVERHEAD)
    model = get_model("opt-13b")
    c = m.cost([(99, 1)])  # one sequence, context 100 after the step
    want_bytes = model.weight_bytes_read_per_step + (100 + 1) * model.kv_bytes_per_token
    assert c.bytes_moved == want_bytes
    assert c.bound == "memory"
    assert c.seconds == pytest.approx(want_bytes / 1555e9)


def test_attention_cost_grows_with_the_context_read():
    m = StepCostModel("a100-40gb", "opt-13b")
    t = [m.decode_time(32, ctx) for ctx in (16, 256, 1024, 2048)]
    assert t == sorted(t) and t[-1] > t[0] * 1.3
    kv = get_model("opt-13b").kv_bytes_per_token
    assert m.cost([(1023, 1)] * 32).bytes_moved - m.cost([(15, 1)] * 32).bytes_moved == 32 * (1024 - 16) * kv


def test_a_long_prefill_is_compute_bound_and_counts_causal_pairs_exactly():
    m = StepCostModel("a100-40gb", "opt-13b", NO_OVERHEAD)
    c = m.cost([(0, 2048)])
    assert c.bound == "compute"
    model = get_model("opt-13b")
    pairs = 2048 * 2049 // 2
    want = 2 * m.body_params * 2048 + 2 * model.vocab_size * model.hidden_size + 4 * 40 * 40 * 128 * pairs
    assert c.flops == want
    # a chunk that starts past a cached prefix sees the prefix too
    assert m.cost([(100, 10)]).flops - m.cost([(0, 10)]).flops == 4 * 40 * 40 * 128 * 100 * 10


def test_overheads_add_per_step_and_per_sequence():
    cal = Calibration(1.0, 1.0, step_overhead_s=0.01, seq_overhead_s=0.001)
    base = StepCostModel("a100-40gb", "opt-13b", NO_OVERHEAD)
    m = StepCostModel("a100-40gb", "opt-13b", cal)
    step = [(10, 1)] * 5
    assert m.step_time(step) == pytest.approx(base.step_time(step) + 0.01 + 5 * 0.001)
    assert m.step_time([]) == 0.0


# -- datasets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,inp,out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_synthesized_lengths_have_the_papers_means_and_fit_the_context(name, inp, out):
    r = sample_lengths(name, 20_000, max_len=2048, seed=3)
    p = sum(a for a, _ in r) / len(r)
    o = sum(b for _, b in r) / len(r)
    assert abs(p - inp) / inp < 0.03 and abs(o - out) / out < 0.03
    assert all(a >= 1 and b >= 1 and a + b <= 2048 for a, b in r)


# -- reservation policies ----------------------------------------------------------------------
def test_each_reservation_policy_reserves_what_the_paper_says():
    assert [next_pow2(n) for n in (1, 2, 3, 25, 32, 33)] == [1, 2, 4, 32, 32, 64]
    assert Reservation("max").tokens(100, 25, 2048) == 2048
    assert Reservation("pow2").tokens(100, 25, 2048) == 132  # the paper's example: 25 -> 32 positions
    assert Reservation("pow2").tokens(1500, 1000, 2048) == 2048  # never past the model's context
    assert Reservation("oracle").tokens(100, 25, 2048) == 125
    assert Reservation("peak").tokens(100, 25, 2048) == 124  # the last token sampled is never written
    # minipaged bench's reservations come in whole blocks
    assert Reservation("max", block_size=16).tokens(100, 25, 478) == 480
    assert Reservation("peak", block_size=16).tokens(100, 25, 2048) == 128
    assert Reservation("peak", block_size=16).tokens(100, 29, 2048) == 128  # 128 slots: exactly 8 blocks
    with pytest.raises(ValueError):
        Reservation("half").tokens(1, 1, 8)
    with pytest.raises(ValueError, match="block_size"):
        Reservation("max", block_size=0).tokens(1, 1, 8)


def test_contiguous_spans_leave_holes_a_larger_request_cannot_use():
    s = ContiguousSpans(100)
    a, b, c = s.place(30), s.place(30), s.place(30)
    assert (a, b, c) == (0, 30, 60)
    s.release(a, 30)
    s.release(c, 30)  # 30 + 40 free, but not side by side
    assert s.place(50) is None and s.largest_hole == 40
    s.release(b, 30)  # now it merges into one
    assert s.free == [[0, 100]] and s.place(100) == 0


def test_buddy_placement_rounds_up_to_a_power_of_two_and_merges_only_buddies():
    b = BuddySpans(15_455)  # OPT-13B's KV room on an A100-40GB: arenas 8192 + 4096 + 2048 + 1024 + ...
    assert [o for _, _, o in b.arena_order][:4] == [13, 12, 11, 10]
    starts = [b.place(2048) for _ in range(8)]
    assert None not in starts[:7] and starts[7] is None  # 7 max-length reservations, as 15455 // 2048
    small = BuddySpans(1024)
    a, c = small.place(300), small.place(300)  # each takes 512: two fill the arena
    assert (a, c) == (0, 512) and small.place(1) is None
    small.release(a, 300)
    d = small.place(100)  # 128 split off the freed 512
    assert d == 0 and small.largest_hole == 256
    small.release(c, 300)
    small.release(d, 100)  # everything merges back into one block
    assert small.free[10] == [0] and small.place(1024) == 0


def _reserving(kind, capacity=1000, static=False, placement="buddy"):
    return build_scheduler({"max": "orca_max", "pow2": "orca_pow2", "oracle": "orca_oracle"}[kind] if not static
                           else "fastertransformer", capacity, block_size=16, max_len=512, placement=placement)


@pytest.mark.parametrize("kind,placement,fits", [("max", "first_fit", 2), ("pow2", "first_fit", 4),
                                                 ("oracle", "first_fit", 4), ("max", "buddy", 2),
                                                 ("pow2", "buddy", 2), ("oracle", "buddy", 4)])
def test_a_reserving_scheduler_admits_only_what_its_reservations_fit(kind, placement, fits):
    # 1,100 slots; each request: prompt 200, output 50 -> max reserves 512, pow2 264, oracle 250;
    # a buddy placement rounds those up to 512, 512 and 256 in its 1,024-slot arena
    sched = _reserving(kind, capacity=1100, placement=placement)
    seqs = [Sequence(i, [0] * 200, max_tokens=50, ignore_eos=True) for i in range(6)]
    for s in seqs:
        assert sched.add_request(s)
    out = sched.schedule()
    assert len(out.scheduled) == len(sched.running) == fits
    assert sched.reserved_tokens == sum(sched.reservation_of(s) for s in sched.running)
    assert sched.reserved_tokens <= 1100


def test_a_reservation_is_returned_when_its_request_finishes_and_the_next_one_goes_in():
    sched = _reserving("oracle", capacity=300)
    a = Sequence("a", [0] * 100, max_tokens=3, ignore_eos=True)
    b = Sequence("b", [0] * 100, max_tokens=150, ignore_eos=True)
    assert sched.add_request(a) and sched.add_request(b)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["a"]  # b's 250 does not fit beside a's 103
    for _ in range(3):
        sched.update(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
        out = sched.schedule()
    assert a.is_finished and [s.seq.seq_id for s in out.scheduled] == ["b"]
    assert sched.reserved == {"b": 250}


def test_static_batching_waits_for_the_whole_batch_to_finish():
    sched = build_scheduler("fastertransformer", 2 * 512, block_size=16, max_len=512)
    seqs = [Sequence(i, [0] * 10, max_tokens=o, ignore_eos=True) for i, o in enumerate((2, 8, 2))]
    for s in seqs:
        sched.add_request(s)
    ran = []
    while sched.has_unfinished():
        out = sched.schedule()
        ran.append(sorted(s.seq.seq_id for s in out.scheduled))
        sched.update(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
    assert 2 not in {i for step in ran[:8] for i in step}  # request 2 waits for 0 and 1 both
    assert ran[8] == [2]


def test_a_request_whose_reservation_exceeds_the_cache_is_rejected_with_the_numbers():
    sched = build_scheduler("orca_max", 1000, block_size=16, max_len=2048)
    s = Sequence(0, [0] * 10, max_tokens=10, ignore_eos=True)
    assert not sched.add_request(s)
    assert "2048" in s.reject_reason and "1000" in s.reject_reason


# -- the simulation ----------------------------------------------------------------------------
def _small_run(system, rate=4.0, n=80, kv_tokens=2000, **parts):
    reqs = sample_lengths("sharegpt", n, max_len=512, seed=5)
    arr = poisson_arrivals(n, rate, seed=5)
    sched = build_scheduler(system, kv_tokens, block_size=16, max_len=512, **parts)
    return run(sched, reqs, arr, StepCostModel("a100-40gb", "opt-13b"), system, rate, keep_batches=True)


def test_paging_batches_more_requests_than_any_reservation_under_load():
    res = {s: _small_run(s, rate=20.0) for s in ("vllm", "orca_oracle", "orca_pow2", "orca_max")}
    b = {s: r.mean_batched_requests for s, r in res.items()}
    assert b["vllm"] > b["orca_oracle"] > b["orca_max"] and b["orca_pow2"] > b["orca_max"]
    assert b["orca_max"] <= 2000 // 512 + 1e-9  # max reservation: at most capacity // max_len at once
    assert all(r.num_requests == 80 and r.rejected == 0 for r in res.values())
    assert res["vllm"].normalized_latency < res["orca_max"].normalized_latency


def test_latency_rises_with_the_request_rate():
    lo, hi = _small_run("vllm", rate=0.5), _small_run("vllm", rate=50.0)
    assert hi.normalized_latency > 2 * lo.normalized_latency
    assert hi.mean_batched_requests > lo.mean_batched_requests


def test_the_length_stop_rule_ends_a_request_where_the_schedulers_stop_checker_would():
    from minipaged.detokenizer import StopChecker

    for prompt, out, max_len in ((10, 5, None), (10, 5, 12), (100, 50, 150), (3, 1, 8)):
        a = Sequence(0, [0] * prompt, max_tokens=out, ignore_eos=True)
        b = Sequence(1, [0] * prompt, max_tokens=out, ignore_eos=True)
        a.stop_checker, b.stop_checker = LengthStop(a, max_len), StopChecker.for_sequence(b, max_model_len=max_len)
        steps = []
        for seq in (a, b):
            n = 0
            while seq.finish_reason is None:
                seq.append_token(1)
                n += 1
            steps.append((n, seq.finish_reason))
        assert steps[0] == steps[1], (prompt, out, max_len)
    s = Sequence(0, [0] * 4, max_tokens=10, ignore_eos=True)
    s.stop_checker = LengthStop(s)
    s.stop_checker.advance(9)
    assert s.num_tokens == 13 and s.stop_checker.remaining == 1
    with pytest.raises(ValueError):
        s.stop_checker.advance(1)  # that token would finish it: a step must take it


class _CountingScheduler:
    """Any scheduler, counting the steps it is asked to schedule."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def schedule(self):
        self.calls += 1
        return self.inner.schedule()


@pytest.mark.parametrize("system,rate,kv", [("vllm", 2.0, 40_000), ("vllm", 8.0, 2000), ("orca_oracle", 8.0, 2000),
                                            ("orca_pow2", 1.0, 2000), ("orca_max", 8.0, 2000),
                                            ("fastertransformer", 2.0, 2000)])
def test_skipping_ahead_gives_exactly_the_step_by_step_result(system, rate, kv):
    # light load (arrivals end windows), heavy load (a blocked queue; vLLM preempts), each policy
    reqs = sample_lengths("sharegpt", 60, max_len=512, seed=11)
    arr = poisson_arrivals(60, rate, seed=11)
    got = {}
    for skip in (False, True):
        sched = _CountingScheduler(build_scheduler(system, kv, block_size=16, max_len=512))
        r = run(sched, reqs, arr, StepCostModel("a100-40gb", "opt-13b"), system, rate, keep_batches=True,
                skip_ahead=skip)
        got[skip] = (r, sched.calls)
    (a, calls_a), (b, calls_b) = got[False], got[True]
    assert a.batch_sizes == b.batch_sizes and a.num_steps == b.num_steps == len(a.batch_sizes)
    assert a.finish_times == b.finish_times  # float for float: the same step times added in the same order
    assert (a.num_preemptions, a.normalized_latency, a.mean_batched_requests) == \
        (b.num_preemptions, b.normalized_latency, b.mean_batched_requests)
    assert calls_a == a.num_steps and calls_b < calls_a / 2  # most steps were skipped, not scheduled
    if (system, kv) == ("vllm", 2000):
        assert a.num_preemptions > 0


def test_learner_style_lean_parts_drive_the_simulation_to_the_reference_result():
    lean = pytest.importorskip("test_contracts")
    pool = {"allocator_cls": lean.LeanAllocator, "block_table_cls": lean.LeanTable}
    trio = {**pool, "scheduler_cls": lean.LeanScheduler}
    # (system, rate, parts): under load vLLM preempts, which the workbook's lean scheduler
    # does not cover, so there the lean pool and table run under minipaged's scheduler
    for system, rate, kv, parts in (("vllm", 6.0, 2000, pool), ("vllm", 6.0, 40_000, trio),
                                    ("orca_oracle", 6.0, 2000, trio), ("fastertransformer", 1.0, 2000, trio)):
        ref = _small_run(system, rate=rate, kv_tokens=kv)
        got = _small_run(system, rate=rate, kv_tokens=kv, **parts)
        assert got.batch_sizes == ref.batch_sizes, (system, rate)
        assert got.normalized_latency == pytest.approx(ref.normalized_latency)
        assert got.num_preemptions == ref.num_preemptions
        if parts is trio and system == "vllm":
            assert ref.num_preemptions == 0
        if parts is pool:
            assert ref.num_preemptions > 0  # the comparison covers recompute after preemption


# -- the paper runner's bookkeeping ------------------------------------------------------------
def test_max_rate_interpolates_where_the_curve_crosses_the_threshold():
    curve = [{"rate": 1.0, "normalized_latency": 0.05}, {"rate": 2.0, "normalized_latency": 0.1},
             {"rate": 3.0, "normalized_latency": 0.4}]
    assert max_rate_from_curve(curve, 0.2) == pytest.approx(2.5)
    assert max_rate_from_curve(curve, 1.0) == 3.0
    assert max_rate_from_curve(curve, 0.01) == 0.0


def test_paper_checks_and_tables_read_the_result():
    res = {"systems": {s: {"label": s, "max_rate": r, "mean_batched_requests": b, "curve": []}
                       for s, r, b in (("orca_max", 0.5, 7.1), ("orca_oracle", 1.0, 20.0), ("vllm", 2.0, 30.0))},
           "ratios": {"vllm_over_orca_max": 4.0, "vllm_over_orca_oracle": 2.0},
           "settings": {"gpu": "a100-40gb", "model": "opt-13b", "dataset": "sharegpt", "fig13_rate": 2.0,
                        "latency_threshold": 0.2, "memory_plan": {"kv_tokens": 15455}, "requests_per_point": 10,
                        "curve_fractions_of_knee": [1, 2], "wall_seconds": 1.0}}
    c = paper_checks(res)
    assert c["fig13_orca_max"]["within_25pct"] and not c["fig13_orca_oracle"]["within_25pct"]
    assert c["vllm_over_orca_max"]["holds"] and c["vllm_over_orca_oracle"]["holds"]
    assert "| orca_max | 0.500 | 4.0x | - | 7.10 | - |" in readme_block(res)
    assert "| orca_max | 0.500 | 4.0x | 2.7-8x | 7.10 | 7.00 |" in readme_block(
        {**res, "paper": {"fig13_mean_batched_requests": {"orca_max": 7.0}, "vllm_max_rate_over": {"orca_max": [2.7, 8]}}})
    assert "1.90x / 3.80x at 0.1 s/token" in readme_block(
        {**res, "ratios_by_threshold": {"0.1": {"vllm_over_orca_oracle": 1.9, "vllm_over_orca_max": 3.8}}})
    assert "4.00x" in format_table(res)


def test_the_seed_scenario_reproduces_what_holds_and_says_why_the_rest_cannot():
    from minipaged.bench.gpu.seed import bandwidth_bound_tok_s, format_seed_table, seed_scenario

    res = seed_scenario(n=200)
    rows = {r["claim"]: r for r in res["rows"]}
    assert abs(rows["model weights (GB)"]["simulated"] - 14) < 1 and abs(rows["KV room (GB)"]["simulated"] - 24) < 2
    assert rows["contiguous sequences (2,048 reserved each)"]["simulated"] == 23  # not 9
    # one sequence at a time cannot beat the weights' read at full bandwidth: 840 tok/s is out of reach
    ceiling = bandwidth_bound_tok_s(1)
    assert ceiling < 840 / 5 and rows["naive serving (tok/s)"]["simulated"] < ceiling
    assert rows["naive serving (tok/s)"]["verdict"] == "unreachable"
    st, co = rows["static batching (tok/s)"], rows["continuous batching (tok/s)"]
    assert co["simulated_sharegpt"] > 1.5 * st["simulated_sharegpt"]  # paging pays with varied lengths
    assert rows["paged sequences, ShareGPT lengths"]["simulated"] > 23  # more than the reservations
    assert "unreachable" in format_seed_table(res)


# -- the validation on this CPU (scripts/validate_simgpu_cpu.py): its logic on tiny inputs -------------
def _exact_samples(machine, model, cal, steps, profile=None, attention=None):
    from minipaged.bench.gpu.validate import Sample, cost_model

    cost = cost_model(machine, model, cal, profile, attention)
    return [Sample(s, cost.step_time(s)) for s in steps]


def test_the_calibration_recovers_the_constants_that_made_the_steps():
    from dataclasses import replace

    from minipaged.bench.gpu.validate import (compare, cost_model, decode_step, fit_calibration, format_report,
                                              machine_spec)

    machine = machine_spec(10e9, 100e9)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)
    truth = Calibration(bandwidth_efficiency=1.0, compute_efficiency=0.6, step_overhead_s=0.004, seq_overhead_s=3e-4)
    dec = _exact_samples(machine, model, truth, [decode_step(1, 80), decode_step(16, 80)])  # memory- and compute-bound
    pre = _exact_samples(machine, model, truth, [((0, 256),), ((0, 512),)])
    bare = cost_model(machine, model, truth)
    assert [bare.cost(s.step).bound for s in dec] == ["memory", "compute"]  # both sides of the roofline
    cal = fit_calibration(machine, model, dec, pre)
    assert cal.compute_efficiency == pytest.approx(0.6, rel=1e-3)
    assert cal.step_overhead_s == pytest.approx(0.004, rel=1e-3) and cal.seq_overhead_s == pytest.approx(3e-4, rel=1e-3)
    val = _exact_samples(machine, model, truth, [decode_step(b, 80) for b in (2, 4, 32, 64)])
    res = compare(machine, model, dec, pre, val)
    assert res["within_target"] and res["worst_validation_error"] < 1e-3
    assert [r["role"] for r in res["steps"]].count("validation") == 4
    assert "worst validation error 0%: within the 25% target" in format_report(res)
    # a measurement the model cannot explain is reported as the error it is, not fitted away
    slow = [type(s)(s.step, 2 * s.seconds) for s in val]
    res = compare(machine, model, dec, pre, slow)
    assert not res["within_target"] and res["worst_validation_error"] == pytest.approx(0.5, rel=1e-3)


def test_a_linear_profile_interpolates_between_measured_rows_and_extends_its_last_slope_never_falling():
    from minipaged.bench.gpu.cost import LinearProfile

    p = LinearProfile((1, 2, 8), (0.010, 0.030, 0.020), (0.001, 0.002, 0.004))
    assert p.body(1) == 0.010 and p.body(2) == 0.030 and p.body(8) == 0.020  # the measured rows, as measured
    assert p.body(5) == pytest.approx(0.025)  # halfway from 2 to 8
    assert p.body(14) == pytest.approx(0.020) == p.body(10_000)  # past the last row: a falling last slope stays flat
    assert p.head(16) == pytest.approx(0.004 + 8 * 0.002 / 6)
    assert p.body(0) == 0.0 and p.head(0) == 0.0
    with pytest.raises(ValueError, match="increasing"):
        LinearProfile((2, 1), (0.1, 0.2), (0.1, 0.2))
    with pytest.raises(ValueError, match="one body and one head time per row"):
        LinearProfile((1, 2), (0.1,), (0.1, 0.2))


def test_with_a_profile_the_weights_leave_the_roofline_and_attention_stays_on_it():
    from dataclasses import replace

    from minipaged.bench.gpu.cost import LinearProfile
    from minipaged.bench.gpu.validate import machine_spec

    machine = machine_spec(10e9, 100e9)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)
    prof = LinearProfile((1, 2, 4, 64), (0.010, 0.040, 0.030, 0.100), (0.002, 0.003, 0.004, 0.020))
    m = StepCostModel(machine, model, NO_OVERHEAD, dtype_bytes=4, linear_profile=prof)
    bare = StepCostModel(machine, model, NO_OVERHEAD, dtype_bytes=4)
    c = m.cost([(79, 1)] * 2)  # two decodes at context 80: the profile's 2-row body and head, then K/V
    kv = model.kv_bytes_per_token
    assert c.linear_s == pytest.approx(0.040 + 0.003)
    assert c.bytes_moved == 2 * (80 + 1) * kv  # no weights: the profile read them
    assert c.flops == 4 * model.num_layers * model.num_heads * model.head_dim * 2 * 80  # attention's alone
    assert c.seconds == pytest.approx(0.043 + max(c.bytes_moved / 10e9, c.flops / 100e9)) and c.bound == "linear"
    # slower at 2 rows than at 4 because the profile says so; the roofline alone cannot say it
    assert m.decode_time(2, 80) > m.decode_time(4, 80) and bare.decode_time(2, 80) < bare.decode_time(4, 80)
    # a prefill chunk multiplies all its tokens but samples once
    assert m.cost([(0, 64)]).linear_s == pytest.approx(0.100 + 0.002)


def test_the_calibration_with_a_profile_recovers_its_constants_and_predicts_the_slow_small_batches():
    from dataclasses import replace

    from minipaged.bench.gpu.cost import LinearProfile
    from minipaged.bench.gpu.validate import compare, cost_model, decode_step, fit_calibration, machine_spec

    machine = machine_spec(10e9, 100e9)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)
    prof = LinearProfile((1, 2, 4, 16, 64, 256, 512), (0.014, 0.047, 0.055, 0.050, 0.24, 0.9, 1.8),
                         (0.009, 0.022, 0.040, 0.039, 0.086, 0.2, 0.4))
    truth = Calibration(1.0, 0.3, step_overhead_s=0.004, seq_overhead_s=3e-4)
    dec = _exact_samples(machine, model, truth, [decode_step(1, 80), decode_step(16, 80)], prof)
    pre = _exact_samples(machine, model, truth, [((0, 256),), ((0, 512),)], prof)
    cal = fit_calibration(machine, model, dec, pre, profile=prof)
    assert cal.compute_efficiency == pytest.approx(0.3, rel=1e-3)
    assert cal.step_overhead_s == pytest.approx(0.004, rel=1e-3) and cal.seq_overhead_s == pytest.approx(3e-4, rel=1e-3)
    val = _exact_samples(machine, model, truth, [decode_step(b, 80) for b in (2, 4, 64)], prof)
    res = compare(machine, model, dec, pre, val, profile=prof)
    assert res["within_target"] and res["worst_validation_error"] < 1e-3
    assert res["linear_profile"]["rows"] == list(prof.rows)
    # the same measurements priced by the roofline alone miss the slow 2-row step: the profile is what explains it
    plain = compare(machine, model, dec, pre, val)
    assert plain["linear_profile"] is None and plain["worst_validation_error"] > 0.25


def test_an_attention_profile_prices_each_group_of_decodes_by_its_longest_context():
    from dataclasses import replace

    from minipaged.attention.torch_sdpa import decode_groups
    from minipaged.bench.gpu.cost import AttentionProfile, LinearProfile
    from minipaged.bench.gpu.validate import machine_spec

    ap = AttentionProfile((1, 4), (64, 128), ((0.001, 0.002), (0.004, 0.008)))
    assert ap.call(4, 128) == 0.008 and ap.call(2, 96) == pytest.approx(0.0015 + (0.006 - 0.0015) / 3)  # bilinear: 96 halfway in context, 2 a third in batch
    assert ap.decode([100, 100, 100, 100]) == pytest.approx(ap.call(4, 100))
    assert ap.decode([]) == 0.0
    # the padded gather's rule: very unequal contexts go in separate calls, each padded to its own longest
    grouped = replace(ap, groups=decode_groups)
    ctx = [1000, 20, 20, 20]
    groups = decode_groups(ctx)
    assert len(groups) > 1  # the rule splits them
    assert grouped.decode(ctx) == pytest.approx(sum(ap.call(len(g), max(ctx[i] for i in g)) for g in groups))
    assert grouped.decode(ctx) < ap.decode(ctx)
    assert ap.decode(ctx) == pytest.approx(ap.call(4, 1000))  # one call: every row padded to 1000
    with pytest.raises(ValueError, match="one time per"):
        AttentionProfile((1, 4), (64,), ((0.1, 0.2),))

    machine = machine_spec(10e9, 100e9)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)
    lin = LinearProfile((1, 64), (0.01, 0.1), (0.001, 0.01))
    timed = []

    def prefill(pairs):  # a stand-in for hardware.attention_timer: what it was asked, and a price
        timed.append(pairs)
        return 0.001 * sum(n for _, n in pairs)

    m = StepCostModel(machine, model, NO_OVERHEAD, dtype_bytes=4, linear_profile=lin,
                      attention_profile=replace(ap, prefill=prefill))
    c = m.cost([(99, 1), (127, 1), (0, 30)])  # two decodes and a prefill chunk in one step
    assert timed == [((0, 30),)]
    assert c.attention_s == pytest.approx(ap.call(2, 128) + 0.030)
    assert c.flops == 0 and c.bytes_moved == 32 * model.kv_bytes_per_token  # the roofline keeps the K/V writes
    assert c.bound == "linear" or c.bound == "attention"
    with pytest.raises(ValueError, match="skip_ahead"):
        m.decode_totals_time(2, 200)


def test_with_every_operator_measured_the_calibration_fits_per_step_sequence_and_token_overheads():
    from dataclasses import replace

    from minipaged.bench.gpu.cost import AttentionProfile, LinearProfile
    from minipaged.bench.gpu.validate import decode_step, fit_calibration, machine_spec

    machine = machine_spec(10e9, 100e9)
    model = replace(get_model("smollm2-135m"), dtype_bytes=4)
    lin = LinearProfile((1, 2, 16, 512), (0.03, 0.05, 0.05, 0.8), (0.01, 0.02, 0.02, 0.2))
    ap = AttentionProfile((1, 16), (64, 128), ((0.002, 0.003), (0.006, 0.01)), prefill=lambda pairs: 0.05)
    truth = Calibration(1.0, 1.0, step_overhead_s=0.012, seq_overhead_s=4e-4, token_overhead_s=5e-5)
    dec = _exact_samples(machine, model, truth, [decode_step(1, 80), decode_step(16, 80)], lin, ap)
    pre = _exact_samples(machine, model, truth, [((0, 256),), ((0, 512),)], lin, ap)
    cal = fit_calibration(machine, model, dec, pre, profile=lin, attention=ap)
    assert cal.step_overhead_s == pytest.approx(0.012, rel=1e-6)
    assert cal.seq_overhead_s == pytest.approx(4e-4, rel=1e-6)
    assert cal.token_overhead_s == pytest.approx(5e-5, rel=1e-6)


def test_two_passes_are_averaged_only_on_the_same_step_and_grid():
    from minipaged.bench.gpu.validate import Sample, decode_step, mean_profile, mean_sample

    a, b = Sample(decode_step(2, 80), 0.1), Sample(decode_step(2, 80), 0.3)
    assert mean_sample(a, b).seconds == pytest.approx(0.2)
    with pytest.raises(ValueError, match="same step"):
        mean_sample(a, Sample(decode_step(4, 80), 0.1))
    p = mean_profile({"rows": [1, 2], "body_s": [1.0, 2.0], "seconds": [[1.0, 3.0]]},
                     {"rows": [1, 2], "body_s": [3.0, 4.0], "seconds": [[3.0, 5.0]]}, ("body_s", "seconds"))
    assert p == {"rows": [1, 2], "body_s": [2.0, 3.0], "seconds": [[2.0, 4.0]]}
    with pytest.raises(ValueError, match="same grid"):
        mean_profile({"body_s": [1.0]}, {"body_s": [1.0, 2.0]}, ("body_s",))


def test_overheads_are_never_negative_and_one_batch_gives_one_constant():
    from minipaged.bench.gpu.validate import _fit_overheads

    assert _fit_overheads([(1, 0.01), (8, 0.005)]) == (pytest.approx(0.0075), 0.0)  # falling: no per-seq cost
    a, b = _fit_overheads([(1, -0.01), (8, 0.02)])
    assert a == 0.0 and b > 0
    assert _fit_overheads([(4, 0.01), (4, 0.03)]) == (pytest.approx(0.02), 0.0)
    assert _fit_overheads([]) == (0.0, 0.0)


def test_the_validation_measures_the_engine_and_the_simulated_scheduler_takes_the_same_steps(tiny_model):
    """The measuring half on the tiny model (its times are not asserted): the steps recorded are
    the scheduler's, and minipaged's scheduler on the simulated clock schedules the same workload
    in the same number of steps as the engine did."""
    from minipaged.bench.gpu.validate import (compare, cost_model, machine_spec, measure_decode,
                                              measure_prefill, measure_workload, model_spec_of, simulate_workload,
                                              workload, engine_shape)
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    spec = model_spec_of(model)
    assert spec.shape_params() == sum(p.numel() for p in model.parameters() if p.dim() == 2)
    shape = engine_shape(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    eng = LLMEngine(model, tok, fast_paths=False, record_trace=False, **shape)
    d1, d4 = measure_decode(eng, 1, 6, 2), measure_decode(eng, 4, 6, 2)
    assert len(d4.step) == 4 and all(n == 1 for _, n in d4.step) and d4.seconds > 0
    pre = measure_prefill(eng, 24, repeats=1)
    assert pre.step == ((0, 24),)
    reqs = workload(10, (3, 40), (2, 9), seed=1)
    measured, samples = measure_workload(eng, reqs)
    assert sum(n for s in samples for _, n in s.step) == sum(p + o - 1 for p, o in reqs)  # every token computed once
    assert measured["steps"] == len(samples) and measured["output_tokens"] == sum(o for _, o in reqs)
    machine = machine_spec(5e9, 20e9)
    res = compare(machine, spec, [d1, d4], [pre], [d4], reqs, measured, samples, shape)
    w = res["workload"]
    assert w["same_steps_as_engine"], (w["simulated"]["steps"], measured["steps"])
    assert w["replayed"]["steps"] == measured["steps"] and w["simulated"]["tokens_per_s"] > 0
    sim = simulate_workload(cost_model(machine, spec, NO_OVERHEAD), reqs, shape)  # the steps do not depend on the clock
    assert sim["steps"] == measured["steps"] and sim["output_tokens"] == measured["output_tokens"]


def test_each_factorial_cell_simulated_completes_the_benchs_requests_in_the_engines_steps(tiny_model):
    """minipaged bench's factorial on the tiny model (plain route; no time is asserted) against its
    cells served by the simulator's policies: the same setup as the bench ran (checked), the same
    requests completed, and, the workload being deterministic (EOS ignored, lengths fixed), the
    same number of steps, the same largest batch and the same preemptions in every cell."""
    from minipaged.bench.gpu.validate import (FACTORIAL_CELLS, Sample, check_setup, compare, compare_factorial,
                                              cost_model, factorial_scheduler, format_report, machine_spec,
                                              measure_factorial, measured_cells, model_spec_of)
    from minipaged.bench.gpu.policies import ReservingScheduler

    model, _ = tiny_model
    kw = dict(quick=True, num_requests=12, static_batch=3, max_output=24, naive_requests=3, prompt_scale=0.3)
    setup, bench = measure_factorial(model, kw, roofline_batches=(1,))
    assert setup.num_blocks == bench["kv_budget"]["blocks"] and len(setup.naive_served) == 3
    measured = measured_cells(bench)
    assert tuple(measured) == FACTORIAL_CELLS
    assert isinstance(factorial_scheduler("static_contiguous", setup), ReservingScheduler)
    machine, spec = machine_spec(5e9, 20e9), model_spec_of(model)
    fac = compare_factorial(cost_model(machine, spec, Calibration(1.0, 1.0, 1e-3, 1e-4)), setup, measured)
    for cell, c in fac["cells"].items():
        assert c["same_requests_completed"], cell
        assert c["same_steps_as_engine"], (cell, c["measured"]["steps"], c["predicted"]["steps"])
        assert c["predicted"]["peak_batch"] == c["measured"]["peak_batch"], cell
        assert c["predicted"]["preemptions"] == c["measured"]["preemptions"], cell
        assert c["predicted"]["tokens_per_s"] > 0 and math.isfinite(c["error"])
    cells = fac["cells"]
    assert cells["naive"]["predicted"]["peak_batch"] == 1
    # the budget holds 3 contiguous reservations: both contiguous cells batch 3, paging batches more
    assert cells["static_contiguous"]["predicted"]["peak_batch"] == 3
    assert cells["continuous_contiguous"]["predicted"]["peak_batch"] == 3
    assert cells["continuous_paged"]["predicted"]["peak_batch"] > 3
    # a bench run on another workload is refused, not compared
    with pytest.raises(RuntimeError, match="another workload"):
        check_setup(setup, dict(bench, kv_budget=dict(bench["kv_budget"], blocks=setup.num_blocks + 1)))
    # the whole comparison carries the cells into the verdict and the report
    res = compare(machine, spec, [Sample(((10, 1),), 1e-3)], [], [], factorial=(setup, measured))
    assert set(res["factorial"]["cells"]) == set(FACTORIAL_CELLS)
    assert res["worst_validation_error"] == pytest.approx(res["factorial"]["worst_error"])
    assert "continuous_paged" in format_report(res) and "worst cell error" in format_report(res)


def test_the_validation_script_has_a_quick_mode_that_writes_only_where_told():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "validate_simgpu_cpu.py"
    spec = importlib.util.spec_from_file_location("validate_simgpu_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.DEFAULT_JSON.name == "simgpu_cpu_validation.json" and mod.DEFAULT_JSON.parent.name == "figures"
    assert set(mod.QUICK) == set(mod.FULL)
    assert not set(mod.FULL["calibration_batches"]) & set(mod.FULL["validation_batches"])  # predicted, not fitted
    assert not set(mod.QUICK["calibration_batches"]) & set(mod.QUICK["validation_batches"])
    assert mod.FULL["factorial"] == {"quick": True}  # the bench's own --quick sizes, nothing else changed
    with pytest.raises(SystemExit):
        mod.main(["--help"])


def test_the_profiles_time_the_route_s_own_operators_on_a_tiny_model(tiny_model):
    from minipaged.attention import TORCH
    from minipaged.bench.hardware import attention_profile, attention_timer, linear_profile, split_head

    model, _ = tiny_model
    cfg = model.config
    body, head = split_head(model)
    assert len(head) == 1 and head[0].shape[0] == cfg.vocab_size and body and all(w.shape[0] != cfg.vocab_size for w in body)
    lp = linear_profile(model, rows=(1, 4), repeats=1)
    assert lp["rows"] == [1, 4] and len(lp["body_s"]) == 2 and all(t > 0 for t in lp["body_s"] + lp["head_s"])
    ap = attention_profile(TORCH, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16,
                           batches=(1, 2), contexts=(16, 40), repeats=1)
    assert ap["backend"] == "torch" and len(ap["seconds"]) == 2 and all(len(r) == 2 and min(r) > 0 for r in ap["seconds"])
    timer = attention_timer(TORCH, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, repeats=1,
                            num_blocks=64)
    t = timer(((0, 30), (8, 5)))
    assert t > 0 and timer(((0, 30), (8, 5))) == t and len(timer.timed) == 1  # each shape timed once
    with pytest.raises(ValueError, match="raise num_blocks"):
        timer(((0, 2000),))


def test_each_dataset_has_its_own_readme_block_and_alpaca_says_fig_13b_and_its_limit(tmp_path):
    from minipaged.bench.gpu.paper import LIMITS, readme_marker, update_readme

    res = {"systems": {"vllm": {"label": "vLLM", "max_rate": 2.0, "mean_batched_requests": 30.0, "curve": []}},
           "settings": {"gpu": "a100-40gb", "model": "opt-13b", "dataset": "alpaca", "fig13_rate": 30.0,
                        "latency_threshold": 0.2, "requests_per_point": 10, "curve_fractions_of_knee": [1],
                        "wall_seconds": 1.0, "known_limits": LIMITS["alpaca"]}}
    block = readme_block(res)
    assert "paper (Fig. 13b)" in block and LIMITS["alpaca"] in block and "docs/figures/paper_alpaca.png" in block
    assert readme_marker("sharegpt") == "paper" and readme_marker("alpaca") == "paper_alpaca"
    readme = tmp_path / "README.md"
    readme.write_text("<!-- paper:begin -->\nshare\n<!-- paper:end -->\n<!-- paper_alpaca:begin -->\nold\n<!-- paper_alpaca:end -->\n")
    assert update_readme(res, readme)
    text = readme.read_text()
    assert "\nshare\n" in text and "old" not in text and "paper (Fig. 13b)" in text   # ShareGPT's block untouched


def test_the_readme_alpaca_block_is_the_stored_run():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    res = json.loads((root / "docs" / "figures" / "paper_alpaca.json").read_text(encoding="utf-8"))
    readme = (root / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- paper_alpaca:begin -->", 1)[1].split("<!-- paper_alpaca:end -->", 1)[0]
    assert block.strip() == readme_block(res).strip(), (
        "README's Alpaca block is not docs/figures/paper_alpaca.json: rerun the command above the block")


def test_a_curve_that_never_crosses_goes_on_at_higher_rates_until_it_does(monkeypatch):
    """max_rate is read where the curve crosses the threshold; a knee search that placed the rates too
    low (Alpaca) would leave only a lower bound, so the curve goes on. A stand-in simulator whose
    latency is rate / 100 s/token crosses 0.2 at 20 req/s; the knee search says 10."""
    from types import SimpleNamespace

    from minipaged.bench.gpu import paper

    def fake(setting, system, rate, n, seed):
        return SimpleNamespace(rate=rate, normalized_latency=rate / 100, mean_batched_requests=1.0, throughput_tokens=1.0,
                               num_preemptions=0, num_requests=n, finish_times=[])
    monkeypatch.setattr(paper, "_simulate", fake)
    monkeypatch.setattr(paper, "find_knee", lambda setting, system, threshold: 10.0)
    res = paper.reproduce(systems=["vllm"], num_requests=18, workers=1, progress=False)
    v = res["systems"]["vllm"]
    assert max(c["rate"] for c in v["curve"]) > 20 and v["curve_crosses_threshold"]
    assert v["max_rate"] == pytest.approx(20, rel=0.05)
    assert res["settings"]["curve_points_added"] == {"vllm": len(paper.EXTEND_FACTORS)}
    assert "| >= " not in readme_block(res) and "went on at higher rates" in readme_block(res)
