"""least_loaded: each whole group to the engine with the least outstanding work.

A baseline, kept for comparison. It stands for the dispatch of OpenRLHF and ROLL, as
far as the two agree: the ``n`` samples of a prompt stay together on one engine, which
prefills the shared prompt once (OpenRLHF repeats each prompt ``n`` times and gives each
engine a contiguous slice of the batch; ROLL sends a prompt with
``num_return_sequences``), and the next prompt goes to the least loaded engine (ROLL's
``GenerateScheduler`` takes the DP rank with the fewest running requests, ties to the
lowest rank).

Algorithm
---------
The algorithm of ``least_outstanding`` (see its module for the steps), reused as is:
groups in (turn, priority, arrival) order, strict, no head-of-line bypass; each to the
healthy engine with room for all its samples (or an idle one) that has the fewest
outstanding tokens, ties to fewer in-flight samples, then to the lowest engine id;
the group's ``n * max_tokens`` is charged to that engine before the next group.

Where it differs from those systems: load is counted in outstanding tokens (the upper
bound ``n * max_tokens`` of each running group, less what it has generated) instead of
running requests. With one ``n`` and one ``max_tokens`` for the whole run, that count
is proportional to the running groups, less what they have generated so far; the
capacity check (room for all ``n`` samples) plays the part of ROLL's
``max_running_requests``. It has no settings.
"""

from __future__ import annotations

from rollserve.scheduler.core.policies.least_outstanding import LeastOutstandingTokens


class LeastLoaded(LeastOutstandingTokens):
    """``LeastOutstandingTokens`` under the name of the baseline it stands for."""

    name = "least_loaded"
