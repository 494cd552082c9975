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
2. Order the samples by (priority, longest ``L`` first, arrival, index): longest predicted
   work first, so the tail starts at once and lands on the engines with the least load.
3. For each sample, among the healthy engines with a free slot and KV room, take the one
   whose ``T`` after adding it is least, counting the prefill of the prompt on engines that
   do not hold it (an engine holds a prompt when this policy sent it there recently): a
   group stays whole while that pays, and is split over engines when its samples' work
   outweighs the prefill saved. Ties go to an engine holding the prompt, then the lowest id.
4. KV room: the engine's KV in use, plus the growth predicted of its running samples, plus
   ``p + L`` of each sample this plan put there, must stay within ``kv_headroom`` of its KV
   capacity (when the view knows it). That keeps the predicted peak below capacity, so the
   engine does not preempt; an idle engine always takes one sample.
5. A sample that fits nowhere stays queued, and so does everything after it of the same or
   a higher priority value (strict order: the longest work is never overtaken). With no
   free slot anywhere planning stops.

Placing a sample costs O(log engines): engines whose longest sample is at least ``L`` are
ordered by ``T``, the others by ``T - base_s * longest`` (what ``T`` becomes when ``L`` is
their new longest), and as ``L`` falls engines move from the second heap to the first. A
plan of ``s`` samples over ``e`` engines costs O(e + s log e).

Settings (:class:`RLSettings`)
------------------------------
- ``base_s`` (6.5e-3), ``per_seq_s`` (3.0e-5), ``per_kv_token_s`` (5.2e-8),
  ``per_prefill_token_s`` (5.0e-5): the cost model above, seconds; only their ratios matter.
- ``default_len`` (1024): predicted length of a sample with no prediction.
- ``kv_headroom`` (1.0): share of an engine's KV capacity a plan may fill by prediction.
- ``prefix_memory`` (65536): prompts whose engines are remembered, least recently placed
  forgotten first; ``prefix_engines`` (8): engines remembered per prompt.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

from rollserve.scheduler.core.policy import sample_plan
from rollserve.scheduler.core.snapshot import EngineView, Plan, QueuedGroup, Snapshot


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

    def __post_init__(self) -> None:
        for name in ("base_s", "per_seq_s", "per_kv_token_s", "per_prefill_token_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} ({value}) must be a finite number of seconds >= 0")
        if self.default_len < 1:
            raise ValueError(f"default_len ({self.default_len}) must be >= 1 token")
        if not 0 < self.kv_headroom <= 1:
            raise ValueError(f"kv_headroom ({self.kv_headroom}) must be in (0, 1]")
        if self.prefix_memory < 0 or self.prefix_engines < 1:
            raise ValueError(
                f"prefix_memory ({self.prefix_memory}) must be >= 0 and prefix_engines "
                f"({self.prefix_engines}) >= 1"
            )


class _Engine:
    """One engine's predicted load while a plan is being made."""

    __slots__ = ("engine_id", "free", "idle", "kv_budget", "kv_need", "longest", "rest", "version")

    def __init__(self, view: EngineView, cfg: RLSettings) -> None:
        self.engine_id = view.engine_id
        self.free = view.free_samples
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
    moves_running = False

    def __init__(self, settings: RLSettings | None = None) -> None:
        self.settings = settings or RLSettings()
        # prompt key -> engines it was sent to, most recent last; least recently placed first.
        self._holders: OrderedDict[str, list[str]] = OrderedDict()

    def plan(self, snapshot: Snapshot) -> Plan:
        cfg = self.settings
        engines = {
            e.engine_id: _Engine(e, cfg)
            for e in snapshot.engines
            if e.healthy and e.capacity_samples > 0 and e.free_samples > 0
        }
        if not engines or not snapshot.queue:
            return Plan()
        heaps = _Heaps(engines, cfg.base_s)
        placed: dict[tuple[str, str], list[int]] = {}
        for _priority, neg_len, _seq, index, group in self._ordered(snapshot.queue):
            length = -neg_len
            target = self._choose(group, length, engines, heaps)
            if target is None:
                # Strict order: nothing overtakes the longest work that does not fit.
                break
            added = self._added(length, group.prompt_len)
            heaps.place(target, length, added, group.prompt_len + length)
            placed.setdefault((group.key, target.engine_id), []).append(index)
            self._remember(group.prompt_key or group.key, target.engine_id)
        return sample_plan(placed)

    def _ordered(
        self, queue: tuple[QueuedGroup, ...]
    ) -> list[tuple[int, float, int, int, QueuedGroup]]:
        cfg = self.settings
        out = []
        for group in queue:
            pending = group.pending
            if group.predicted_lens and len(group.predicted_lens) == len(pending):
                lengths: tuple[float, ...] = group.predicted_lens
            else:
                guess = cfg.default_len if group.predicted_len is None else group.predicted_len
                lengths = (guess,) * len(pending)
            for index, length in zip(pending, lengths, strict=True):
                capped = max(1.0, min(float(length), float(group.max_tokens)))
                out.append((group.priority, -capped, group.seq, index, group))
        out.sort(key=lambda item: item[:4])
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
