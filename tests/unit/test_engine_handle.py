"""The scheduler's handle on an engine: what it learns from the engine's Stats.

Faked: the engine (``FakeEngine`` of fakes.py, a real gRPC server with scripted answers).
Real: the handle and its gRPC client.
"""

from __future__ import annotations

from rollserve.scheduler.engines import EngineHandle, EngineLoad

from tests.unit.fakes import FakeEngine


async def test_the_engine_view_carries_the_kv_capacity_the_engine_reports() -> None:
    engine = await FakeEngine("a", max_num_seqs=8, kv_capacity_tokens=4096).start()
    handle = EngineHandle("a", engine.address, capacity_factor=1.25)
    try:
        assert handle.view(EngineLoad()).kv_capacity_tokens == 0  # not probed: unknown
        await handle.probe(timeout_s=5)
        view = handle.view(EngineLoad(samples=2, kv_used_tokens=300))
    finally:
        await handle.close()
        await engine.stop()
    assert (view.kv_capacity_tokens, view.kv_used_tokens) == (4096, 300)
    assert view.capacity_samples == 10 and view.free_samples == 8
