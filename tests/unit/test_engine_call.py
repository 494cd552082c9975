"""The Generate calls the scheduler makes pass the engine's own checks of a call: a group the
scheduler accepted must not be refused by every engine (a refusal fails the group for good).

Faked: the engine's gRPC stub (it keeps the request the scheduler's handle sends); the
engine's check is the real one (``rollserve.engine.service._validate``)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from rollserve.client.wire import INT64_MAX, MAX_SAMPLES_PER_CALL
from rollserve.engine.service import ModelInfo, _validate
from rollserve.scheduler.engines import EngineHandle
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.state import GroupSpec, SamplingSpec
from rollserve.v1 import rollserve_pb2 as pb

INFO = ModelInfo("m", max_model_len=256, max_num_seqs=8, vocab_size=1000, eos_token_id=1)


class _KeepingStub:
    """Keeps the last Generate request; the call it answers is never read."""

    request: pb.GenerateRequest | None = None

    def Generate(self, request: pb.GenerateRequest, **_: Any) -> Any:
        self.request = request

        class _Call:
            def add_done_callback(self, _: Any) -> None:
                pass

        return _Call()


async def _sent(
    spec: GroupSpec, indices: tuple[int, ...], resumption: int = 0
) -> pb.GenerateRequest:
    handle = EngineHandle("e", "127.0.0.1:1", 1.0)
    stub = _KeepingStub()
    handle._link.stub = stub  # type: ignore[assignment]
    try:
        resumed = (7, 7) if resumption else ()
        handle.generate(spec, "call", indices, resumed, resumption)
    finally:
        await handle.close()
    assert stub.request is not None
    return stub.request


@pytest.mark.parametrize("resumption", [1, 2, 3])
async def test_a_seed_near_int64_s_top_passes_the_engine_s_check_when_resumed(
    resumption: int,
) -> None:
    # Accepted by Submit (seed + n - 1 within int64); resumed, sample 3 ran past it.
    spec = GroupSpec("run", "g", (5, 6, 7), 4, SamplingSpec(max_tokens=10, seed=INT64_MAX - 6))
    first = await _sent(spec, (0, 1, 2, 3))
    resumed = await _sent(spec, (3,), resumption)
    assert _validate(first, INFO) is None
    assert _validate(resumed, INFO) is None
    assert resumed.sampling.seed != first.sampling.seed  # (a stream of its own)


async def test_a_seed_away_from_the_top_moves_by_n_a_resumption() -> None:
    spec = GroupSpec("run", "g", (5, 6, 7), 4, SamplingSpec(max_tokens=10, seed=100))
    assert (await _sent(spec, (3,), 2)).sampling.seed == 108


async def test_the_largest_group_the_scheduler_takes_is_one_an_engine_takes() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_n"):
        SchedulerSettings.model_validate(
            {"redis_url": "redis://127.0.0.1:6379/0", "max_n": MAX_SAMPLES_PER_CALL + 1}
        )
    spec = GroupSpec("run", "g", (5, 6, 7), MAX_SAMPLES_PER_CALL, SamplingSpec(max_tokens=10))
    assert _validate(await _sent(spec, (0, 1)), INFO) is None
