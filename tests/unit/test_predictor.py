"""Tests of the response-length predictor and its accuracy metrics.

Pure and fast: the predictor is synchronous code with no I/O, so nothing is faked;
synthetic workloads come from ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random

import pytest
from rollserve.scheduler.core.predictor import (
    LengthPredictor,
    PredictorSettings,
    mean_absolute_error,
    tail_auc,
)


def _feed(p: LengthPredictor, key: str, length: int, epochs: range, n: int = 8) -> None:
    for epoch in epochs:
        for _ in range(n):
            p.observe(key, length, epoch=epoch)


# -- history -------------------------------------------------------------------------


def test_nothing_observed_predicts_default_len() -> None:
    pred = LengthPredictor(PredictorSettings(default_len=700)).predict("q")
    assert pred.source == "prior"
    assert pred.confidence == 0.0
    assert pred.mean == pytest.approx(700, rel=1e-9)
    assert pred.p90 > pred.mean


def test_history_converges_to_a_prompts_length() -> None:
    p = LengthPredictor()
    _feed(p, "q", 300, range(3))
    pred = p.predict("q")
    assert pred.source == "history"
    assert pred.mean == pytest.approx(300, rel=1e-3)
    assert pred.confidence > 0.9

    rng = random.Random(1)
    noisy = LengthPredictor()
    for epoch in range(6):
        for _ in range(16):
            noisy.observe("q", round(math.exp(rng.gauss(math.log(300), 0.3))), epoch=epoch)
    expected = 300 * math.exp(0.3**2 / 2)  # lognormal mean of median 300, log-sd 0.3
    assert noisy.predict("q").mean == pytest.approx(expected, rel=0.1)


def test_history_follows_drift_at_the_half_life() -> None:
    fast = LengthPredictor(PredictorSettings(half_life_epochs=1.0))
    slow = LengthPredictor(PredictorSettings(half_life_epochs=1000.0))
    for p in (fast, slow):
        _feed(p, "q", 100, range(5))
        _feed(p, "q", 1000, range(5, 10))
    assert fast.predict("q").mean == pytest.approx(1000, rel=0.15)
    assert slow.predict("q").mean < 700  # remembers the old regime at full weight
    # One epoch after the switch, with half-life 1, the new epoch outweighs all five old ones.
    one = LengthPredictor(PredictorSettings(half_life_epochs=1.0))
    _feed(one, "q", 100, range(5))
    _feed(one, "q", 1000, range(5, 6))
    assert math.log(one.predict("q").mean) > (math.log(100) + math.log(1000)) / 2


def test_history_weight_decays_against_the_clock() -> None:
    p = LengthPredictor()
    _feed(p, "q", 300, range(1))
    fresh = p.predict("q").confidence
    p.advance_epoch(10)
    stale = p.predict("q")
    assert stale.confidence < fresh
    assert stale.source == "history"


def test_late_observation_of_an_old_epoch_weighs_less() -> None:
    p = LengthPredictor(PredictorSettings(half_life_epochs=1.0))
    p.observe("q", 1000, epoch=5)
    p.observe("q", 10, epoch=0)  # five half-lives old: weight 1/32
    assert p.predict("q").mean > 500
    with pytest.raises(ValueError, match="length"):
        p.observe("q", -1)


def test_an_observation_aged_to_nothing_counts_for_nothing() -> None:
    """Past about 1,100 half-lives a weight is 0.0 in floating point: a sample of such an old
    epoch (or one from before a far later epoch moved the clock) changes no estimate."""
    p = LengthPredictor(PredictorSettings(half_life_epochs=1.0))
    p.observe("q", 1000, epoch=5000, prompt_len=10)
    before = p.predict("fresh-key", prompt_len=10)
    p.observe("other", 10, epoch=0, prompt_len=10)  # first of its prompt-length bucket
    p.observe("q", 10, epoch=0, prompt_len=300)  # first of its bucket too
    assert p.predict("fresh-key", prompt_len=10).mean == pytest.approx(before.mean)
    assert p.predict("q").mean > 500


# -- prior ---------------------------------------------------------------------------


def test_unseen_prompt_gets_the_global_prior() -> None:
    p = LengthPredictor()
    for i, length in enumerate((100, 200, 400, 800)):
        _feed(p, f"k{i}", length, range(1), n=4)
    pred = p.predict("unseen")
    assert pred.source == "prior"
    assert pred.confidence == 0.0
    # log-mean of the four lengths, a geometric mean of ≈ 283; the mean sits above it.
    assert 283 < pred.mean < 800
    assert pred.p90 > pred.mean


def test_prior_adjusts_by_prompt_length_bucket() -> None:
    p = LengthPredictor()
    for i in range(40):
        p.observe(f"short{i}", 50, prompt_len=10)
        p.observe(f"long{i}", 2000, prompt_len=1000)
    # 12 shares the bucket of 10 (bit_length 4), 900 that of 1000 (bit_length 10).
    short, long, unknown = p.predict("x", 12), p.predict("x", 900), p.predict("x")
    assert short.mean < unknown.mean < long.mean
    assert short.mean < 150
    assert long.mean > 1000


# -- siblings ------------------------------------------------------------------------


def test_finished_siblings_dominate_history() -> None:
    p = LengthPredictor()
    _feed(p, "q", 100, range(1))
    pred = p.predict("q", finished_siblings=[1000, 1000, 1000])
    assert pred.source == "siblings"
    # three siblings weigh three epochs against one epoch of history
    assert math.log(pred.mean) > math.log(100) + 0.7 * (math.log(1000) - math.log(100))
    assert pred.confidence > p.predict("q").confidence
    # Siblings that agree with history keep the spread tight; ones that disagree widen p90.
    agree = p.predict("q", finished_siblings=[100, 100, 100])
    assert pred.p90 / pred.mean > 1.5 > agree.p90 / agree.mean


def test_siblings_alone_beat_the_prior_and_can_be_switched_off() -> None:
    p = LengthPredictor()
    pred = p.predict("q", finished_siblings=[3000, 3200])
    assert pred.source == "siblings"
    assert pred.mean > 2000
    off = LengthPredictor(PredictorSettings(sibling_weight=0.0))
    assert off.predict("q", finished_siblings=[3000, 3200]).source == "prior"


def test_running_sibling_progress_raises_the_prediction() -> None:
    rng = random.Random(3)
    p = LengthPredictor()
    for epoch in range(2):
        for _ in range(8):
            p.observe("q", round(math.exp(rng.gauss(math.log(200), 0.5))), epoch=epoch)
    base = p.predict("q")
    short = p.predict("q", running_siblings_progress=[10, 50])
    assert short.mean == pytest.approx(base.mean, rel=1e-3)  # far below: barely moves
    previous = base.mean
    for progress in (150, 300, 1000, 10**6):
        pred = p.predict("q", running_siblings_progress=[progress // 2, progress])
        assert pred.mean >= progress
        assert pred.p90 >= progress
        assert pred.mean > previous
        assert math.isfinite(pred.mean) and math.isfinite(pred.p90)
        previous = pred.mean
    assert p.predict("q", running_siblings_progress=[10**6]).mean < 1.2 * 10**6


def test_a_fit_conditioned_on_progress_is_the_prediction() -> None:
    # The scheduler fits a group once and conditions each running sample on its own
    # progress; that must be exactly what predict gives, from the prior to far in the tail.
    p = LengthPredictor()
    for epoch in range(2):
        for length in (120, 80, 300, 150):
            p.observe("q", length, epoch=epoch, prompt_len=40)
    for key, siblings in (("q", ()), ("q", (90, 400)), ("unseen", ()), ("unseen", (12,))):
        fit = p.fit(key, 40, siblings)
        for progress in (0, 1, 100, 2_000, 10**6):
            pred = p.predict(key, 40, siblings, (progress,) if progress else ())
            assert fit.mean_above(progress) == pred.mean
            assert (fit.source, fit.confidence) == (pred.source, pred.confidence)


# -- durability and bounds -----------------------------------------------------------


def test_serialization_round_trips_exactly() -> None:
    rng = random.Random(7)
    p = LengthPredictor()
    for epoch in range(4):
        for k in range(20):
            p.observe(
                f"k{k}", rng.randrange(1, 5000), epoch=epoch, prompt_len=rng.randrange(1, 2000)
            )
    p.observe("k3", 77, epoch=1)  # a late one

    q = LengthPredictor()
    q.load_globals(p.dump_globals())
    for key in p:
        q.load_key(key, p.dump_key(key))

    assert len(q) == len(p) == 20
    assert list(q) == list(p)
    assert q.dump_globals() == p.dump_globals()
    for key in [*p, "unseen"]:
        if key in p:
            assert q.dump_key(key) == p.dump_key(key)
        for args in ((), (300, [100, 900], [400])):
            assert q.predict(key, *args) == p.predict(key, *args)


def test_load_rejects_foreign_bytes() -> None:
    p = LengthPredictor()
    with pytest.raises(ValueError, match="version-1"):
        p.load_key("q", b"garbage")
    with pytest.raises(ValueError, match="version-1"):
        p.load_globals(b"\x01")
    with pytest.raises(KeyError):
        p.dump_key("untracked")


def test_lru_bound_evicts_least_recently_observed() -> None:
    p = LengthPredictor(PredictorSettings(max_keys=3))
    for key in ("a", "b", "c"):
        p.observe(key, 100)
    p.observe("a", 100)  # a is now the most recent
    p.predict("b")  # predicting does not count as use
    p.observe("d", 100)
    assert len(p) == 3
    assert "b" not in p
    assert list(p) == ["c", "a", "d"]
    assert p.predict("b").source == "prior"


def test_settings_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"half_life_epochs \(0"):
        PredictorSettings(half_life_epochs=0)
    with pytest.raises(ValueError, match=r"max_keys \(0\)"):
        PredictorSettings(max_keys=0)
    with pytest.raises(ValueError, match="sibling_weight"):
        PredictorSettings(sibling_weight=-1)
    with pytest.raises(ValueError, match=r"reuse_tolerance \(-0.1\)"):
        PredictorSettings(reuse_tolerance=-0.1)


# -- reuse -----------------------------------------------------------------------------


def test_a_prediction_kept_at_its_stamp_stays_near_a_new_one_while_the_prior_drifts() -> None:
    """A caller keeps each prediction until its prompt's stamp changes. With lengths that
    drift through the run (every prompt's doubling) over four epochs and prompt-length
    buckets, no kept prediction strays past 3% of a new one, and once the prior has seen
    some thousands of samples most predictions of unseen prompts are kept."""
    rng = random.Random(5)
    p = LengthPredictor()
    keys = [f"q{i}" for i in range(60)]
    plens = {key: rng.choice((0, 7, 60, 900)) for key in keys}
    centers = {key: rng.uniform(3.0, 7.0) for key in keys}
    kept: dict[str, tuple[tuple[int, int, int], float]] = {}
    reused = checked = 0
    for step in range(10_000):
        key = rng.choice(keys[:40])  # the last 20 are never observed: the prior's
        drift = math.log(2.0) * step / 10_000
        length = round(math.expm1(rng.gauss(centers[key] + drift, 0.6)))
        p.observe(key, length, epoch=step // 2500, prompt_len=plens[key])
        for query in rng.sample(keys, 4):
            stamp, mean = p.stamp(query, plens[query]), p.predict(query, plens[query]).mean
            known = kept.get(query)
            late_unseen = step >= 5000 and query in keys[40:]
            checked += late_unseen
            if known is not None and known[0] == stamp:
                reused += late_unseen
                assert abs(known[1] - mean) <= 0.03 * mean, (step, query)
            else:
                kept[query] = (stamp, mean)
    assert reused > 0.5 * checked


def test_the_stamp_changes_with_the_key_the_clock_and_a_load() -> None:
    p = LengthPredictor(PredictorSettings(max_keys=2))
    assert p.stamp("a")[2] == -1
    p.observe("a", 100)
    first = p.stamp("a")
    assert first[2] >= 0
    p.observe("a", 100)
    assert p.stamp("a")[2] != first[2]  # the key itself
    generation = p.stamp("a")[0]
    p.advance_epoch(3)
    assert p.stamp("a")[0] != generation  # histories weigh by age against the clock
    generation = p.stamp("a")[0]
    p.load_globals(p.dump_globals())
    assert p.stamp("a")[0] != generation
    key_stamp = p.stamp("a")[2]
    p.load_key("a", p.dump_key("a"))
    assert p.stamp("a")[2] != key_stamp
    p.observe("b", 100)
    p.observe("c", 100)  # evicts a: the prior's now
    assert p.stamp("a")[2] == -1


def test_with_no_tolerance_any_move_of_the_prior_starts_a_generation() -> None:
    strict = LengthPredictor(PredictorSettings(reuse_tolerance=0.0))
    loose = LengthPredictor()
    for i in range(200):
        before = strict.stamp("unseen")[0], loose.stamp("unseen")[0]
        strict.observe(f"k{i % 7}", 100 + i, prompt_len=50)
        loose.observe(f"k{i % 7}", 100 + i, prompt_len=50)
        assert strict.stamp("unseen")[0] != before[0]
        if i == 199:
            assert loose.stamp("unseen")[0] == before[1]  # 0.5% of the weight moves it less


# -- a synthetic workload ------------------------------------------------------------


def test_ranks_next_epochs_tail_and_beats_the_prior() -> None:
    rng = random.Random(42)
    n_prompts, n = 300, 8
    centers = [rng.gauss(4.0, 1.0) for _ in range(n_prompts)]  # per-prompt log-mean

    def sample(k: int) -> int:
        return round(math.exp(centers[k] + rng.gauss(0.0, 0.5)))

    p = LengthPredictor()
    for k in range(n_prompts):
        for _ in range(n):
            p.observe(f"p{k}", sample(k), epoch=0)

    actual: list[float] = []
    predicted: list[float] = []
    prior: list[float] = []
    prior_mean = p.predict("never-seen").mean
    for k in range(n_prompts):
        pred = p.predict(f"p{k}").mean
        for _ in range(n):
            actual.append(sample(k))
            predicted.append(pred)
            prior.append(prior_mean)

    assert tail_auc(predicted, actual) > 0.85
    assert mean_absolute_error(predicted, actual) < mean_absolute_error(prior, actual)


# -- metrics -------------------------------------------------------------------------


def test_mean_absolute_error_by_hand() -> None:
    assert mean_absolute_error([1, 2, 3], [2, 2, 5]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no values"):
        mean_absolute_error([], [])
    with pytest.raises(ValueError, match="predicted has 2 values, actual 1"):
        mean_absolute_error([1, 2], [1])


def test_tail_auc_by_hand() -> None:
    actual = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    # 0.9 quantile of 10 values: the tail is the single largest
    assert tail_auc(actual, actual) == 1.0
    assert tail_auc([-a for a in actual], actual) == 0.0
    assert tail_auc([5] * 10, actual) == 0.5
    # tail {4}; its score 0.9 beats 0.1 and 0.5 and ties 0.9: (1 + 1 + 0.5) / 3
    assert tail_auc([0.1, 0.5, 0.9, 0.9], [1, 2, 3, 4], tail_quantile=0.75) == pytest.approx(
        2.5 / 3
    )
    # tail_quantile 0.5 of four values: the tail is {3, 4}; pairs (tail, rest) won:
    # (0.8 vs 0.2, 0.8 vs 0.8 half, 0.4 vs 0.2, 0.4 vs 0.8 lost) = 2.5 / 4
    assert tail_auc([0.2, 0.8, 0.8, 0.4], [1, 2, 3, 4], tail_quantile=0.5) == pytest.approx(2.5 / 4)
    # actual ties at the threshold join the tail
    assert tail_auc([1, 2, 3, 3], [1, 2, 5, 5], tail_quantile=0.75) == 1.0


def test_tail_auc_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        tail_auc([], [])
    with pytest.raises(ValueError, match="predicted has 1 values, actual 2"):
        tail_auc([1], [1, 2])
    with pytest.raises(ValueError, match="tail_quantile"):
        tail_auc([1, 2], [1, 2], tail_quantile=1.0)
    with pytest.raises(ValueError, match="undefined"):
        tail_auc([1, 2], [3, 3])
    with pytest.raises(ValueError, match="finite"):
        tail_auc([math.nan, 1], [1, 2])


def test_the_scheduler_s_prior_is_a_setting() -> None:
    from rollserve.scheduler.server import build_parser, settings_from_args

    argv = ["--redis-url", "redis://127.0.0.1:1", "--predictor-default-len", "200"]
    argv += ["--predictor-reuse-tolerance", "0"]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert settings.predictor.default_len == 200
    assert settings.predictor.reuse_tolerance == 0
    # Before anything is learnt, every prompt is predicted that long on average.
    assert LengthPredictor(settings.predictor).predict("unseen").mean == pytest.approx(200)
