"""The runtime keeps a queued group's predicted length between plans while nothing it rests
on changed, and predicts it again when its prompt is learnt or the prior moves; a kept
view is relabelled whole; what fair share sees of a group is kept while the group is.

Nothing is faked: the runtime is built, not started (no engine, no Redis call), its
snapshot read as a plan reads it, and groups are learnt from as a delivery does
(``_learn`` on a finished record).
"""

from __future__ import annotations

import dataclasses
import random

from rollserve.client.wire import FinishReason
from rollserve.scheduler.core.policy import create_policy
from rollserve.scheduler.core.snapshot import QueuedGroup
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.state import GroupRecord, GroupSpec, SamplingSpec
from rollserve.scheduler.store import Store


def group(group_id: str, prompt_key: str, prompt_len: int = 40) -> GroupSpec:
    return GroupSpec(
        run_id="run",
        group_id=group_id,
        prompt_token_ids=tuple(range(prompt_len)),
        n=2,
        sampling=SamplingSpec(max_tokens=8192),
        prompt_key=prompt_key,
    )


def finished(group_id: str, prompt_key: str, length: int, prompt_len: int = 40) -> GroupRecord:
    record = GroupRecord.new(group(group_id, prompt_key, prompt_len), seq=0)
    record.start((0, 1), "e0", now=0.0)
    for index in (0, 1):
        record.add_tokens(index, [7] * length, [-0.5] * length)
        record.finish_sample(index, FinishReason.STOP, prompt_len, 0, now=1.0)
    return record


def predicted(runtime: SchedulerRuntime) -> dict[str, float]:
    out = {}
    for view in runtime.snapshot().queue:
        assert view.predicted_len is not None
        out[view.prompt_key] = view.predicted_len
    return out


def test_a_queued_prediction_changes_with_its_prompt_s_history_or_the_prior(
    redis_url: str,
) -> None:
    settings = SchedulerSettings.model_validate({"redis_url": redis_url, "policy": "rl"})
    runtime = SchedulerRuntime(
        settings, Store.from_url(redis_url, predictor_namespace="unused"), create_policy("rl")
    )
    for i in range(2000):  # a prior that one group barely moves
        runtime._learn(finished(f"old{i}", f"old{i}", 90 + i % 20))
    runtime._enqueue(group("qa", "pa"))
    runtime._enqueue(group("qb", "pb"))
    runtime._enqueue(group("qc", "pc", prompt_len=1000))  # unseen too, its length's prior
    before = predicted(runtime)

    def fresh(prompt_key: str, prompt_len: int = 40) -> float:
        return runtime.predictor.predict(prompt_key, prompt_len).mean

    # Prompt pa's first group was long: its queued group is predicted again, pb's kept.
    runtime._learn(finished("done-a", "pa", 3000))
    after = predicted(runtime)
    assert after["pa"] > 5 * before["pa"]
    assert after["pa"] == fresh("pa")
    assert after["pb"] == before["pb"]
    assert abs(after["pb"] - fresh("pb")) <= 0.03 * fresh("pb")

    # Every prompt grew longer: the prior moves past its tolerance and pb's is new too.
    for i in range(500):
        runtime._learn(finished(f"new{i}", f"new{i}", 400))
    later = predicted(runtime)
    assert later["pb"] > 1.2 * after["pb"]
    assert abs(later["pb"] - fresh("pb")) <= 0.03 * fresh("pb")

    # Prompts of about 1000 tokens came out short: pc's bucket's prior is its own.
    for i in range(300):
        runtime._learn(finished(f"wide{i}", f"wide{i}", 20, prompt_len=1000))
    last = predicted(runtime)
    assert last["pc"] < 0.5 * last["pb"]
    assert abs(last["pc"] - fresh("pc", 1000)) <= 0.03 * fresh("pc", 1000)
    assert abs(last["pb"] - fresh("pb")) <= 0.03 * fresh("pb")

    # One more of them, longer: pc's bucket begins a generation, the prior's does not.
    generation, bucket_moves = runtime.predictor.generations
    runtime._learn(finished("wide-long", "wide-long", 500, prompt_len=1000))
    assert runtime.predictor.generations[0] == generation
    assert runtime.predictor.generations[1] > bucket_moves
    again = predicted(runtime)
    assert again["pc"] == fresh("pc", 1000)  # predicted anew
    assert again["pb"] == last["pb"]  # kept


def test_a_relabelled_view_keeps_every_other_field() -> None:
    view = QueuedGroup(
        key="run/g",
        n=4,
        prompt_len=3,
        max_tokens=99,
        priority=2,
        seq=7,
        turn=(1, 2),
        run_id="run",
        prompt_key="p",
        samples=(1, 3),
        prompt_token_ids=(4, 5, 6),
        predicted_len=10.0,
        predicted_lens=(11.0, 12.0),
        progress=(0, 5),
    )
    assert {f.name for f in dataclasses.fields(QueuedGroup)} == set(vars_of(view))
    assert view.relabelled(0, (0, 0), 20.0) == dataclasses.replace(
        view, priority=0, turn=(0, 0), predicted_len=20.0
    )


def vars_of(view: QueuedGroup) -> dict[str, object]:
    """Every field given a value that is not its default (so a field added to QueuedGroup
    and not to the view above fails here, not silently in ``relabelled``)."""
    defaults = {f.name: f.default for f in dataclasses.fields(QueuedGroup)}
    return {name: getattr(view, name) for name in defaults if getattr(view, name) != defaults[name]}


def test_kept_predictions_stay_near_new_ones_through_random_arrivals_and_deliveries(
    redis_url: str,
) -> None:
    """Groups of a few prompts and lengths arrive and are delivered at random (some prompts
    never), the long prompts' lengths drifting upward: at every snapshot each queued
    group's prediction is within 3% of what the predictor says now, and its view is the
    one built anew."""
    rng = random.Random(11)
    settings = SchedulerSettings.model_validate({"redis_url": redis_url, "policy": "rl"})
    runtime = SchedulerRuntime(
        settings, Store.from_url(redis_url, predictor_namespace="unused"), create_policy("rl")
    )
    prompts = [(f"p{i}", rng.choice((20, 40, 300, 1000))) for i in range(12)]
    unseen = [(f"u{i}", prompt_len) for i, prompt_len in enumerate((20, 40, 300, 1000))]
    arrived = 0
    for step in range(600):
        if rng.random() < 0.4 and arrived - step // 3 < 40:
            key, prompt_len = rng.choice(prompts + unseen)
            runtime._enqueue(group(f"q{arrived}", key, prompt_len))
            arrived += 1
        else:
            key, prompt_len = rng.choice(prompts)
            # Long prompts' responses grow through the run, the others' stay: their
            # bucket's prior moves more than the whole prior.
            scale = 50 * (1 + step / 100) if prompt_len == 1000 else 50
            length = round(scale * rng.lognormvariate(0, 0.5))
            runtime._learn(finished(f"d{step}", key, length, prompt_len))
        for view in runtime.snapshot().queue:
            assert view.predicted_len is not None
            fresh = runtime.predictor.predict(view.prompt_key, view.prompt_len).mean
            assert abs(view.predicted_len - fresh) <= 0.03 * fresh, (step, view.key)
            record = runtime._groups[view.key]
            built = runtime._queued_view(record, view.predicted_len, view.priority, view.turn)
            assert view == built, (step, view.key)


def test_fair_share_sees_a_queued_group_s_pending_samples_as_they_are_now(
    redis_url: str,
) -> None:
    """What fair share sees of each queued group is kept between plans; a group some of
    whose samples started is seen anew (its pending samples fewer)."""
    settings = SchedulerSettings.model_validate({"redis_url": redis_url, "policy": "rl"})
    runtime = SchedulerRuntime(
        settings, Store.from_url(redis_url, predictor_namespace="unused"), create_policy("rl")
    )
    for i in range(10):
        for run in ("a", "b"):
            spec = dataclasses.replace(group(f"{run}{i}", f"{run}{i}"), run_id=run)
            runtime._enqueue(spec)
    kept = runtime._turns(["a", "b"])
    for i in range(5):
        runtime._groups[f"a/a{i}"].start((0,), "e0", now=0.0)  # one sample of each runs
    now = runtime._turns(["a", "b"])
    runtime._waiting.clear()
    assert now == runtime._turns(["a", "b"])  # as if nothing were kept
    assert now != kept  # (a's later groups have fewer samples ahead of them)
