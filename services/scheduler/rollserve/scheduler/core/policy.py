"""The policy interface and its factory.

A policy is a pure function from a :class:`Snapshot` to a :class:`Plan`. It may keep
its own bookkeeping between calls (a cursor, a history), but never does I/O. A new
policy is a new file under ``policies/`` registered in ``_REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from rollserve.scheduler.core.snapshot import Assign, Plan, Snapshot


class Policy(Protocol):
    name: str
    # True when every Assign of the policy places all pending samples of its group; a
    # policy that places samples one by one (or splits groups) sets it False.
    whole_groups: bool
    # True when the policy reads the running samples and may preempt them (``Plan.preempts``):
    # the edges then fill ``Snapshot.running`` and ask for a plan when a sample finishes even
    # with nothing queued.
    moves_running: bool
    # True when the policy reads predicted lengths (``QueuedGroup.predicted_len``,
    # ``EngineView.predicted_outstanding`` and ``predicted_longest``,
    # ``RunningSample.predicted_left``): the edges compute them for its snapshots only then,
    # and leave them unknown (None, 0) for a policy that would not read them.
    uses_predictions: bool

    def plan(self, snapshot: Snapshot) -> Plan:
        """Decide which queued groups start now and where. Groups left out stay queued.

        New work goes only to healthy engines with a free slot (``free_samples > 0``): when
        no engine has one, the edges do not ask a policy that moves no running work."""
        ...


def sample_plan(placed: Mapping[tuple[str, str], Sequence[int]]) -> Plan:
    """The plan of a policy that places samples one by one: ``placed`` maps
    (group key, engine id) to the sample indices put there, in the order to run them."""
    return Plan(
        tuple(
            Assign(group_key, engine_id, tuple(indices))
            for (group_key, engine_id), indices in placed.items()
        )
    )


def _least_outstanding() -> Policy:
    from rollserve.scheduler.core.policies.least_outstanding import LeastOutstandingTokens

    return LeastOutstandingTokens()


def _least_loaded() -> Policy:
    from rollserve.scheduler.core.policies.least_loaded import LeastLoaded

    return LeastLoaded()


def _round_robin() -> Policy:
    from rollserve.scheduler.core.policies.round_robin import RoundRobin

    return RoundRobin()


def _cache_aware() -> Policy:
    from rollserve.scheduler.core.policies.cache_aware import CacheAware

    return CacheAware()


def _rl() -> Policy:
    from rollserve.scheduler.core.policies.rl import RLPolicy

    return RLPolicy()


_REGISTRY: dict[str, Callable[[], Policy]] = {
    "least_outstanding": _least_outstanding,
    "least_loaded": _least_loaded,
    "round_robin": _round_robin,
    "cache_aware": _cache_aware,
    "rl": _rl,
}

DEFAULT_POLICY = "least_outstanding"


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def create_policy(name: str) -> Policy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"policy {name!r} is unknown; known: {', '.join(policy_names())}"
        ) from None
    return factory()
