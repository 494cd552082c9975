"""The simulated vLLM engine as first written: plain, O(batch) per step, obviously the model.

:class:`ReferenceSimEngine` is the code :class:`rollserve.sim.engine_model.SimEngine` started
from, kept here (not in the package) as the oracle of ``test_sim_engine_equivalence.py``: the
fast engine must give the same ``StepResult``s, stats and progress on every workload. It shares
the result types of the real module so that results compare equal; everything else (block pool,
per-request state, scheduling) is its own. The model itself is described in
``rollserve.sim.engine_model``'s docstring.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollserve.sim.engine_model import EngineStats, Finished, SimRequest, StepResult
from rollserve.sim.profile import CostProfile

__all__ = ["ReferenceSimEngine"]

_BlockKey = tuple[str, int]  # (prefix_id, index of the block in the prefix)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _BlockPool:
    """KV blocks: free ones, private ones (only counted) and prefix-cache ones (by key).

    A cached block with references belongs to running requests; one without is evictable and
    waits in ``lru``, oldest first. ``allocate`` says "can't" by returning False and changes
    nothing then; the engine decides whom to preempt.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = num_blocks
        self.refs: dict[_BlockKey, int] = {}
        self.lru: OrderedDict[_BlockKey, None] = OrderedDict()

    @property
    def used(self) -> int:
        """Blocks held by running requests (a shared block once)."""
        return self.num_blocks - self.free - len(self.lru)

    def cached_run(self, keys: Sequence[_BlockKey]) -> int:
        """How many of ``keys``, from the first, are cached."""
        for count, key in enumerate(keys):
            if key not in self.refs:
                return count
        return len(keys)

    def can_allocate(self, count: int, touching: Sequence[_BlockKey]) -> bool:
        """Whether ``count`` new blocks can be had once the cached ``touching`` are referenced."""
        pinned = sum(1 for key in touching if key in self.lru)
        return count <= self.free + len(self.lru) - pinned

    def touch(self, keys: Sequence[_BlockKey]) -> None:
        for key in keys:
            if self.refs[key] == 0:
                del self.lru[key]
            self.refs[key] += 1

    def allocate(self, count: int) -> bool:
        """Takes ``count`` blocks, free ones first, then evicting the least recently used."""
        if count > self.free + len(self.lru):
            return False
        taken = min(count, self.free)
        self.free -= taken
        for _ in range(count - taken):
            key, _ = self.lru.popitem(last=False)
            del self.refs[key]
        return True

    def register(self, key: _BlockKey) -> bool:
        """Makes an allocated block the cached block ``key``; False if one is cached already."""
        if key in self.refs:
            return False
        self.refs[key] = 1
        return True

    def release(self, shared: Sequence[_BlockKey], private: int) -> None:
        self.free += private
        for key in reversed(shared):  # the tail of a prefix becomes evictable first
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.lru[key] = None


@dataclass(eq=False, slots=True)
class _Seq:
    """A request inside the engine: its progress and the blocks it holds."""

    request: SimRequest
    arrival: int
    target: int  # min(output_len, max_tokens)
    generated: int = 0
    shared: list[_BlockKey] = field(default_factory=list)
    private_blocks: int = 0
    admitted: bool = False
    cached_prompt_tokens: int = 0
    preemptions: int = 0

    @property
    def context(self) -> int:
        """Tokens whose KV slots the request holds: its prompt and what it generated."""
        return self.request.prompt_len + self.generated

    @property
    def blocks(self) -> int:
        return len(self.shared) + self.private_blocks

    def order(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)

    def outcome(self, reason: str) -> Finished:
        return Finished(
            self.request.request_id,
            self.generated,
            reason,
            self.cached_prompt_tokens,
            self.preemptions,
        )


class ReferenceSimEngine:
    """The straightforward engine: O(batch) Python work per step; the model of
    :class:`rollserve.sim.engine_model.SimEngine`, which must give exactly the same results."""

    def __init__(self, engine_id: str, profile: CostProfile) -> None:
        self.engine_id = engine_id
        self.profile = profile
        self.stats = EngineStats()
        self._pool = _BlockPool(profile.num_blocks)
        self._running: list[_Seq] = []  # admission order
        self._waiting: list[_Seq] = []  # (priority, arrival) order
        self._seqs: dict[str, _Seq] = {}
        self._arrivals = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used_tokens(self) -> int:
        """KV blocks held by running requests, in tokens (a shared block counts once)."""
        return self._pool.used * self.profile.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        """The usable KV cache: the profile's capacity in whole blocks, in tokens."""
        return self._pool.num_blocks * self.profile.block_size

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def progress(self, request_id: str) -> int:
        """Tokens generated so far: 0 for an unknown or never admitted request; a preempted
        request waiting to resume keeps its count."""
        seq = self._seqs.get(request_id)
        return seq.generated if seq is not None else 0

    def add(self, request: SimRequest) -> None:
        rid = request.request_id
        where = f"engine {self.engine_id}: request {rid!r}"
        if rid in self._seqs:
            raise ValueError(f"{where} is already here")
        for name in ("prompt_len", "output_len", "max_tokens"):
            value = getattr(request, name)
            if value < 1:
                raise ValueError(f"{where}: {name} ({value}) must be at least 1")
        if not 0 <= request.prefix_len <= request.prompt_len:
            raise ValueError(
                f"{where}: prefix_len ({request.prefix_len}) must be between 0 and "
                f"prompt_len ({request.prompt_len})"
            )
        if request.prefix_len and not request.prefix_id:
            raise ValueError(f"{where}: prefix_len ({request.prefix_len}) needs a prefix_id")
        if not 0 <= request.system_len <= request.prompt_len:
            raise ValueError(
                f"{where}: system_len ({request.system_len}) must be between 0 and "
                f"prompt_len ({request.prompt_len})"
            )
        if request.system_len and not request.system_id:
            raise ValueError(f"{where}: system_len ({request.system_len}) needs a system_id")
        if request.prompt_len + request.max_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"{where}: prompt_len ({request.prompt_len}) + max_tokens "
                f"({request.max_tokens}) exceeds the KV capacity ({self.kv_capacity_tokens} "
                "tokens); lower max_tokens or use a profile with more KV"
            )
        seq = _Seq(request, self._arrivals, min(request.output_len, request.max_tokens))
        self._arrivals += 1
        self._seqs[rid] = seq
        insort(self._waiting, seq, key=_Seq.order)

    def abort(self, request_id: str) -> Finished | None:
        """Removes a waiting or running request and frees its blocks; None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        return seq.outcome("abort")

    def new_weights(self) -> int:
        running, self._running = self._running, []
        for seq in running:
            self._release(seq)
            insort(self._waiting, seq, key=_Seq.order)
        pool = self._pool
        assert all(count == 0 for count in pool.refs.values())
        pool.free += len(pool.refs)
        pool.refs.clear()
        pool.lru.clear()
        self.stats.weight_updates += 1
        return len(running)

    def step(self) -> StepResult:
        """One engine step: decode the running, admit the waiting, finish the done."""
        if not self.has_work():
            raise RuntimeError(f"engine {self.engine_id}: step() with no request; check has_work()")
        profile = self.profile

        decoding: list[_Seq] = []
        preempted: list[str] = []
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            if self._grow(seq):
                decoding.append(seq)
                index += 1
                continue
            victim = self._running.pop()  # the most recently admitted; may be seq itself
            self._preempt(victim)
            preempted.append(victim.request.request_id)

        admitted: list[_Seq] = []
        prefill_tokens = 0
        while not preempted and self._waiting and len(self._running) < profile.max_num_seqs:
            seq = self._waiting[0]
            tokens = self._admit(
                seq, budget_used=len(decoding) + prefill_tokens, first=not admitted
            )
            if tokens is None:
                break
            self._waiting.pop(0)
            self._running.append(seq)
            admitted.append(seq)
            prefill_tokens += tokens

        attended = sum(seq.context for seq in decoding)
        duration = profile.step_time(len(decoding), prefill_tokens, attended)
        for seq in decoding:
            seq.generated += 1
        for seq in admitted:
            seq.generated += 1

        finished: list[Finished] = []
        still: list[_Seq] = []
        for seq in self._running:
            if seq.generated < seq.target:
                still.append(seq)
                continue
            self._release(seq)
            del self._seqs[seq.request.request_id]
            reason = "stop" if seq.request.output_len <= seq.request.max_tokens else "length"
            finished.append(seq.outcome(reason))
        self._running = still

        self.stats.steps += 1
        self.stats.busy_s += duration
        self.stats.generated_tokens += len(decoding) + len(admitted)
        return StepResult(
            duration_s=duration,
            finished=tuple(finished),
            decode_seqs=len(decoding),
            prefill_tokens=prefill_tokens,
            preempted=tuple(preempted),
        )

    def _shared_keys(self, request: SimRequest) -> list[_BlockKey]:
        # The prompt's last token is always computed (vLLM caps a cache hit one token short).
        last, size = request.prompt_len - 1, self.profile.block_size
        system = min(request.system_len, last) // size if request.system_id else 0
        own = min(request.prefix_len, last) // size if request.prefix_id else 0
        keys = [(request.system_id, i) for i in range(system)]
        return keys + [(request.prefix_id, i) for i in range(system, own)]

    def _grow(self, seq: _Seq) -> bool:
        """Reserves the KV slot of a decoding request's next token; False if no block is left."""
        need = _blocks_for(seq.context + 1, self.profile.block_size) - seq.blocks
        if not self._pool.allocate(need):
            return False
        seq.private_blocks += need
        return True

    def _admit(self, seq: _Seq, budget_used: int, first: bool) -> int | None:
        """Gives a waiting request its blocks; returns the tokens it prefills, or None if it
        does not fit in this step (token budget or KV)."""
        profile = self.profile
        keys = self._shared_keys(seq.request)
        hits = keys[: self._pool.cached_run(keys)]
        cached = len(hits) * profile.block_size
        tokens = seq.context - cached
        over_ok = budget_used == 0 or (first and profile.chunked_prefill)
        if budget_used + tokens > profile.max_num_batched_tokens and not over_ok:
            return None
        need = _blocks_for(seq.context + 1, profile.block_size) - len(hits)
        if not self._pool.can_allocate(need, hits):
            return None
        self._pool.touch(hits)
        self._pool.allocate(need)
        seq.shared = list(hits)
        seq.private_blocks = need
        for key in keys[len(hits) :]:
            if self._pool.register(key):
                seq.shared.append(key)
                seq.private_blocks -= 1
        if seq.admitted:
            self.stats.recomputed_tokens += tokens
        else:
            seq.admitted = True
            seq.cached_prompt_tokens = cached
            self.stats.prompt_tokens += seq.request.prompt_len
            self.stats.cached_prompt_tokens += cached
        return tokens

    def _release(self, seq: _Seq) -> None:
        self._pool.release(seq.shared, seq.private_blocks)
        seq.shared = []
        seq.private_blocks = 0

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.preemptions += 1
        self.stats.preemptions += 1
        insort(self._waiting, seq, key=_Seq.order)
