"""The runtime keeps a queued group's predicted length between plans while nothing it rests
on changed, and predicts it again when its prompt is learnt or the prior moves.

Nothing is faked: the runtime is built, not started (no engine, no Redis call), its
snapshot read as a plan reads it, and groups are learnt from as a delivery does
(``_learn`` on a finished record).
"""

from __future__ import annotations

from rollserve.client.wire import FinishReason
from rollserve.scheduler.core.policy import create_policy
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.state import GroupRecord, GroupSpec, SamplingSpec
from rollserve.scheduler.store import Store


def group(group_id: str, prompt_key: str) -> GroupSpec:
    return GroupSpec(
        run_id="run",
        group_id=group_id,
        prompt_token_ids=tuple(range(40)),
        n=2,
        sampling=SamplingSpec(max_tokens=8192),
        prompt_key=prompt_key,
    )


def finished(group_id: str, prompt_key: str, length: int) -> GroupRecord:
    record = GroupRecord.new(group(group_id, prompt_key), seq=0)
    record.start((0, 1), "e0", now=0.0)
    for index in (0, 1):
        record.add_tokens(index, [7] * length, [-0.5] * length)
        record.finish_sample(index, FinishReason.STOP, 40, 0, now=1.0)
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
    before = predicted(runtime)

    def fresh(prompt_key: str) -> float:
        return runtime.predictor.predict(prompt_key, 40).mean

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
