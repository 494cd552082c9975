"""``sim calibrate-spec``'s pure parts: the design, the tracker of what a speculating step
attends, the non-negative fit and the analysis recover known costs.

Nothing is faked but vLLM's per-step records, which are built by hand or by a small model of
the design's phases below (each step's time from known costs); no timing is measured.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from rich.console import Console
from rollserve.sim.calibrate import Iteration
from rollserve.sim.calibrate_spec import (
    SPEC_BATCHES,
    SpecFit,
    SpecStep,
    analyse,
    cli_main,
    fit_spec_costs,
    nnls,
    pays_up_to,
    spec_design,
    track_spec_steps,
)
from rollserve.sim.profile import SpecDecoding

TRUE = SpecFit(
    step_base_s=2.0e-3,
    per_decode_seq_s=60e-6,
    per_kv_token_s=270e-9,
    pass_s=1.4e-3,
    draft_s=25e-6,
    token_s=35e-6,
    plain_r2=1.0,
    spec_r2=1.0,
    clamped=(),
)
PROMPT = 16


def phase_iterations(
    batch: int,
    shared: int,
    *,
    spec: bool,
    tokens: int = 40,
    k: int = 4,
    costs: SpecFit = TRUE,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> list[Iteration]:
    """A design phase as vLLM would report it: one prefill step, then decode steps. On the
    speculating engine the ``shared`` requests draft ``k`` tokens a step, all accepted; the
    others draft nothing."""
    rng = rng or random.Random(0)
    out = [Iteration(batch, batch * PROMPT, 0, None, None, batch, 0, 0, 0)]
    generated = [1] * batch
    while True:
        running = [i for i in range(batch) if generated[i] < tokens]
        if not running:
            return out
        context = sum(PROMPT + generated[i] for i in running)
        drafts = new = finished = finished_context = 0
        for i in running:
            drafted = k if spec and i < shared else 0
            step = min(1 + drafted, tokens - generated[i])
            drafts += drafted
            generated[i] += step
            new += step
            if generated[i] >= tokens:
                finished += 1
                finished_context += PROMPT + generated[i]
        s = SpecStep("spec" if spec else "plain", "", len(running), context, drafts, new, 0.0)
        duration = (costs.fitted(s) if spec else costs.plain(s)) * (1 + noise * rng.gauss(0, 1))
        out.append(
            Iteration(
                0, 0, len(running), duration, duration, new, finished, finished_context, drafts
            )
        )


def test_the_tracker_follows_contexts_through_speculating_steps_by_hand() -> None:
    # Two requests of 4 prompt tokens prefilled together; A drafts and advances 3 tokens a
    # step, B one; A ends after its second decode step (7 tokens), B goes on alone.
    iterations = [
        Iteration(2, 8, 0, None, None, 2, 0, 0, 0),  # prefill: each samples its first token
        Iteration(0, 0, 2, 0.010, 0.010, 4, 0, 0, 2),  # A 4+1 -> 4+4, B 4+1 -> 4+2
        Iteration(0, 0, 2, 0.012, 0.012, 4, 1, 11, 2),  # A 4+4 -> 4+7 ends, B 4+2 -> 4+3
        Iteration(0, 0, 1, 0.008, 0.008, 1, 0, 0, 0),  # B 4+3 -> 4+4
    ]
    track = track_spec_steps(iterations, engine="spec", phase="x")
    assert track.no_decode == 1 and track.untracked == 0
    got = [(s.decode_seqs, s.attended_kv_tokens, s.draft_tokens, s.generated) for s in track.steps]
    assert got == [(2, 10, 2, 4), (2, 14, 2, 4), (1, 7, 0, 1)]


def test_the_tracker_drops_every_step_from_the_first_it_cannot_explain() -> None:
    iterations = [
        Iteration(2, 8, 0, None, None, 2, 0, 0, 0),
        Iteration(0, 0, 2, 0.010, 0.010, 2, 0, 0, 0),
        Iteration(0, 0, 1, 0.010, 0.010, 1, 0, 0, 0),  # one request fewer than it ran
        Iteration(0, 0, 1, 0.010, 0.010, 1, 0, 0, 0),
    ]
    track = track_spec_steps(iterations, engine="plain", phase="x")
    assert len(track.steps) == 1 and track.untracked == 2


def test_records_written_before_the_extra_counts_still_read() -> None:
    old = Iteration.from_json([1, 16, 2, 0.01, 0.02])
    assert (old.generated, old.finished, old.finished_context, old.draft_tokens) == (0, 0, 0, 0)
    new = Iteration(1, 16, 2, 0.01, 0.02, 7, 1, 300, 8)
    assert Iteration.from_json(new.to_json()) == new


def test_nnls_holds_a_coefficient_at_zero_rather_than_negative() -> None:
    rows = [(1.0, float(x)) for x in range(10)]
    falling = [5.0 - 0.1 * x for x in range(10)]
    beta, held = nnls(rows, falling)
    assert held == [1] and beta[1] == 0 and beta[0] == pytest.approx(4.55)
    rising = [5.0 + 0.1 * x for x in range(10)]
    assert nnls(rows, rising)[0] == pytest.approx([5.0, 0.1])


def designed_steps(noise: float = 0.0) -> list[SpecStep]:
    rng = random.Random(1)
    out: list[SpecStep] = []
    for batch in SPEC_BATCHES:
        for shared in sorted({0, batch // 2, batch}):
            for spec in (False, True):
                iterations = phase_iterations(batch, shared, spec=spec, noise=noise, rng=rng)
                engine = "spec" if spec else "plain"
                out += track_spec_steps(iterations, engine=engine, phase="p").steps
    return out


def test_the_fit_recovers_known_speculative_costs() -> None:
    fit = fit_spec_costs(designed_steps())
    for name in ("step_base_s", "per_decode_seq_s", "per_kv_token_s", "pass_s", "draft_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fit.token_s == pytest.approx(TRUE.token_s, rel=1e-6)
    assert fit.plain_r2 == pytest.approx(1.0) and fit.spec_r2 == pytest.approx(1.0)
    noisy = fit_spec_costs(designed_steps(noise=0.05))
    assert noisy.pass_s == pytest.approx(TRUE.pass_s, rel=0.15)
    assert noisy.token_s == pytest.approx(TRUE.token_s, rel=0.15)


def test_the_fit_needs_steps_of_both_engines() -> None:
    plain_only = [s for s in designed_steps() if s.engine == "plain"]
    with pytest.raises(ValueError, match="0 speculating steps"):
        fit_spec_costs(plain_only)


def test_the_design_drafts_none_half_and_all_of_each_batch_after_an_untimed_answer() -> None:
    phases = spec_design(repeats=2)
    assert len({p.name for p in phases}) == len(phases)
    first = phases[: len(phases) // 2]
    assert [p.name for p in phases[len(phases) // 2 :]] == [
        p.name.replace("r0", "r1") for p in reversed(first)
    ]
    for phase in phases:
        assert phase.greedy and phase.carriers is None
        *history, timed = phase.waves
        assert timed.timed and timed.prompt_len < 32  # below a KV block: no prefix-cache hit
        if timed.shared:
            assert [(w.requests, w.shared, w.timed) for w in history] == [(1, 1, False)]
        else:
            assert history == []
    points = {(p.waves[-1].requests, p.waves[-1].shared) for p in first}
    assert points == {(b, s) for b in SPEC_BATCHES for s in {0, b // 2, b}}
    assert len(spec_design(repeats=1, quick=True)) < len(first)


def test_analysis_of_a_measurement_prints_the_flags_of_the_costs_it_recovers() -> None:
    console = Console(width=200, record=True)
    out = analyse(measurement(), console)
    text = console.export_text()
    assert "--spec-pass-s 0.0014 --spec-draft-s 2.5e-05 --spec-token-s 3.5e-05" in text
    rows = {row["point"]: row for row in out["points"]}
    assert set(rows) == {"B1-S0", "B1-S1", "B4-S0", "B4-S2", "B4-S4", "B16-S0", "B16-S8", "B16-S16"}
    # Drafted in full and all accepted, a lone sequence makes 5 tokens a pass.
    assert rows["B1-S1"]["spec_tokens_per_s"] > 2 * rows["B1-S1"]["plain_tokens_per_s"]
    assert rows["B1-S0"]["draft_tokens_a_step"] == 0
    assert rows["B4-S4"]["fitted_s"] == pytest.approx(rows["B4-S4"]["spec_step_s"])
    # And the batch up to which speculation pays at the workload's drafts (the defaults).
    assert out["pays_up_to"] == {
        "accept_len": 2.0,
        "drafted": 2.34,
        "k": 4,
        "batch": pays_up_to(out_fit(out), k=4, accept_len=2.0, drafted=2.34),
    }
    assert f"--spec-max-batch {out['pays_up_to']['batch']}" in text


def out_fit(out: dict[str, object]) -> SpecFit:
    fit = dict(out["fit"])  # type: ignore[call-overload]
    fit["clamped"] = tuple(fit["clamped"])
    return SpecFit(**fit)


def measurement(batches: tuple[int, ...] = (1, 4, 16)) -> dict[str, object]:
    """A calibrate-spec measurement of the design's phases at ``batches`` on TRUE's costs."""
    records: dict[str, dict[str, object]] = {}
    for batch in batches:
        for shared in sorted({0, batch // 2, batch}):
            records[f"r0-spec-B{batch}-S{shared}"] = {
                engine: {
                    "iterations": [
                        it.to_json()
                        for it in phase_iterations(batch, shared, spec=engine == "spec")
                    ]
                }
                for engine in ("plain", "spec")
            }
    return {"method": "rollout", "k": 4, "records": records}


def test_speculation_pays_in_small_batches_where_a_draft_token_costs_a_sequence() -> None:
    # The two CPUs of docs/calibration.md: native bfloat16 (a draft token 53 µs against 91 µs
    # a sequence) and AVX2 alone, which emulates it (391 against 400).
    native = SpecFit(2.81e-3, 90.9e-6, 330e-9, 0.78e-3, 32.1e-6, 53.4e-6, 1.0, 1.0, ())
    avx2 = SpecFit(4.187e-3, 400.2e-6, 284.7e-9, 1.203e-3, 0.0, 391.2e-6, 1.0, 1.0, ())
    assert pays_up_to(native, k=4, accept_len=2.0, drafted=2.34) == 30
    assert pays_up_to(avx2, k=4, accept_len=2.0, drafted=2.34) == 5
    # Better drafts pay in bigger batches; ngram's (1.34 tokens a pass) hardly anywhere.
    assert pays_up_to(avx2, k=4, accept_len=3.0, drafted=4.0) == 9
    assert pays_up_to(avx2, k=4, accept_len=1.34, drafted=2.0) == 0
    assert pays_up_to(native, k=4, accept_len=1.34, drafted=2.0) == 1
    # By hand at the avx2 break-even: 5 sequences gain, 6 lose.
    spec = SpecDecoding(draft_tokens=4, accept_len=2.0, drafted=2.34)
    on = avx2.profile(spec)
    off = on.with_spec(None)
    assert on.step_time(5, 0, 0) < off.step_time(5, 0, 0)
    assert on.step_time(6, 0, 0) > off.step_time(6, 0, 0)


def test_an_earlier_run_is_analysed_again_from_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"measurement": measurement()}))
    assert cli_main(["--from-json", str(path), "--accept", "3", "--drafted", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--spec-pass-s 0.0014 --spec-draft-s 2.5e-05 --spec-token-s 3.5e-05" in text
    # A pass saves 2 bases less the path (2 x 2.0 - 1.4 ms) and costs a sequence 25 + 4 x 35
    # against the 2 x 60 µs its 2 extra tokens save: 45 µs b < 2.6 ms, b up to 57.
    assert "at 3 tokens a drafted pass and 4 draft tokens" in text
    assert "pays in steps of up to 57 sequences: the engines' --spec-max-batch 57" in text
    # At 4 tokens a pass a sequence costs less speculating: every step.
    assert cli_main(["--from-json", str(path), "--accept", "4", "--drafted", "4"]) == 0
    assert "pays in every step: --spec-max-batch 0" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        ("{}", [], "not a file written by calibrate-spec --json"),
        ("not json", [], "not a file written by calibrate-spec --json"),
        (None, [], "not a file written by calibrate-spec --json"),
        ("measurement", ["--drafted", "5"], r"drafted \(5.0\) must be between 0 and draft_tokens"),
        ("measurement", ["--accept", "6"], r"accept_len \(6.0\) must be between 1 and"),
    ],
)
def test_a_bad_from_json_or_drafts_are_named(
    tmp_path: Path, content: str | None, argv: list[str], message: str
) -> None:
    path = tmp_path / "run.json"
    if content == "measurement":
        path.write_text(json.dumps({"measurement": measurement((1,))}))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        cli_main(["--from-json", str(path), *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--k", "0"], "argument --k: 0 must be at least 1"),
        (["--repeats", "-1"], "argument --repeats: -1 must be at least 1"),
        (["--method", "eagle"], "argument --method: invalid choice: 'eagle'"),
    ],
)
def test_the_command_names_a_bad_flag_before_starting_an_engine(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
