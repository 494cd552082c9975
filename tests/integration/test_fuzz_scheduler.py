"""What the scheduler takes, a real vLLM engine runs: Submit's requests, changed at their
fields' edges (``tests/unit/fuzz.py``), go to a scheduler (served in this process as
``rollserve scheduler`` serves it) on the session's engine, and every group the scheduler
took is delivered: none fails on the engine for a check the scheduler did not make.

Real: vLLM on the CPU, the scheduler, gRPC and Redis. A group's samples are cut to
``MAX_TOKENS`` tokens (CPU time), and its changes are otherwise sent as made.
"""

from __future__ import annotations

import pytest

from tests.unit.fuzz import Campaign
from tests.unit.test_fuzz_api import taken_then_failed

pytestmark = pytest.mark.integration

FUZZ = Campaign.from_env(count=100, seed=21)
MAX_TOKENS = 32


async def test_what_the_scheduler_takes_a_real_engine_runs(
    other_redis_url: str, engine_address: str
) -> None:
    failed = await taken_then_failed(
        other_redis_url,
        "engine-it",
        engine_address,
        FUZZ,
        max_tokens=MAX_TOKENS,
    )
    assert not failed, f"{len(failed)} groups taken then failed: {failed[:5]}"
