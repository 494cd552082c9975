"""The scheduler core: synchronous, no I/O. Policies are pure functions of a snapshot."""

from rollserve.scheduler.core.policy import Policy, create_policy, policy_names
from rollserve.scheduler.core.snapshot import Assign, EngineView, Plan, QueuedGroup, Snapshot

__all__ = [
    "Assign",
    "EngineView",
    "Plan",
    "Policy",
    "QueuedGroup",
    "Snapshot",
    "create_policy",
    "policy_names",
]
