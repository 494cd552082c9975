"""``bench fidelity``'s pure parts: a real run's records become the simulator's groups, busy
time is a union of intervals, and the replay runs the scheduler's policy over them.

The real step (dev stack, vLLM) is not run here; its records are built by hand.
"""

from __future__ import annotations

import pytest
from rollserve.bench.fidelity import (
    FidelityConfig,
    SampleRecord,
    busy_union_s,
    largest_burst,
    real_engine_load,
    sim_groups,
    simulate,
)
from rollserve.bench.workload import BenchGroup


def bench_group(index: int, n: int = 2, prompt_len: int = 12) -> BenchGroup:
    return BenchGroup(
        index=index,
        prompt_key=f"sum-{index}",
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        n=n,
        max_tokens=64,
        seed=1000 * index,
    )


def record(
    group: int,
    index: int,
    length: int,
    engine: str = "engine-0",
    span: tuple[float, float] = (0, 1),
) -> SampleRecord:
    return SampleRecord(
        group=group,
        index=index,
        prompt_len=12,
        response_len=length,
        finish_reason="length" if length >= 64 else "stop",
        engine_id=engine,
        started_at=span[0],
        finished_at=span[1],
    )


def test_busy_union_merges_overlaps_and_keeps_gaps() -> None:
    assert busy_union_s([]) == 0.0
    assert busy_union_s([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)
    assert busy_union_s([(5, 6), (0, 10)]) == pytest.approx(10.0)


def test_real_engine_load_per_engine_in_id_order() -> None:
    samples = [
        record(0, 0, 10, "engine-1", (0, 2)),
        record(0, 1, 30, "engine-1", (1, 3)),
        record(1, 0, 5, "engine-0", (0, 1)),
    ]
    load = real_engine_load(samples)
    assert list(load) == ["engine-0", "engine-1"]
    assert load["engine-1"].busy_s == pytest.approx(3.0)
    assert load["engine-1"].output_tokens == 40
    assert load["engine-1"].samples == 2
    assert (load["engine-0"].report_burst, load["engine-1"].report_burst) == (1, 1)  # 2 s apart


def test_the_largest_burst_counts_ends_within_the_window() -> None:
    assert largest_burst([]) == 0
    assert largest_burst([5.0]) == 1
    # 2.00, 2.05 and 2.09 lie within 0.1 s; 1.0 and 3.0 stand alone.
    assert largest_burst([3.0, 2.05, 1.0, 2.09, 2.0]) == 3
    assert largest_burst([0.0, 0.2, 0.4, 0.6]) == 1
    assert largest_burst([0.0, 0.2, 0.4, 0.6], window_s=0.25) == 2


def test_sim_groups_keep_order_lengths_and_prompts() -> None:
    groups = [bench_group(0), bench_group(1, prompt_len=20)]
    samples = [record(1, 1, 7), record(0, 0, 64), record(1, 0, 3), record(0, 1, 9)]
    out = sim_groups(groups, samples)
    assert [g.key for g in out] == ["g0", "g1"]
    assert out[0].output_lens == (64, 9)
    assert out[1].output_lens == (3, 7)
    assert out[1].prompt_len == 20
    assert out[0].max_tokens == 64
    assert out[0].prompt_key == "sum-0"
    with pytest.raises(ValueError, match="group 1"):
        sim_groups(groups, samples[1:])


def test_simulate_replays_every_step_with_the_policy() -> None:
    steps = [
        sim_groups(
            [bench_group(i) for i in range(4)],
            [record(i, k, 10 + 5 * i + k) for i in range(4) for k in range(2)],
        )
        for _ in range(2)
    ]
    cfg = FidelityConfig(engines=2, policy="least_outstanding")
    out = simulate(steps, cfg)
    assert len(out) == 2
    for makespan, engines in out:
        assert makespan > 0
        assert list(engines) == ["e000", "e001"]
        assert all(0 < e.busy_s <= makespan + 1e-12 for e in engines.values())
        assert all(e.engine_steps > 0 for e in engines.values())
    assert simulate(steps, cfg) == out  # deterministic
