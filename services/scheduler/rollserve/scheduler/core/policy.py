"""The policy interface and its factory.

A policy is a pure function from a :class:`Snapshot` to a :class:`Plan`. It may keep
its own bookkeeping between calls (a cursor, a history), but never does I/O. A new
policy is a new file under ``policies/`` registered in ``_REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rollserve.scheduler.core.snapshot import Plan, Snapshot


class Policy(Protocol):
    name: str
    # True when every Assign of the policy places all pending samples of its group; a
    # policy that places samples one by one (or splits groups) sets it False.
    whole_groups: bool

    def plan(self, snapshot: Snapshot) -> Plan:
        """Decide which queued groups start now and where. Groups left out stay queued."""
        ...


def _least_outstanding() -> Policy:
    from rollserve.scheduler.core.policies.least_outstanding import LeastOutstandingTokens

    return LeastOutstandingTokens()


_REGISTRY: dict[str, Callable[[], Policy]] = {
    "least_outstanding": _least_outstanding,
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
