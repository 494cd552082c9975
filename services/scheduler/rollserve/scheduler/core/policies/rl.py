"""rl: the product's policy. Longest predicted work first, each sample where it ends soonest.

In an RL step the makespan is set by the engine that finishes last, and with long-tailed
response lengths that is the engine holding the longest samples: every token of a sample
is one engine step, and a step is slower the more sequences (and context) it carries. So
the policy estimates, per engine, when it would finish, and places the longest work first,
each sample on the engine where the estimate after adding it is least.

Cost model
----------
An engine decodes every running sequence one token per step; a step costs
``base_s + per_seq_s * sequences + per_kv_token_s * attended KV tokens`` (vLLM's step on a
memory-bound accelerator: read the weights once, then per-sequence compute and KV reads),
and prefilling a prompt costs ``per_prefill_token_s`` per uncached token. For samples of
predicted lengths ``L_i`` and prompts ``p_i`` started together, summing that over the steps
gives the time the engine needs to finish them all::

    T = base_s * max(L_i) + per_seq_s * sum(L_i) + per_kv_token_s * sum(L_i * (p_i + L_i / 2))

The first term is the longest sample's own steps, the others the load it shares. An engine
already running work starts from its view: its predicted longest remaining sample, its
predicted outstanding tokens, and its KV in use (the KV term of running samples is
estimated as if they had equal remaining lengths). The coefficients are settings (the
default is a GPU-class engine, Llama-3-8B on one H100; in the simulator the bench passes
the simulated profile's).

Algorithm
---------
1. Every pending sample gets a predicted length ``L``: its own when the snapshot has one per
   sample (an oracle), else its group's ``predicted_len``, else ``default_len``; capped at
   ``max_tokens``.
2. Order the samples by (turn, priority, longest ``L`` first, arrival, index): longest
   predicted work first, so the tail starts at once and lands on the engines with the least
   load. (A turn is the fair share between runs, ``core.fairshare``: the same for all while one
   run has work, so then the longest work of the whole queue goes first.)
3. For each sample, among the healthy engines with a free slot and KV room, take the one
   whose ``T`` after adding it is least, counting the prefill of the prompt on engines that
   do not hold it (an engine holds a prompt when this policy sent it there recently): a
   group stays whole while that pays, and is split over engines when its samples' work
   outweighs the prefill saved. Ties go to an engine holding the prompt, then the lowest id.
4. KV room: the engine's KV in use, plus the growth predicted of its running samples, plus
   ``p + L`` of each sample this plan put there, must stay within ``kv_headroom`` of its KV
   capacity (when the view knows it). That keeps the predicted peak below capacity, so the
   engine does not preempt; an idle engine always takes one sample.
5. A sample that fits nowhere stays queued, and so does everything after it in that order
   (strict order: the longest work is never overtaken). With no
   free slot anywhere planning stops.
6. Count cap: no engine ends a plan with more than ``count_slack`` times its share of the
   samples (those running on the engines the plan may use, plus those it can place). The
   cost model takes an engine's longest sample to be its longest *predicted mean*, but the
   longest of many samples predicted alike lands far above their mean. Without the cap an
   engine given one sample predicted long looks busy for its whole length, and the samples
   predicted short pile onto the others (1 to 118 samples an engine were seen with the first
   epoch's prompts partly known); the cap spreads them. It binds only when a plan fills
   under about 1 / ``count_slack`` of the fleet's slots, and never below a whole group.

Deadlines: a trainer that over-samples and carries its tail over (``StepBatcher``) submits
each step's groups with the step as their priority, so running work of a lower priority
value than anything queued is carried-over work the current step must deliver: its end is
the step's end. With ``isolate_priorities`` on, queued samples are not placed on an engine
running such work while another engine has a free slot: new work would slow the step's
critical path (every sample on an engine shares its steps), and it can wait or run
elsewhere. Work of one priority (synchronous steps) is not affected.

Moving running samples (off by default)
---------------------------------------
Lengths vary within a group as much as across groups, so the longest samples of a step
are known only once they run: they are the ones still going when their siblings are done.
By then they may share an engine with other long samples while other engines idle, and
the step waits for the slowest of those engines. With ``move_running`` on, once a plan
has placed the whole queue, the policy looks at the running samples and moves the tail
apart (partial-rollout preemption: the sample stops, keeps its tokens, and resumes on the
target with prompt + partial response as its prompt):

6. Per engine, ``T`` from its running samples' predicted remaining lengths and contexts
   (``prompt + progress``), plus what this plan placed there.
7. Take the engine with the greatest ``T``. For each of its ``move_candidates`` samples
   with most predicted tokens left (and fewer than ``max_preemptions`` moves so far), weigh
   moving it to the engine with the least ``T`` that has a slot and KV room; that engine
   pays the prefill of the sample's whole context. Make the move that leaves the lesser of
   the two engines' ``T`` at most, if it cuts the greatest ``T`` by ``move_gain`` of it or
   more. Repeat, at most ``moves_per_plan`` times; stop at the first engine no move helps
   (the step's end is then set by it).

Samples with no prediction (``predicted_left`` 0) are not moved. The moves cost
O(running * moves_per_plan).

Measured in the simulator (S1, ``docs/policies.md``), moves guided by the length predictor
make steps slower, synchronous or over-sampled: it tells running samples of one group
apart only by their progress, so it moves the wrong ones. Told each running sample's true
remaining length (``bench policies``' ``rl_moves_told``), the same moves with ``move_gain``
1e-4 bring S1's step within 1.5% of the oracle; told it 10% off, within 5-10%; 25-50% off,
they can slow it. So they are off until a per-sample predictor that sharp exists (on the
trained reasoner not even a sample's own state gives one: ``rollserve bench remaining
--resample``); the mechanism (``Plan.preempts``) is there for it and for other policies.

Placing a sample costs O(log engines): engines whose longest sample is at least ``L`` are
ordered by ``T``, the others by ``T - base_s * longest`` (what ``T`` becomes when ``L`` is
their new longest), and as ``L`` falls engines move from the second heap to the first. A
plan that places ``s`` samples over ``e`` engines from a queue of ``g`` groups costs
O(e + g + s log e + s log s): the queue is gone over once, and only its first ``s + 1``
samples in order are picked out (a heap), not sorted whole.

Settings (:class:`RLSettings`)
------------------------------
- ``base_s`` (6.5e-3), ``per_seq_s`` (3.0e-5), ``per_kv_token_s`` (5.2e-8),
  ``per_prefill_token_s`` (5.0e-5): the cost model above, seconds; only their ratios matter.
- ``default_len`` (1024): predicted length of a sample with no prediction.
- ``kv_headroom`` (1.0): share of an engine's KV capacity a plan may fill by prediction.
- ``prefix_memory`` (65536): prompts whose engines are remembered, least recently placed
  forgotten first; ``prefix_engines`` (8): engines remembered per prompt.
- ``count_slack`` (1.25): the count cap of step 6, over an even share; 0 turns it off.
- ``isolate_priorities`` (True): keep new work off engines running more urgent work.
- ``move_running`` (False): move running samples apart as above.
- ``move_gain`` (0.05): the share of the greatest ``T`` a move must save.
- ``max_preemptions`` (2): moves of one sample, at most.
- ``moves_per_plan`` (16) and ``move_candidates`` (4): bounds of one plan's search.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

from rollserve.scheduler.core.policy import sample_plan
from rollserve.scheduler.core.snapshot import (
    EngineView,
    Plan,
    Preempt,
    QueuedGroup,
    RunningSample,
    Snapshot,
)


@dataclass(frozen=True)
class RLSettings:
    base_s: float = 6.5e-3
    per_seq_s: float = 3.0e-5
    per_kv_token_s: float = 5.2e-8
    per_prefill_token_s: float = 5.0e-5
    default_len: int = 1024
    kv_headroom: float = 1.0
    prefix_memory: int = 65536
    prefix_engines: int = 8
    isolate_priorities: bool = True
    move_running: bool = False
    count_slack: float = 1.25
    move_gain: float = 0.05
    max_preemptions: int = 2
    moves_per_plan: int = 16
    move_candidates: int = 4

    def __post_init__(self) -> None:
        for name in ("base_s", "per_seq_s", "per_kv_token_s", "per_prefill_token_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} ({value}) must be a finite number of seconds >= 0")
        if self.default_len < 1:
            raise ValueError(f"default_len ({self.default_len}) must be >= 1 token")
        if not (self.count_slack == 0 or 1 <= self.count_slack < math.inf):
            raise ValueError(f"count_slack ({self.count_slack}) must be 0 (off) or a finite >= 1")
        if not 0 < self.kv_headroom <= 1:
            raise ValueError(f"kv_headroom ({self.kv_headroom}) must be in (0, 1]")
        if self.prefix_memory < 0 or self.prefix_engines < 1:
            raise ValueError(
                f"prefix_memory ({self.prefix_memory}) must be >= 0 and prefix_engines "
                f"({self.prefix_engines}) >= 1"
            )
        if not 0 < self.move_gain < 1:
            raise ValueError(f"move_gain ({self.move_gain}) must be in (0, 1)")
        for name in ("max_preemptions", "moves_per_plan", "move_candidates"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")


# A run of samples in placement order: ((turn, priority, -predicted length, seq, first index,
# group key), their indices, their group); seq and the key make every sort key unique.
_Ordered = tuple[tuple[tuple[int, int], int, float, int, int, str], tuple[int, ...], QueuedGroup]


class _Engine:
    """One engine's predicted load while a plan is being made."""

    __slots__ = (
        "engine_id",
        "free",
        "idle",
        "inflight",
        "kv_budget",
        "kv_need",
        "longest",
        "rest",
        "version",
    )

    def __init__(self, view: EngineView, cfg: RLSettings) -> None:
        self.engine_id = view.engine_id
        self.free = view.free_samples
        self.inflight = view.inflight_samples  # running when the plan began
        self.idle = view.inflight_samples == 0
        # Predicted tokens still to generate; the upper bound when the view has no prediction.
        tokens = view.predicted_outstanding or float(view.outstanding_tokens)
        running = max(1, view.inflight_samples)
        self.longest = view.predicted_longest or (tokens if running == 1 else tokens / running)
        # The per-token terms of T: sum of L * (context + L / 2) as if every running sample
        # had tokens / running left.
        kv_steps = tokens * view.kv_used_tokens / running + tokens * tokens / (2 * running)
        self.rest = cfg.per_seq_s * tokens + cfg.per_kv_token_s * kv_steps
        cap = view.kv_capacity_tokens
        self.kv_budget = cfg.kv_headroom * cap if cap else math.inf
        self.kv_need = view.kv_used_tokens + tokens
        self.version = 0

    def fits(self, kv: float) -> bool:
        return self.free > 0 and (self.idle or self.kv_need + kv <= self.kv_budget)


class RLPolicy:
    name = "rl"
    whole_groups = False
    uses_predictions = True

    def __init__(self, settings: RLSettings | None = None) -> None:
        self.settings = settings or RLSettings()
        # Deadlines need only each engine's most urgent running priority (in its view);
        # the running samples themselves only to move them.
        self.moves_running = self.settings.move_running
        # prompt key -> engines it was sent to, most recent last; least recently placed first.
        self._holders: OrderedDict[str, list[str]] = OrderedDict()
        # Queued group key -> (its view, its entries, its samples queued), as of the last plan.
        self._kept: dict[str, tuple[QueuedGroup, list[_Ordered], int]] = {}

    def plan(self, snapshot: Snapshot) -> Plan:
        placed: dict[tuple[str, str], list[int]] = {}
        added: list[tuple[str, float, int]] = []  # (engine id, length, prompt length)
        whole = self._place(snapshot, placed, added)
        preempts: tuple[Preempt, ...] = ()
        if self.settings.move_running and whole and snapshot.running:
            preempts = self._moves(snapshot, added)
        return Plan(sample_plan(placed).assignments, preempts)

    def _place(
        self,
        snapshot: Snapshot,
        placed: dict[tuple[str, str], list[int]],
        added: list[tuple[str, float, int]],
    ) -> bool:
        """Places queued samples (steps 1-5) into ``placed`` and ``added``; whether every
        queued sample was placed."""
        cfg = self.settings
        engines = {
            e.engine_id: _Engine(e, cfg)
            for e in snapshot.engines
            if e.healthy and e.capacity_samples > 0 and e.free_samples > 0
        }
        if not snapshot.queue:
            return True
        if cfg.isolate_priorities:
            engines = _without_urgent_work(engines, snapshot)
        if not engines:
            return False
        entries, queued, widest = self._entries(snapshot.queue)
        if cfg.count_slack > 0:
            running = sum(e.inflight for e in engines.values())
            placeable = min(queued, sum(e.free for e in engines.values()))
            cap = math.ceil(cfg.count_slack * (running + placeable) / len(engines))
            cap = max(cap, widest)
            for engine in engines.values():
                engine.free = min(engine.free, max(0, cap - engine.inflight))
        # Each sample placed takes a free slot, and the first that finds none ends the plan:
        # only that many samples of the order are ever looked at.
        ordered = self._first(entries, sum(e.free for e in engines.values()) + 1)
        heaps = _Heaps(engines, cfg.base_s)
        for length, index, group in ordered:
            target = self._choose(group, length, engines, heaps)
            if target is None:
                # Strict order: nothing overtakes the longest work that does not fit.
                return False
            heaps.place(
                target,
                length,
                self._added(length, group.prompt_len),
                group.prompt_len + length,
            )
            placed.setdefault((group.key, target.engine_id), []).append(index)
            added.append((target.engine_id, length, group.prompt_len))
            self._remember(group.prompt_key or group.key, target.engine_id)
        return len(ordered) == queued

    def _moves(
        self, snapshot: Snapshot, added: list[tuple[str, float, int]]
    ) -> tuple[Preempt, ...]:
        """Running samples to move apart (steps 6-7)."""
        cfg = self.settings
        loads = {
            e.engine_id: _Load(e, cfg)
            for e in snapshot.engines
            if e.healthy and e.capacity_samples > 0
        }
        for sample in snapshot.running:
            load = loads.get(sample.engine_id)
            if load is not None:
                load.add(sample.predicted_left, sample.prompt_len + sample.progress, sample)
        for engine_id, length, prompt_len in added:
            loads[engine_id].add(length, prompt_len, None)
        out: list[Preempt] = []
        while len(out) < cfg.moves_per_plan and len(loads) > 1:
            source = max(loads.values(), key=lambda load: (load.finish(), load.engine_id))
            move = self._best_move(source, loads)
            if move is None:
                break
            entry, target = move
            source.remove(entry)
            target.add(entry[0], entry[1], None)
            moved = entry[2]
            assert moved is not None  # only running samples are candidates
            out.append(Preempt(moved.group_key, moved.index, moved.engine_id, target.engine_id))
        return tuple(out)

    def _best_move(self, source: _Load, loads: dict[str, _Load]) -> tuple[_Entry_, _Load] | None:
        """The move of one of ``source``'s longest samples that cuts its ``T`` by
        ``move_gain`` or more and leaves the lesser greatest ``T`` of source and target."""
        cfg = self.settings
        before = source.finish()
        if len(source.entries) < 2 or before <= 0:
            return None
        movable = sorted(
            (
                e
                for e in source.entries
                if e[2] is not None and e[0] > 0 and e[2].preemptions < cfg.max_preemptions
            ),
            key=lambda e: (-e[0], e[2].group_key if e[2] else "", e[2].index if e[2] else 0),
        )[: cfg.move_candidates]
        best: tuple[float, _Entry_, _Load] | None = None
        for entry in movable:
            length, context, _ = entry
            targets = [
                load for load in loads.values() if load is not source and load.fits(length, context)
            ]
            if not targets:
                return None
            target = min(
                targets, key=lambda load: (load.finish_with(length, context), load.engine_id)
            )
            after = max(
                source.finish_without(entry),
                target.finish_with(length, context) + cfg.per_prefill_token_s * context,
            )
            if after <= before * (1 - cfg.move_gain) and (best is None or after < best[0]):
                best = (after, entry, target)
        return None if best is None else (best[1], best[2])

    def _entries(self, queue: tuple[QueuedGroup, ...]) -> tuple[list[_Ordered], int, int]:
        """The queue's samples in runs of the placement order: (turn, priority, longest
        predicted first, seq, index); a group whose samples share one predicted length is one
        entry (its samples are next to each other in that order). With them, the samples
        queued and the most of one group.

        A deep queue changes little between plans and the runtime keeps the view of a group
        that did not change: a view's entries are kept while the same view comes back."""
        entries: list[_Ordered] = []
        queued = widest = 0
        kept = self._kept
        made: dict[str, tuple[QueuedGroup, list[_Ordered], int]] = {}
        for group in queue:
            known = kept.get(group.key)
            if known is None or known[0] is not group:
                known = (group, *self._group_entries(group))
            made[group.key] = known
            pending = known[2]
            if pending:
                queued += pending
                widest = max(widest, pending)
                entries.extend(known[1])
        self._kept = made
        return entries, queued, widest

    def _group_entries(self, group: QueuedGroup) -> tuple[list[_Ordered], int]:
        """One group's entries (``_entries``) and its samples queued."""
        pending = group.pending
        if not pending:
            return [], 0
        cap = float(group.max_tokens)
        if group.predicted_lens and len(group.predicted_lens) == len(pending):
            out: list[_Ordered] = []
            for index, length in zip(pending, group.predicted_lens, strict=True):
                neg = -max(1.0, min(float(length), cap))
                out.append(
                    (
                        (group.turn, group.priority, neg, group.seq, index, group.key),
                        (index,),
                        group,
                    )
                )
            return out, len(pending)
        guess = self.settings.default_len if group.predicted_len is None else group.predicted_len
        indices = pending if not group.samples else tuple(sorted(pending))
        neg = -max(1.0, min(float(guess), cap))
        key = (group.turn, group.priority, neg, group.seq, indices[0], group.key)
        return [(key, indices, group)], len(pending)

    @staticmethod
    def _first(entries: list[_Ordered], limit: int) -> list[tuple[float, int, QueuedGroup]]:
        """The first ``limit`` samples in placement order: (predicted length, index, group).
        Each entry holds a sample at least, so they lie in the first ``limit`` entries: a
        deep queue costs a pass and a heap of ``limit``, not a sort of every sample."""
        first = heapq.nsmallest(limit, entries) if limit < len(entries) else sorted(entries)
        out: list[tuple[float, int, QueuedGroup]] = []
        for key, indices, group in first:
            for index in indices:
                if len(out) == limit:
                    return out
                out.append((-key[2], index, group))
        return out

    def _added(self, length: float, prompt_len: int) -> float:
        """What a sample adds to an engine's per-token terms of T."""
        cfg = self.settings
        return cfg.per_seq_s * length + cfg.per_kv_token_s * length * (prompt_len + length / 2)

    def _choose(
        self, group: QueuedGroup, length: float, engines: dict[str, _Engine], heaps: _Heaps
    ) -> _Engine | None:
        """The engine where the sample ends soonest: the prompt's holders, and the best
        fitting engine of each heap (which pays the prefill unless it is a holder)."""
        kv = group.prompt_len + length
        prefill = self.settings.per_prefill_token_s * group.prompt_len
        holders = self._holders.get(group.prompt_key or group.key, [])
        best: tuple[float, int, str] | None = None
        for engine_id in holders:
            engine = engines.get(engine_id)
            if engine is not None and engine.fits(kv):
                key = (heaps.finish_with(engine, length), 0, engine_id)
                best = key if best is None or key < best else best
        for engine in heaps.best_fitting(length, kv):
            if engine.engine_id in holders:
                continue  # already weighed, without the prefill
            key = (heaps.finish_with(engine, length) + prefill, 1, engine.engine_id)
            best = key if best is None or key < best else best
        return None if best is None else engines[best[2]]

    def _remember(self, prompt_key: str, engine_id: str) -> None:
        cfg = self.settings
        if cfg.prefix_memory == 0:
            return
        engines = self._holders.pop(prompt_key, [])
        if engine_id in engines:
            engines.remove(engine_id)
        engines.append(engine_id)
        del engines[: -cfg.prefix_engines]
        self._holders[prompt_key] = engines
        while len(self._holders) > cfg.prefix_memory:
            self._holders.popitem(last=False)


def _without_urgent_work(engines: dict[str, _Engine], snapshot: Snapshot) -> dict[str, _Engine]:
    """``engines`` less those running work more urgent than anything queued, unless that
    leaves none."""
    first = min(group.priority for group in snapshot.queue)
    urgent = {
        e.engine_id
        for e in snapshot.engines
        if e.urgent_priority is not None and e.urgent_priority < first
    }
    rest = {engine_id: e for engine_id, e in engines.items() if engine_id not in urgent}
    return rest or engines


_Entry_ = tuple[float, int, RunningSample | None]  # (predicted left, context, the sample)


class _Load:
    """One engine's running samples, each with its predicted remaining tokens and context,
    and the ``T`` of the cost model over them (steps 6-7)."""

    __slots__ = ("cfg", "engine_id", "entries", "free", "kv_budget", "kv_need", "longest", "rest")

    def __init__(self, view: EngineView, cfg: RLSettings) -> None:
        self.cfg = cfg
        self.engine_id = view.engine_id
        self.entries: list[_Entry_] = []
        self.rest = 0.0  # the per-token terms of T
        self.longest = 0.0
        self.free = view.free_samples
        cap = view.kv_capacity_tokens
        self.kv_budget = cfg.kv_headroom * cap if cap else math.inf
        self.kv_need = 0.0

    def _terms(self, length: float, context: int) -> float:
        cfg = self.cfg
        return cfg.per_seq_s * length + cfg.per_kv_token_s * length * (context + length / 2)

    def add(self, length: float, context: int, sample: RunningSample | None) -> None:
        self.entries.append((length, context, sample))
        self.longest = max(self.longest, length)
        self.rest += self._terms(length, context)
        self.kv_need += context + length
        if sample is None:
            self.free -= 1

    def remove(self, entry: _Entry_) -> None:
        self.entries.remove(entry)
        if entry[0] >= self.longest:
            self.longest = max((e[0] for e in self.entries), default=0.0)
        self.rest -= self._terms(entry[0], entry[1])
        self.kv_need -= entry[1] + entry[0]
        self.free += 1

    def finish(self) -> float:
        return self.cfg.base_s * self.longest + self.rest

    def finish_without(self, entry: _Entry_) -> float:
        longest = max((e[0] for e in self.entries if e is not entry), default=0.0)
        return self.cfg.base_s * longest + self.rest - self._terms(entry[0], entry[1])

    def finish_with(self, length: float, context: int) -> float:
        longest = max(length, self.longest)
        return self.cfg.base_s * longest + self.rest + self._terms(length, context)

    def fits(self, length: float, context: int) -> bool:
        return self.free > 0 and (
            not self.entries or self.kv_need + context + length <= self.kv_budget
        )


_Entry = tuple[float, str, int]  # (key, engine id, engine version when pushed)


class _Heaps:
    """The engines by when they would finish, in lazy heaps (see the module docstring).

    ``long``: engines whose longest sample is at least the current sample's length, by
    ``T``. ``short``: the others, by ``rest`` (their ``T`` once the sample is their longest),
    and by longest, largest first, to move them to ``long`` as the samples get shorter.
    Samples come longest first, so an engine never moves back.
    """

    def __init__(self, engines: dict[str, _Engine], base_s: float) -> None:
        self._engines = engines
        self._base = base_s
        self._long: list[_Entry] = []
        self._short: list[_Entry] = []
        self._short_by_longest: list[_Entry] = []
        self._in_long: set[str] = set()
        self._length = math.inf
        for engine in engines.values():
            self._push(engine)

    def finish_with(self, engine: _Engine, length: float) -> float:
        """The engine's T if a sample of ``length`` joined it, less that sample's per-token
        terms (the same on every engine, so they do not change the choice)."""
        return self._base * max(engine.longest, length) + engine.rest

    def place(self, engine: _Engine, length: float, added: float, kv: float) -> None:
        engine.longest = max(engine.longest, length)
        engine.rest += added
        engine.kv_need += kv
        engine.free -= 1
        engine.idle = False
        engine.version += 1
        if engine.free > 0:
            self._push(engine)

    def best_fitting(self, length: float, kv: float) -> list[_Engine]:
        """The best engine of each heap that fits a sample of ``length`` and ``kv`` tokens."""
        self._length = length
        while self._short_by_longest:
            neg_longest, engine_id, version = self._short_by_longest[0]
            engine = self._engines[engine_id]
            if version != engine.version or engine_id in self._in_long:
                heapq.heappop(self._short_by_longest)
            elif -neg_longest >= length:
                heapq.heappop(self._short_by_longest)
                self._in_long.add(engine_id)
                heapq.heappush(
                    self._long, (self._base * engine.longest + engine.rest, engine_id, version)
                )
            else:
                break
        tops = (self._top(self._long, True, kv), self._top(self._short, False, kv))
        return [top for top in tops if top is not None]

    def _top(self, heap: list[_Entry], in_long: bool, kv: float) -> _Engine | None:
        aside: list[_Entry] = []
        found = None
        while heap:
            entry = heap[0]
            engine = self._engines[entry[1]]
            if entry[2] != engine.version or (entry[1] in self._in_long) != in_long:
                heapq.heappop(heap)  # stale
            elif engine.fits(kv):
                found = engine
                break
            else:
                aside.append(heapq.heappop(heap))  # no KV room for this sample
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _push(self, engine: _Engine) -> None:
        entry_id, version = engine.engine_id, engine.version
        if engine.longest >= self._length:
            self._in_long.add(entry_id)
            heapq.heappush(
                self._long, (self._base * engine.longest + engine.rest, entry_id, version)
            )
        else:
            self._in_long.discard(entry_id)
            heapq.heappush(self._short, (engine.rest, entry_id, version))
            heapq.heappush(self._short_by_longest, (-engine.longest, entry_id, version))
