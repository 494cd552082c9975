"""The real scheduler against a fleet of sim engines: real Redis, the real scheduler process,
``python -m rollserve.sim fleet`` as its own process, and the SDK. Only the engines are
simulated, and they say so."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from rollserve.cli.stack import ManagedProcess
from rollserve.client import FinishReason, GroupStatus, PromptGroup, RolloutClient, SamplingParams
from rollserve.sim.responses import TokenStream, prompt_digest, sample_draw
from rollserve.sim.server import READY_PREFIX
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.integration.scheduler_proc import start_scheduler

pytestmark = pytest.mark.integration

ENGINES = 8
GROUPS = 32
N = 4
MAX_TOKENS = 64
START_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 120.0
# The fleet's length model and vocabulary (what the test recomputes every sample from).
FLEET_SETTINGS = SimSettings(
    engines=ENGINES, time_scale=0.01, response_median=40, seed=5, max_model_len=4096
)


@dataclass
class Fleet:
    process: ManagedProcess
    stats_path: Path


@pytest.fixture(scope="module")
def scheduler(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = start_scheduler(redis_url, [], tmp_path_factory.mktemp("sim-sched"), "--max-n", "16")
    yield proc.address
    proc.stop()


@pytest.fixture(scope="module")
def fleet(scheduler: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("sim-fleet")
    stats_path = log_dir / "stats.json"
    s = FLEET_SETTINGS
    proc = ManagedProcess.start(
        "fleet",
        [
            sys.executable,
            "-m",
            "rollserve.sim",
            "fleet",
            *("--engines", str(s.engines), "--time-scale", str(s.time_scale)),
            *("--response-median", str(s.response_median), "--seed", str(s.seed)),
            *("--max-model-len", str(s.max_model_len), "--scheduler-address", scheduler),
            *("--stats-path", str(stats_path)),
        ],
        log_dir,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_PREFIX not in proc.log_tail(1 << 16):
            assert proc.popen.poll() is None, f"the fleet exited:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"the fleet did not start:\n{proc.log_tail()}"
            time.sleep(0.05)
        yield Fleet(proc, stats_path)
    finally:
        proc.stop()


def groups() -> list[PromptGroup]:
    """Half the groups seeded (sample i is draw seed + i), half not (draw i)."""
    return [
        PromptGroup(
            group_id=f"g{g}",
            prompt_token_ids=[1000 + g, *range(20, 40 + g)],
            n=N,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, seed=100 * g if g % 2 else None),
            prompt_key=f"p{g}",
        )
        for g in range(GROUPS)
    ]


def test_every_group_arrives_once_as_the_length_model_says_from_engines_labelled_sim(
    scheduler: str, fleet: Fleet, redis_url: str
) -> None:
    submitted = {g.group_id: g for g in groups()}
    with RolloutClient(scheduler, redis_url, f"sim-{uuid.uuid4().hex[:8]}") as client:
        deadline = time.monotonic() + START_TIMEOUT_S
        while client.status().healthy_engines < ENGINES:
            assert time.monotonic() < deadline, "the sim engines did not register"
            time.sleep(0.1)
        assert client.submit(list(submitted.values())) == GROUPS
        received = list(client.groups(limit=GROUPS, timeout_s=RESULT_TIMEOUT_S))
        for item in received:
            item.done()
        assert list(client.groups(timeout_s=0.5)) == []  # nothing more, nothing twice
        # (it counts a group just after writing its entry, which may be read first)
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while (status := client.status()).groups_delivered < GROUPS:
            assert time.monotonic() < deadline, f"{status.groups_delivered} groups counted"
            time.sleep(0.05)

    results = [item.result for item in received]
    assert sorted(r.group_id for r in results) == sorted(submitted)
    lengths = FLEET_SETTINGS.length_model()
    tokens = TokenStream(FLEET_SETTINGS.vocab_size, FLEET_SETTINGS.eos_token_id)
    engines_used = set()
    reasons = set()
    for result in results:
        assert result.status == GroupStatus.DELIVERED
        group = submitted[result.group_id]
        digest = prompt_digest(group.prompt_token_ids)
        assert [s.index for s in result.samples] == list(range(N))
        for sample in result.samples:
            draw = sample_draw(sample.index, group.sampling.seed, greedy=False)
            natural = lengths.natural_length(digest, draw)
            stops = natural <= MAX_TOKENS
            ids, _ = tokens.tokens(
                lengths.token_key(digest, draw),
                0,
                min(natural, MAX_TOKENS),
                natural - 1 if stops else None,
            )
            assert sample.token_ids == ids, (result.group_id, sample.index)
            assert sample.finish_reason == (FinishReason.STOP if stops else FinishReason.LENGTH)
            assert len(sample.logprobs) == len(ids)
            assert all(lp <= 0 for lp in sample.logprobs)
            assert sample.num_prompt_tokens == len(group.prompt_token_ids)
            engines_used.add(sample.engine_id)
            reasons.add(sample.finish_reason)
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    assert len(engines_used) > 1
    assert status.groups_delivered >= GROUPS

    # Every engine says it is simulated.
    assert {e.engine_id for e in status.engines} == {f"sim-{i}" for i in range(ENGINES)}
    for engine in status.engines:
        with grpc.insecure_channel(engine.address) as channel:
            stats = pb_grpc.EngineStub(channel).Stats(pb.StatsRequest(), timeout=5)
        assert stats.model == "sim:gpu-h100-llama8b"
        assert stats.engine_id == engine.engine_id

    # It stops cleanly on SIGTERM and its totals say what it was.
    fleet.process.stop()
    assert fleet.process.popen.returncode == 0, fleet.process.log_tail()
    totals = json.loads(fleet.stats_path.read_text())
    assert totals["simulated"] is True
    assert totals["engines"] == ENGINES
    assert totals["generate_calls"] >= GROUPS
    assert totals["completes"] >= GROUPS * N
