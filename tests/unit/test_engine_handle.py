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


async def test_a_look_reads_the_stats_again_and_tells_a_new_process_by_its_boot_id() -> None:
    engine = await FakeEngine("a", max_num_seqs=8).start()
    handle = EngineHandle("a", engine.address, capacity_factor=1.0)
    answers: list[tuple[bool, int, int]] = []  # (anew, restarts, capacity) after each probe
    try:

        async def probe(look: bool) -> None:
            anew = await handle.probe(timeout_s=5, look=look)
            answers.append((anew, handle.restarts, handle.capacity_samples))

        await probe(look=False)  # the first: Stats read, nothing known before
        engine.max_num_seqs = 16
        await probe(look=False)  # its limits are not read again without a look
        await probe(look=True)  # the same process: it learns the new limit
        engine.boot_id = "another"
        await probe(look=True)  # a new one
        engine.boot_id = ""
        await probe(look=True)  # one that gives none: nothing tells, so anew
        await probe(look=True)
    finally:
        await handle.close()
        await engine.stop()
    assert answers == [
        (True, 0, 8),
        (False, 0, 8),
        (False, 0, 16),
        (True, 1, 16),
        (True, 1, 16),
        (True, 1, 16),
    ]
    assert engine.stats_calls == 5
