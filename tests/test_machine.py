"""minipaged.machine: the one model of this machine. Its arithmetic on a hand-built profile (knee,
ridge, monotone predictions, speculative decoding's break-even), the one prediction format, the
per-process cache, and planted errors (a profile twice too slow, a cost model without its
overheads) failing a prediction checked against a real engine's step on a tiny model."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from minipaged import machine
from minipaged.bench.gpu.cost import AttentionProfile, Calibration, FusedDecodeProfile, LinearProfile
from minipaged.bench.gpu.specs import ModelSpec

SPEC = ModelSpec("hand", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                 vocab_size=512, max_len=512, num_params=0, mlp="gated", tied_embeddings=False, source="a test",
                 dtype_bytes=4)


def hand_profile(body_per_row=1e-3, seq_overhead=1e-4, step_overhead=2e-3) -> machine.MachineProfile:
    """Linear in every term, so the knee can be worked by hand: body 10 ms + 1 ms a row, head 1 ms +
    0.1 ms a row, decode attention 0.1 ms a sequence at 32 keys (0.4 ms at 512), overheads 2 ms a
    step and 0.1 ms a sequence; 100 GFLOP/s over 10 GB/s."""
    linear = LinearProfile((1, 64), (0.010, 0.010 + 63 * body_per_row), (0.001, 0.001 + 63 * 1e-4))
    attention = AttentionProfile((1, 64), (32, 512), ((1e-4, 4e-4), (64e-4, 64 * 4e-4)))
    return machine.MachineProfile("hand-built", 10.0, 100.0, linear, attention,
                                  Calibration(1.0, 1.0, step_overhead, seq_overhead, 0.0), 0.0, SPEC)


# -- arithmetic on a hand-built profile ------------------------------------------------------------
def test_ridge_is_the_gemm_rate_over_the_read_bandwidth():
    assert machine.ridge(hand_profile()) == pytest.approx(10.0)


def test_the_knee_is_the_batch_one_floor_over_the_cost_of_one_more_sequence():
    p = hand_profile()
    floor = 0.010 + 0.001 + 1e-4 + 2e-3 + 1e-4                  # body, head, attention, step and sequence overheads
    per_seq = 1e-3 + 1e-4 + 1e-4 + 1e-4                         # the same, for one more sequence
    assert machine.predict_decode(p, 1, 32) == pytest.approx(floor, rel=1e-3)
    assert machine.knee(p) == pytest.approx(floor / per_seq, rel=1e-3)   # about 10 sequences
    # a cheaper row moves the knee out: the floor stays, the slope falls
    assert machine.knee(hand_profile(body_per_row=1e-4)) > 3 * machine.knee(p)


def test_predictions_grow_with_the_batch_the_context_and_the_new_tokens():
    p = hand_profile()
    by_batch = [machine.predict_decode(p, b, 64) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)
    by_ctx = [machine.predict_decode(p, 8, c) for c in (16, 32, 64, 128, 256, 512, 1024)]
    assert by_ctx == sorted(by_ctx) and len(set(by_ctx)) == len(by_ctx)
    p = replace(p, attention=replace(p.attention, prefill=None))    # prefills on the roofline, no timer
    by_new = [machine.predict_step(p, [(100, n)]) for n in (1, 2, 8, 32, 128)]
    assert by_new == sorted(by_new)
    # a verifying step runs the LM head on every new token's row
    assert machine.predict_step(p, [(100, 5)], logits_rows=5) == pytest.approx(
        machine.predict_step(p, [(100, 5)]) + p.linear.head(5) - p.linear.head(1))
    assert machine.roofline_step(p, [(31, 1)]) < machine.predict_step(p, [(31, 1)])  # no overheads, no profile


def test_break_even_acceptance_and_expected_speedup_on_hand_worked_numbers():
    # 1 + a + a^2 + a^3 + a^4 = 1.65 at a = 0.4 (1.6496): verifying 5 tokens for 1.65 steps pays above 40% acceptance
    assert machine.break_even_acceptance(1.65, 4) == pytest.approx(0.4, abs=2e-3)
    assert machine.expected_tokens(0.4, 4) == pytest.approx(1.6496)
    # acceptance 0.83: 3.565 tokens a verifying step, for 1.65 plain steps' time: 2.16x
    assert machine.expected_speedup(0.83, 4, 1.65) == pytest.approx(3.56527 / 1.65, rel=1e-4)
    a = machine.break_even_acceptance(2.5, 4)
    assert machine.expected_speedup(a, 4, 2.5) == pytest.approx(1.0, rel=1e-6)   # break-even is speed-up 1
    assert machine.break_even_acceptance(0.9, 4) == 0.0                           # cheaper than a plain step: always
    assert machine.break_even_acceptance(5.0, 4) == math.inf                      # k + 1 steps' price: never
    with pytest.raises(ValueError, match="verify_cost_ratio"):
        machine.expected_speedup(0.5, 4, 0.0)


def test_a_fused_route_prices_a_pure_decode_step_from_its_whole_step_timing():
    """On a route whose pure decode steps are one fused call (the C whole-step decode), such a step costs
    the fused table at its batch, its attention moved from the table's context to the step's own; a step
    with a prompt in it is still priced from its parts (the fused call never runs it)."""
    parts = hand_profile()
    fused = replace(parts, fused_decode=FusedDecodeProfile((1, 16, 64), (0.005, 0.020, 0.050), context=32))
    assert machine.predict_decode(fused, 1, 32) == pytest.approx(0.005)
    assert machine.predict_decode(fused, 8, 32) == pytest.approx(0.005 + 7 / 15 * 0.015)    # between 1 and 16
    longer = 8 * 1e-4 * (1 + 3 * (512 - 32) / 480) - 8 * 1e-4                                  # the attention at 512 keys, less at 32
    assert machine.predict_decode(fused, 8, 512) == pytest.approx(0.005 + 7 / 15 * 0.015 + longer)
    mixed = [(31, 1), (0, 40)]
    assert machine.predict_step(fused, mixed) == pytest.approx(machine.predict_step(parts, mixed))
    assert machine.predict_decode(parts, 8, 32) > machine.predict_decode(fused, 8, 32)        # the parts' price is another
    with pytest.raises(ValueError, match="one time per batch"):
        FusedDecodeProfile((1, 16), (0.005,), context=32)


# -- the one format ------------------------------------------------------------------------------
def test_check_prediction_prints_the_line_and_passes_within_tolerance(capsys):
    p = machine.check_prediction("decode step B=1", 58.0, 50.0, 0.25, unit="ms")
    assert capsys.readouterr().out == "prediction decode step B=1: predicted 58.0 ms, measured 50.0 ms (16.0% off, tolerance 25%)\n"
    assert p.ok and p.off == pytest.approx(0.16) and p.explained is None and (p.predicted, p.measured) == (58.0, 50.0)


def test_check_prediction_fails_beyond_tolerance_unless_the_miss_is_explained(capsys):
    with pytest.raises(AssertionError, match=r"prediction knee: predicted 4.00, measured 36.0 \(88.9% off, tolerance 25%\)"):
        machine.check_prediction("knee", 4, 36, 0.25)
    capsys.readouterr()
    p = machine.check_prediction("knee", 4, 36, 0.25, explained="the matvec floor of the 1-row matmuls")
    out = capsys.readouterr().out.splitlines()
    assert out == ["prediction knee: predicted 4.00, measured 36.0 (88.9% off, tolerance 25%)",
                   "explained miss: the matvec floor of the 1-row matmuls"]
    assert not p.ok and p.explained.startswith("the matvec")
    with pytest.raises(AssertionError):  # an empty cause is no explanation
        machine.check_prediction("knee", 4, 36, 0.25, explained="")
    with pytest.raises(ValueError, match="fraction"):
        machine.check_prediction("knee", 4, 36, 25)


def test_check_prediction_within_a_factor_is_symmetric_and_says_so(capsys):
    """A knee (a floor over a difference of two steps) is checked within a factor: 1.5 passes 24 and 54
    against 36, fails 23 and 55, and the line names the factor in the one format."""
    for pred in (24.0, 54.0):
        assert machine.check_prediction("knee", pred, 36, factor=1.5).ok
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prediction knee: predicted 24.0, measured 36.0 (33.3% off, tolerance a factor of 1.5)"
    for pred in (23.0, 55.0):
        with pytest.raises(AssertionError, match="tolerance a factor of 1.5"):
            machine.check_prediction("knee", pred, 36, factor=1.5)
    with pytest.raises(ValueError, match="one of tolerance"):
        machine.check_prediction("knee", 30, 36, 0.25, factor=1.5)
    with pytest.raises(ValueError, match="between 1 and 2"):
        machine.check_prediction("knee", 30, 36, factor=3)


# -- measured on a tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    from minipaged.engine import LLMEngine

    model, tok = tiny_model
    return LLMEngine(model, tok, fast_paths=False, enable_prefix_caching=False, num_blocks=64, max_num_seqs=16,
                     max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def tiny_profile(tiny_engine):
    tiny_engine.model.__dict__.pop("_machine_profiles", None)
    return machine.profile(tiny_engine)


@pytest.mark.slow  # measures a profile: several seconds on 2 shared cores
def test_the_profile_is_measured_once_per_process_and_says_so(tiny_engine, tiny_profile, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(machine, "_measure", lambda *a: calls.append(a) or tiny_profile)
    assert machine.profile(tiny_engine) is tiny_profile
    assert capsys.readouterr().out.startswith("machine profile: cached (measured ")
    from minipaged.engine import LLMEngine

    other = LLMEngine(tiny_engine.model, None, fast_paths=False, enable_prefix_caching=False, num_blocks=16)
    assert machine.profile(other) is tiny_profile and not calls        # same model, same route: the same profile
    p = tiny_profile
    assert p.route == "torch (F.linear) + torch attention" and p.measure_seconds > 0
    assert p.ridge == pytest.approx(p.gemm_gflops / p.read_GBps) and p.read_GBps > 0
    assert p.model_spec.num_layers == tiny_engine.model.config.num_layers and p.model_spec.dtype_bytes == 4
    assert min(p.linear.body_s) > 0 and min(min(r) for r in p.attention.seconds) > 0
    c = p.calibration
    assert min(c.step_overhead_s, c.seq_overhead_s, c.token_overhead_s) >= 0 and c.step_overhead_s + c.seq_overhead_s > 0


def _measured_decode(engine, batch):
    from minipaged.bench.gpu.validate import measure_decode

    # the fastest of three medians: another program on a shared CPU only ever adds time to a step
    return min((measure_decode(engine, batch, 20, 5, seed=batch + k) for k in range(3)), key=lambda smp: smp.seconds)


@pytest.mark.slow
def test_planted_errors_fail_a_prediction_checked_against_the_engine(tiny_engine, tiny_profile):
    """The honest profile's prediction of a measured decode step is compared with two plants: every
    time measured three times too slow (every measured term and every overhead), and a cost model
    that drops its overheads (on a tiny model most of a step). Each must be further off than the honest one and fail check_prediction at
    25% (how close the honest one lands is the machine's business: not asserted here)."""
    meas = _measured_decode(tiny_engine, 4)
    ctx = max(a + n for a, n in meas.step)
    honest = machine.predict_decode(tiny_profile, 4, ctx)
    p = tiny_profile
    slow = replace(p, linear=LinearProfile(p.linear.rows, [3 * x for x in p.linear.body_s], [3 * x for x in p.linear.head_s]),
                   attention=replace(p.attention, seconds=[[3 * x for x in r] for r in p.attention.seconds]),
                   calibration=replace(p.calibration, step_overhead_s=3 * p.calibration.step_overhead_s,
                                       seq_overhead_s=3 * p.calibration.seq_overhead_s,
                                       token_overhead_s=3 * p.calibration.token_overhead_s))
    no_overheads = replace(p, calibration=Calibration(1.0, 1.0, 0.0, 0.0, 0.0))
    off = lambda x: abs(x - meas.seconds) / meas.seconds  # noqa: E731
    for plant in (slow, no_overheads):
        planted = machine.predict_decode(plant, 4, ctx)
        assert off(planted) > off(honest), (planted, honest, meas.seconds)
        with pytest.raises(AssertionError, match="beyond tolerance"):
            machine.check_prediction("decode step B=4 (planted)", planted * 1e3, meas.seconds * 1e3, 0.25, unit="ms")


@pytest.mark.slow
def test_the_cost_model_replays_engine_steps_and_knee_is_finite(tiny_profile):
    cm = machine.cost_model(tiny_profile)
    assert cm.step_time([(19, 1)] * 4) == pytest.approx(machine.predict_decode(tiny_profile, 4, 20))
    assert 0 < machine.knee(tiny_profile) < math.inf


@pytest.mark.slow
def test_the_gguf_route_times_the_plans_own_linear_op():
    """On the GGUF route the profile times the plan's table (``plan.ops.linear``), not F.linear:
    the call the forward makes is the call that is timed."""
    from minipaged import LLM
    from minipaged.machine import _time_route_linears

    eng = LLM().llm_engine
    if not eng.plan.routes["linear"].startswith("gguf"):
        pytest.skip(f"the linear route here is {eng.plan.routes['linear']!r}, not the GGUF blocks")
    got = _time_route_linears(eng, (1, 4), 1)
    assert got["rows"] == [1, 4] and all(t > 0 for t in got["body_s"] + got["head_s"])


# -- robust under load -------------------------------------------------------------------------------
def test_the_knee_is_never_below_one_and_far_out_where_more_sequences_cost_almost_nothing():
    # a floor far above the cost of one more sequence is a large knee; a slope far above the floor is 1, never less
    steep = hand_profile(body_per_row=1.0)                       # one more row costs 1 s: compute-bound at once
    assert machine.knee(steep) == 1.0
    flat = replace(hand_profile(body_per_row=0.0, seq_overhead=0.0),
                   linear=LinearProfile((1, 64), (0.010, 0.010), (0.001, 0.001)),
                   attention=AttentionProfile((1, 64), (32, 512), ((1e-4, 4e-4), (1e-4, 4e-4))))
    assert machine.knee(flat) > 1000 * machine.knee(hand_profile())  # only the new tokens' K/V writes grow


def test_a_noisy_last_segment_never_extrapolates_to_negative_times():
    # the last two rows measured in the wrong order (a busy moment at 32 rows): past the grid it stays flat
    p = LinearProfile((1, 32, 64), (0.010, 0.040, 0.020), (0.001, 0.002, 0.003))
    assert p.body(64) == pytest.approx(0.020) and p.body(10_000) == pytest.approx(0.020)
    assert p.head(10_000) > p.head(64) > 0                     # a growing segment still grows
    noisy = replace(hand_profile(), linear=p)
    assert all(machine.predict_decode(noisy, b, 32) > 0 for b in (1, 64, 128, 1024))
    assert machine.knee(noisy, batches=(1, 256, 1024)) >= 1.0


def test_overhead_share_flags_overheads_that_stand_for_a_busy_machine():
    from minipaged.bench.gpu.validate import Sample
    dec = [Sample(((31, 1),), 0.012), Sample(tuple((31, 1) for _ in range(16)), 0.030)]
    assert machine.overhead_share(Calibration(1.0, 1.0, 0.0, 0.0, 0.0), dec) == 0.0
    small = machine.overhead_share(Calibration(1.0, 1.0, 1e-3, 1e-4, 0.0), dec)
    assert small == pytest.approx(1.1e-3 / 0.012) and small < machine.MAX_OVERHEAD_SHARE
    busy = machine.overhead_share(Calibration(1.0, 1.0, 0.010, 1e-3, 0.0), dec)   # 11 ms of a 12 ms step
    assert busy > machine.MAX_OVERHEAD_SHARE


@pytest.mark.slow  # measures a profile (twice) on a tiny model
def test_a_fit_on_busy_steps_is_measured_again_and_the_smaller_overheads_kept(monkeypatch, tiny_engine, capsys):
    from minipaged.bench.gpu import validate as v
    fits = iter([Calibration(1.0, 1.0, 1.0, 0.0, 0.0), Calibration(1.0, 1.0, 0.0, 0.0, 0.0)])  # busy, then quiet
    monkeypatch.setattr(v, "fit_calibration", lambda *a, **k: next(fits))
    prof = machine._measure(tiny_engine, quick=True)
    assert prof.calibration.step_overhead_s == 0.0
    assert "measuring the steps again" in capsys.readouterr().out


# -- the lessons' helpers: lower envelope, a run of steps, the step check ------------------------------
def test_the_lower_envelope_keeps_small_row_times_no_higher_than_larger_ones():
    # a busy moment at 2 rows (9 ms) cannot make 2 rows cost more than 4 rows did (5 ms)
    assert machine.lower_envelope([4e-3, 9e-3, 5e-3, 8e-3]) == [4e-3, 5e-3, 5e-3, 8e-3]
    assert machine.lower_envelope([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]          # a monotone profile is left alone
    assert machine.lower_envelope([]) == []


def test_predict_run_prices_each_step_and_gives_verifying_tokens_their_logits():
    p = hand_profile()
    steps = [[(0, 20)], [(20, 1)], [(21, 5)]]       # a prompt, a decode step, a verifying step of 4 drafts
    plain = sum(machine.predict_step(p, s) for s in steps)
    assert machine.predict_run(p, steps) == pytest.approx(plain)           # no speculation: one logits row a sequence
    spec = machine.predict_run(p, steps, spec_k=4)
    extra = p.linear.head(5) - p.linear.head(1)                             # the verifying step's 4 more head rows
    assert spec == pytest.approx(plain + extra) and extra > 0
    assert machine.predict_run(p, [[(0, 5)]], spec_k=4) == pytest.approx(machine.predict_step(p, [(0, 5)]))  # a prompt
    assert machine.predict_run(p, []) == 0.0


def test_check_decode_step_refuses_a_meaningless_step_before_measuring(tiny_engine):
    for batch, ctx in ((0, 64), (4, 1)):
        with pytest.raises(ValueError, match="batch >= 1 and context >= 2"):
            machine.check_decode_step(tiny_engine, "bad", batch, ctx)


def test_check_decode_step_measures_again_once_and_then_fails_a_miss_that_stays(tiny_engine, monkeypatch, capsys):
    """The retry is the lessons' rule: one fresh profile and one more measurement, said aloud; a
    prediction that still misses fails. Measuring and profiling are stubbed: what is checked is the
    control flow and the printed line."""
    from minipaged.bench.gpu import validate as v

    p = hand_profile()
    asked = []
    monkeypatch.setattr(machine, "profile", lambda eng, quick=True, fresh=False: asked.append(fresh) or p)
    step = tuple([(63, 1)] * 4)
    truth = machine.predict_step(p, step)
    times = iter([10 * truth, truth * 1.05])                                   # a busy first try, then a quiet one
    monkeypatch.setattr(v, "measure_decode", lambda eng, batch, prompt_len, steps: v.Sample(step, next(times)))
    prof, pred = machine.check_decode_step(tiny_engine, "decode step B=4", 4, 64)
    out = capsys.readouterr().out
    assert "try 1: predicted" in out and "prediction decode step B=4: predicted" in out and pred.ok
    assert asked == [False, True] and prof is p                               # the second profile is a fresh one
    times = iter([10 * truth] * machine.TRIES)                                 # a miss that stays
    with pytest.raises(AssertionError, match="beyond tolerance"):
        machine.check_decode_step(tiny_engine, "decode step B=4", 4, 64)


def test_record_steps_keeps_every_scheduled_step_whoever_drives_the_engine(tiny_engine):
    from minipaged.bench.gpu.validate import record_steps
    from minipaged.sampling import SamplingParams

    with record_steps(tiny_engine) as rec:
        tiny_engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while tiny_engine.has_unfinished_requests():
            tiny_engine.step()                                                  # not rec.step(): untimed, still kept
    assert rec.steps[0] == ((0, 20),) and rec.steps[1:] == [((20, 1),), ((21, 1),)] and rec.samples == []


def test_ceilings_keep_each_ceilings_best_reading_for_a_sitting(tmp_path, monkeypatch):
    """One roofline a sitting: lessons in separate processes merge their readings into the best of
    each ceiling (a busy moment only lowers one), a stale or foreign file starts a new sitting, and
    cache_s None keeps nothing."""
    import json

    from minipaged.bench import hardware

    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path))
    reads = iter([25.0, 10.0, 30.0, 12.0, 9.0, 11.0, 13.0, 14.0])          # GB/s of successive readings
    monkeypatch.setattr(hardware, "bandwidth", lambda mib, repeats: {"read_GBps": next(reads), "copy_GBps": 20.0})
    monkeypatch.setattr(hardware, "gemm_gflops", lambda repeats: 400.0)
    first = hardware.ceilings(cache_s=3600)
    busy = hardware.ceilings(cache_s=3600)                              # 10 GB/s read at a busy moment
    assert (first["read_GBps"], first["kept"], busy["read_GBps"], busy["kept"]) == (25.0, 0, 25.0, 1)
    assert busy["ridge_flops_per_byte"] == first["ridge_flops_per_byte"] == 400.0 / 25.0
    assert hardware.ceilings(cache_s=3600)["read_GBps"] == 30.0          # a better reading raises it for the next
    alone = hardware.ceilings()                                         # None: this reading alone, nothing kept
    assert (alone["read_GBps"], alone["kept"]) == (12.0, 0)
    path, _ = hardware._ceilings_file(True)
    kept = json.loads(path.read_text())
    assert kept["ceilings"]["read_GBps"] == 30.0 and kept["readings"] == 3
    path.write_text(json.dumps({**kept, "measured_at": kept["measured_at"] - 7200}))      # began two hours ago,
    assert hardware.ceilings(cache_s=3600)["read_GBps"] == 30.0          # read a moment ago: the same sitting
    kept = json.loads(path.read_text())
    path.write_text(json.dumps({**kept, "last_at": kept["last_at"] - 7200}))              # its newest reading two hours old
    assert hardware.ceilings(cache_s=3600)["read_GBps"] == 11.0          # a new sitting
    path.write_text(json.dumps({**json.loads(path.read_text()), "signature": "another machine"}))
    assert hardware.ceilings(cache_s=3600)["read_GBps"] == 13.0
    path.write_text("not json")
    assert hardware.ceilings(cache_s=3600)["read_GBps"] == 14.0


@pytest.mark.slow
def test_the_default_route_here_is_profiled_whole_where_it_fuses_its_decode_step(smollm2):
    """On a CPU whose plan runs the C whole-step decode, the profile times those steps whole at the
    calibration's batches and the fused grid's, one context, and prices a pure decode step from them;
    elsewhere it has no fused table."""
    from minipaged.engine import LLMEngine

    model, tok = smollm2
    eng = LLMEngine(model, tok, num_blocks=64)
    prof = machine.profile(eng, fresh=True)
    if not machine.fuses_decode(eng):
        assert prof.fused_decode is None
        pytest.skip(f"this CPU's plan runs no fused decode step: {eng.plan.routes['whole_step_decode']}")
    fd = prof.fused_decode
    assert set(fd.batches) == set(machine.QUICK["decode_batches"]) | set(machine.QUICK["fused_batches"])
    assert fd.context == machine.QUICK["decode_context"] and list(fd.seconds) == sorted(fd.seconds) and fd.seconds[0] > 0
    assert machine.predict_decode(prof, 4, fd.context) == pytest.approx(fd.at(4))


def test_check_measured_retries_a_miss_once_fresh_and_a_miss_that_stays_fails(capsys):
    """check_measured is the lessons' one retry rule: ``once(False)``; on a miss ``once(True)`` (a
    fresh profile and a new measurement), said aloud; a second miss fails or is printed as explained.
    A first reading within tolerance is never measured again."""
    calls = []

    def readings(*pairs):
        it = iter(pairs)
        return lambda fresh: calls.append(fresh) or next(it)

    p = machine.check_measured("step", readings((10.0, 10.5)), 0.25, unit="ms")
    assert p.ok and calls == [False] and "try 1" not in capsys.readouterr().out
    calls.clear()
    p = machine.check_measured("step", readings((10.0, 30.0), (10.0, 11.0)), 0.25, unit="ms")
    out = capsys.readouterr().out
    assert p.ok and calls == [False, True] and "try 1: predicted 10.0 ms, measured 30.0 ms" in out
    assert p.measured == 11.0                                           # the second reading is the one checked
    calls.clear()
    with pytest.raises(AssertionError, match="beyond tolerance"):
        machine.check_measured("step", readings((10.0, 30.0), (10.0, 31.0), (10.0, 29.0)), 0.25, unit="ms")
    assert calls == [False, True, True]                                 # three readings (TRIES), then it fails
    calls.clear()
    with pytest.raises(AssertionError, match="beyond tolerance"):
        machine.check_measured("step", readings((10.0, 30.0), (10.0, 31.0)), 0.25, unit="ms", tries=2)
    assert calls == [False, True]
    p = machine.check_measured("knee", readings((4.0, 9.0), (4.0, 8.0), (4.0, 8.5)), factor=1.5, explained="the padded gather")
    assert not p.ok and p.explained == "the padded gather"              # an explained miss passes, printed as one
    calls.clear()
    assert machine.check_measured("knee", readings((4.0, 5.5)), factor=1.5).ok and calls == [False]


def test_check_measured_reads_a_callable_cause_from_the_reading_that_stands(capsys):
    """``explained`` as a function: asked only after the last reading, and only on a miss; what it
    returns for that reading is the cause, and None (no cause in that measurement) fails the cell."""
    state = {"reading": 0}

    def once(fresh):
        state["reading"] += 1
        return 10.0, (30.0 if state["reading"] < 3 else 31.0)

    asked = []

    def cause():
        asked.append(state["reading"])
        return f"reading {state['reading']}'s queue" if state["reading"] == 3 else None

    p = machine.check_measured("ttft", once, 0.3, explained=cause)
    assert asked == [3] and not p.ok and p.explained == "reading 3's queue"
    assert "explained miss: reading 3's queue" in capsys.readouterr().out
    state["reading"], asked[:] = 0, []
    with pytest.raises(AssertionError, match="beyond tolerance"):
        machine.check_measured("ttft", once, 0.3, explained=lambda: asked.append(1) or None)
    assert asked == [1]
    asked.clear()
    assert machine.check_measured("ttft", lambda fresh: (10.0, 11.0), 0.3, explained=lambda: asked.append(1)).ok
    assert asked == []                                                  # a hit never asks for a cause
