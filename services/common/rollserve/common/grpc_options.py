"""gRPC options every rollserve server takes.

gRPC's C core cancels a call (CANCELLED, with no reason) that arrives while more than
``grpc.server.max_pending_requests`` calls (1,000 by default; between it and the hard limit,
some at random) wait for the server's application to take them. A busy event loop takes them
late, so a burst passed it: a scheduler that starts as many Generate calls on an engine as it
holds (``max_num_seqs`` times the capacity factor: 1,280 at 1,024), or a fleet's heartbeats,
and the calls failed as if the engine (or the scheduler) had. 2,000 Generate streams at once
on one simulated engine: 196 cancelled by default, none with these options
(``tests/unit/test_grpc_options.py``)."""

from __future__ import annotations

MAX_PENDING_CALLS = 1 << 16  # calls arrived and not yet taken; each holds a few hundred bytes

PENDING_CALLS_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
)
