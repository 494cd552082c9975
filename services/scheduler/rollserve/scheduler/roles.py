"""What a token of the scheduler's tokens file may call, by the role its line names
(``role=``; a line that names none: ``admin``). ``runs=`` narrows a token further to the runs
whose id matches one of its globs (``rollserve.common.access``)."""

from __future__ import annotations

from rollserve.common.access import ADMIN, Role

__all__ = ["ROLES"]

TRAINER_CALLS = frozenset({"Submit", "Cancel", "Status", "PublishVersion", "DeleteRun"})

ROLES = {
    ADMIN: Role(),  # every call: operators, and the files written before roles
    "trainer": Role(TRAINER_CALLS),  # a trainer's own runs (narrow it with runs=)
    "engine": Role(frozenset({"RegisterEngine", "Heartbeat"})),  # engines joining the fleet
    "viewer": Role(frozenset({"Status"})),  # dashboards, `rollserve status`
}
