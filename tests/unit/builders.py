"""Builders for scheduler-core tests: hand-made snapshots, specs and proto requests.

Nothing is faked here: these build the plain records the core reads.
"""

from __future__ import annotations

from rollserve.scheduler.core.snapshot import EngineView, QueuedGroup, Snapshot
from rollserve.scheduler.state import GroupSpec, SamplingSpec
from rollserve.v1 import rollserve_pb2 as pb


def queued(
    key: str,
    n: int = 4,
    max_tokens: int = 100,
    seq: int = 0,
    priority: int = 0,
    *,
    prompt: tuple[int, ...] = (),
    prompt_key: str = "",
    samples: tuple[int, ...] = (),
) -> QueuedGroup:
    return QueuedGroup(
        key=key,
        n=n,
        prompt_len=len(prompt) or 10,
        max_tokens=max_tokens,
        priority=priority,
        seq=seq,
        prompt_key=prompt_key,
        samples=samples,
        prompt_token_ids=prompt,
    )


def engine(
    engine_id: str,
    capacity: int = 64,
    inflight: int = 0,
    outstanding: int = 0,
    healthy: bool = True,
) -> EngineView:
    return EngineView(engine_id, healthy, capacity, inflight, outstanding)


def snapshot(queue: list[QueuedGroup], engines: list[EngineView]) -> Snapshot:
    return Snapshot(tuple(queue), tuple(engines))


def spec(group_id: str = "g0", n: int = 2, max_tokens: int = 8, run_id: str = "run") -> GroupSpec:
    return GroupSpec(
        run_id=run_id,
        group_id=group_id,
        prompt_token_ids=(5, 6, 7, 8, 9),
        n=n,
        sampling=SamplingSpec(max_tokens=max_tokens),
        prompt_key=f"key-{group_id}",
    )


def proto_group(
    group_id: str = "g0", n: int = 2, max_tokens: int = 16, **sampling: float
) -> pb.PromptGroup:
    params = pb.SamplingParams(max_tokens=max_tokens)
    for name, value in sampling.items():
        setattr(params, name, value)
    return pb.PromptGroup(group_id=group_id, prompt_token_ids=[5, 6, 7, 8, 9], n=n, sampling=params)
