"""What the scheduler takes, a real vLLM engine runs: Submit's requests, changed at their
fields' edges (``tests/unit/fuzz.py``), go to a scheduler (served in this process as
``rollserve scheduler`` serves it) on the session's engine, and every group the scheduler
took is delivered: none fails on the engine for a check the scheduler did not make.

Real: vLLM on the CPU, the scheduler, gRPC and Redis. A group's samples are cut to
``MAX_TOKENS`` tokens (CPU time), and its changes are otherwise sent as made.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from typing import Any

import pytest
from rollserve.client.wire import GroupStatus
from rollserve.v1 import rollserve_pb2 as pb

from tests.unit.fakes import FakeEngine
from tests.unit.fuzz import check_rpc
from tests.unit.test_fuzz_api import scheduler, valid_group
from tests.unit.test_runtime import read_stream

pytestmark = pytest.mark.integration

REQUESTS = int(os.environ.get("ROLLSERVE_FUZZ_MUTANTS", "100"))
SEED = int(os.environ.get("ROLLSERVE_FUZZ_SEED", "21"))
MAX_TOKENS = 32
WAIT_S = 600.0


async def test_what_the_scheduler_takes_a_real_engine_runs(
    redis_url: str, engine_address: str
) -> None:
    engine = FakeEngine("engine-it")  # (only its id and address are read: the real engine's)
    engine.address = engine_address
    async with scheduler(redis_url, engine) as (stub, task, _):
        ids = itertools.count()
        taken: dict[str, int] = {}  # run id -> groups taken

        async def alive() -> None:
            assert not task.done(), "the scheduler stopped"

        async def submit(request: Any) -> Any:
            assert isinstance(request, pb.SubmitRequest)
            for group in request.groups:
                if group.group_id == "g":
                    group.group_id = f"g{next(ids)}"
                group.sampling.max_tokens = min(group.sampling.max_tokens, MAX_TOKENS)
            reply = await stub.Submit(request, timeout=60)
            taken[request.run_id] = taken.get(request.run_id, 0) + reply.accepted
            return reply

        run = f"takes-{uuid.uuid4().hex[:8]}"
        valid = pb.SubmitRequest(run_id=run, groups=[valid_group("g")])
        seen = await check_rpc("Submit", submit, valid, seed=SEED, count=REQUESTS, alive=alive)
        assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen

        async def drained() -> None:
            while True:
                status = await stub.Status(pb.StatusRequest(), timeout=30)
                if status.queue_depth == 0 and status.inflight_groups == 0:
                    return
                await asyncio.sleep(0.5)

        await asyncio.wait_for(drained(), WAIT_S)
        failed = [
            f"{run_id}/{result.group_id}: {result.error}"
            for run_id, count in taken.items()
            for result in await read_stream(redis_url, run_id, count)
            if result.status != GroupStatus.DELIVERED
        ]
        assert not failed, f"{len(failed)} groups taken then failed: {failed[:5]}"
