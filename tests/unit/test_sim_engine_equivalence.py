"""The fast simulated engine gives exactly what the straightforward one gives, on random work.

:class:`SimEngine` keeps totals and heaps instead of walking its running requests every step;
:class:`ReferenceSimEngine` (``sim_reference.py``) is the plain model it came from. Seeded
random workloads (random profiles down to a few KV blocks, long-tailed lengths, shared
prefixes, priorities, requests added between steps, aborts at random times) run on both, step
by step, and everything observable must be equal after every call: each ``StepResult``, the
stats, ``progress()`` of every request ever added, ``running``, ``waiting``, ``kv_used_tokens``
and, peeking at the block pools, the prefix cache (free blocks, references, LRU order).

Run as a script (``python -m tests.unit.test_sim_engine_equivalence``) for a rough speed
comparison; the tests never time anything.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field, replace

import pytest
from rollserve.sim.engine_model import SimEngine, SimRequest, StepResult
from rollserve.sim.profile import CostProfile, load_profile

from tests.unit.sim_reference import ReferenceSimEngine

CASES = 40


@dataclass
class Coverage:
    """What a case went through, so that the cases together are known to cover the model."""

    steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    cached_prompt_tokens: int = 0
    aborts: int = 0
    length_finishes: int = 0
    big_first_admissions: int = 0  # a prompt over the token budget, admitted into an empty step
    weight_updates: int = 0  # that sent running requests back (recomputed)
    chunked_over_budget: int = 0  # steps that admitted past the budget beside decodes
    priorities: set[int] = field(default_factory=set)


def random_profile(rng: random.Random, tight: bool) -> CostProfile:
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    if tight:  # a cache of a few blocks: decoding runs out of it, preempts and evicts
        blocks = rng.randint(4, 40)
    else:
        blocks = rng.choice([rng.randint(4, 24), rng.randint(25, 120), rng.randint(121, 2000)])
    return CostProfile(
        name="random",
        source="random for the equivalence test",
        simulated_hardware="none",
        # Non-round coefficients: durations must be equal to the last bit, not approximately.
        step_base_s=rng.uniform(1e-3, 1e-2),
        per_decode_seq_s=rng.uniform(0, 1e-4),
        per_prefill_token_s=rng.uniform(0, 1e-4),
        per_kv_token_s=rng.uniform(0, 1e-7),
        kv_capacity_tokens=blocks * block_size + rng.randrange(block_size),
        block_size=block_size,
        max_num_seqs=rng.choice([16, 64, 1024] if tight else [1, 2, 3, 5, 8, 16, 64, 1024]),
        max_num_batched_tokens=rng.choice([4, 16, 50, 128, 512, 8192]),
    )


def random_requests(
    rng: random.Random, profile: CostProfile, count: int, tight: bool
) -> list[SimRequest]:
    capacity = profile.num_blocks * profile.block_size
    prefixes = [(f"p{i}", rng.randint(1, max(1, capacity // 3))) for i in range(rng.randint(1, 4))]
    with_priorities = rng.random() < 0.4
    requests = []
    for i in range(count):
        prompt_len = max(1, min(capacity - 1, round(rng.lognormvariate(math.log(12), 1.0))))
        prefix_id, prefix_len = "", 0
        if rng.random() < 0.6:
            prefix_id, shared = rng.choice(prefixes)
            prompt_len = min(capacity - 1, max(prompt_len, shared + rng.choice([0, 0, 1, 5])))
            prefix_len = min(shared, prompt_len)
            if rng.random() < 0.2:
                prefix_len = rng.randint(0, prompt_len)
        system_id, system_len = "", 0
        if rng.random() < 0.3:
            system_id, shared = rng.choice(prefixes)
            system_len = min(shared // 2, prompt_len)
        max_tokens = rng.randint(1, capacity - prompt_len)
        if rng.random() < (0.2 if tight else 0.7):
            max_tokens = min(max_tokens, rng.randint(1, 64))
        # A long tail: most samples short, a few far past max_tokens.
        median = 3 * profile.block_size * rng.randint(1, 4) if tight else 8
        output_len = max(1, round(rng.lognormvariate(math.log(median), 1.2)))
        requests.append(
            SimRequest(
                request_id=f"r{i}",
                prompt_len=prompt_len,
                output_len=output_len,
                max_tokens=max_tokens,
                prefix_id=prefix_id,
                prefix_len=prefix_len,
                system_id=f"sys-{system_id}" if system_id else "",
                system_len=system_len,
                priority=rng.randint(0, 2) if with_priorities else 0,
            )
        )
    return requests


CacheState = tuple[int, dict[tuple[str, int], int], list[tuple[str, int]]]


def cache_state(engine: SimEngine | ReferenceSimEngine) -> CacheState:
    """The block pool: free blocks, cached blocks with their references, evictable ones (LRU)."""
    pool = engine._pool
    return (pool.free, dict(pool.refs), list(pool.lru))


def check_same(fast: SimEngine, ref: ReferenceSimEngine, ids: list[str], where: str) -> CacheState:
    assert fast.stats == ref.stats, where
    assert (fast.running, fast.waiting) == (ref.running, ref.waiting), where
    assert fast.kv_used_tokens == ref.kv_used_tokens, where
    assert fast.kv_used_tokens <= fast.kv_capacity_tokens, where
    assert fast.has_work() == ref.has_work(), where
    assert [fast.progress(rid) for rid in ids] == [ref.progress(rid) for rid in ids], where
    state = cache_state(ref)
    assert cache_state(fast) == state, where
    return state


def run_case(seed: int) -> Coverage:
    rng = random.Random(seed)
    tight = seed % 2 == 1
    # Half the cases with chunked prefill (by seed: the random draws stay those of before).
    profile = replace(random_profile(rng, tight), chunked_prefill=seed % 4 in (0, 3))
    requests = random_requests(rng, profile, rng.choice([5, 20, 60, 150]), tight)
    fast = SimEngine("e0", profile)
    ref = ReferenceSimEngine("e0", profile)
    coverage = Coverage(priorities={r.priority for r in requests})
    pending = list(requests)
    ids: list[str] = []
    abort_rate = rng.choice([0.0, 0.01, 0.05])
    update_rate = rng.choice([0.0, 0.0, 0.005, 0.02])  # weight updates between steps
    state = check_same(fast, ref, ids, f"seed {seed}: start")
    for step in range(200_000):
        where = f"seed {seed}, step {step}"
        # Between steps: some arrivals (all at once, a few, or none) and maybe an abort.
        if pending and (not ref.has_work() or rng.random() < 0.3):
            for _ in range(min(len(pending), rng.choice([1, 1, 2, 5, len(pending)]))):
                req = pending.pop(0)
                fast.add(req)
                ref.add(req)
                ids.append(req.request_id)
        if ids and rng.random() < abort_rate:
            rid = rng.choice([*ids, "unknown"])
            done = ref.abort(rid)
            assert fast.abort(rid) == done, where
            coverage.aborts += done is not None
        if ref.running and rng.random() < update_rate:
            sent_back = ref.new_weights()
            assert fast.new_weights() == sent_back, where
            coverage.weight_updates += 1
        check_same(fast, ref, ids, where)
        if not ref.has_work():
            if not pending:
                break
            continue
        lru_before = set(state[2])
        expected = ref.step()
        got = fast.step()
        assert got == expected, where
        state = check_same(fast, ref, ids, where)
        coverage.evictions += sum(1 for key in lru_before if key not in state[1])
        coverage.steps += 1
        coverage.length_finishes += sum(f.finish_reason == "length" for f in expected.finished)
        if expected.prefill_tokens > profile.max_num_batched_tokens:
            coverage.big_first_admissions += 1
        over = expected.decode_seqs + expected.prefill_tokens > profile.max_num_batched_tokens
        coverage.chunked_over_budget += over and expected.decode_seqs > 0
    else:
        pytest.fail(f"seed {seed}: did not drain")
    assert not pending and not ref.has_work()
    coverage.preemptions = ref.stats.preemptions
    coverage.cached_prompt_tokens = ref.stats.cached_prompt_tokens
    return coverage


@pytest.mark.parametrize("seed", range(CASES))
def test_fast_engine_equals_reference_on_random_work(seed: int) -> None:
    run_case(seed)


def test_the_random_cases_cover_preemption_eviction_and_the_rest() -> None:
    covered = [run_case(seed) for seed in range(CASES)]
    assert sum(c.preemptions > 0 for c in covered) >= 15
    assert sum(c.preemptions >= 10 for c in covered) >= 8
    assert sum(c.evictions > 0 for c in covered) >= 10
    assert sum(c.cached_prompt_tokens > 0 for c in covered) >= 10
    assert sum(c.aborts > 0 for c in covered) >= 5
    assert sum(c.length_finishes > 0 for c in covered) >= 10
    assert sum(c.big_first_admissions > 0 for c in covered) >= 3
    assert sum(len(c.priorities) > 1 for c in covered) >= 5
    assert sum(c.weight_updates > 0 for c in covered) >= 10
    assert sum(c.chunked_over_budget > 0 for c in covered) >= 5


def test_a_long_run_with_many_boundaries_and_preemptions_matches() -> None:
    """Long outputs on a small cache with block size 16: many boundary steps, heavy thrashing."""
    profile = CostProfile(
        name="small",
        source="for the equivalence test",
        simulated_hardware="none",
        step_base_s=6.5e-3,
        per_decode_seq_s=3.0e-5,
        per_prefill_token_s=5.0e-5,
        per_kv_token_s=5.2e-8,
        kv_capacity_tokens=4096,
        block_size=16,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    rng = random.Random(7)
    fast = SimEngine("e0", profile)
    ref = ReferenceSimEngine("e0", profile)
    ids = []
    for i in range(40):
        prompt_len = rng.randint(20, 200)
        req = SimRequest(
            f"g{i // 4}/{i % 4}",
            prompt_len,
            min(2000, round(rng.lognormvariate(math.log(150), 1.0))),
            2048,
            prefix_id=f"g{i // 4}",
            prefix_len=prompt_len,
        )
        fast.add(req)
        ref.add(req)
        ids.append(req.request_id)
    results: list[StepResult] = []
    while ref.has_work():
        expected = ref.step()
        assert fast.step() == expected
        check_same(fast, ref, ids, f"step {len(results)}")
        results.append(expected)
    assert ref.stats.preemptions > 10
    assert not fast.has_work()


# A rough speed comparison, not a test: ``python -m tests.unit.test_sim_engine_equivalence``.


def speed_workload(count: int = 1000, seed: int = 0) -> list[SimRequest]:
    """``count`` samples in groups of 8 sharing their prompt; responses log-normal (median
    1200, sigma 1.1) capped at 32768 (finish ``length`` there)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        group = i // 8
        prompt_len = round(random.Random(group).lognormvariate(math.log(400), 0.5)) + 1
        requests.append(
            SimRequest(
                f"q{group}/{i % 8}",
                prompt_len,
                round(rng.lognormvariate(math.log(1200), 1.1)) + 1,
                32768,
                prefix_id=f"q{group}",
                prefix_len=prompt_len,
            )
        )
    return requests


def speed_check(engines: int = 1, count: int = 1000) -> None:
    """Drains ``count`` requests dealt round-robin over ``engines`` engines of the gpu profile
    on each implementation and prints the wall time and steps of each."""
    profile = load_profile("gpu-h100-llama8b")
    requests = speed_workload(count)
    outcomes = {}
    for name, cls in (("reference", ReferenceSimEngine), ("fast", SimEngine)):
        t0 = time.perf_counter()
        fleet = [cls(f"e{i}", profile) for i in range(engines)]
        for i, req in enumerate(requests):
            fleet[i % engines].add(req)
        total_steps = 0
        for engine in fleet:
            while engine.has_work():
                engine.step()
                total_steps += 1
        elapsed = time.perf_counter() - t0
        outcomes[name] = [asdict(e.stats) for e in fleet]
        print(
            f"{name:>9}: {engines} engine(s), {count} requests, {total_steps} steps, "
            f"{elapsed:.2f} s, preemptions {sum(e.stats.preemptions for e in fleet)}"
        )
    assert outcomes["fast"] == outcomes["reference"]


if __name__ == "__main__":
    speed_check(engines=1)
    speed_check(engines=8)
