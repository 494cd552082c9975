"""A simulated vLLM engine: batches, caches prefixes and preempts as vLLM v1 does, in no time.

The engine runs in steps. ``step()`` schedules one forward pass the way vLLM v1's scheduler does
with chunked prefill off, advances every scheduled request by one token, and returns how long
that pass would take by the engine's :class:`~rollserve.sim.profile.CostProfile`. Nothing is
computed and nothing waits: the caller (the discrete-event loop) keeps the clock.

One step:

1. **Decode the running requests**, in admission order, one token each. A request holds KV
   slots for ``prompt_len + generated`` tokens; the next token needs one more, and a new block
   when that crosses a block boundary. When no block is free, unreferenced prefix-cache blocks
   are evicted, least recently used first; when none is left, the most recently admitted
   running request is **preempted** (recompute mode, vLLM v1's only one): all its blocks are
   released, it goes back to the waiting queue ahead of every later arrival of its priority (the
   front, when priorities are equal), keeps the tokens it generated, and on re-admission
   prefills ``prompt + generated`` again (``recomputed_tokens``). A step that preempts admits
   nobody, as in vLLM.
2. **Admit waiting requests** in (priority, arrival) order, lower priority first, while fewer than
   ``max_num_seqs`` run, the step's tokens (one per decode plus every prefilled token) stay
   within ``max_num_batched_tokens``, and the blocks for the request's context plus one token
   can be had (by eviction if need be). The first request that does not fit stops admission
   (head-of-line, as vLLM's FCFS queue). A step with nothing else in it admits its first
   request even when that request's prompt alone exceeds the token budget; with the profile's
   ``chunked_prefill``, so does a step whose only other work is decoding (vLLM would split
   that prefill over steps; the model charges it whole to this one). An admitted request
   prefills its whole prompt in this step and samples its first token.
3. **Finish** every request that reached ``min(output_len, max_tokens)`` tokens: ``stop`` when
   the sample ended by itself (``output_len <= max_tokens``), ``length`` when ``max_tokens`` cut
   it. Its blocks are released.

The step takes ``step_time(decode sequences, prefilled tokens, attended KV tokens)``, the last
being the sum of the decoding requests' context lengths (prompt plus tokens generated so far).
With speculative decoding in the profile, a step where it applies is that share of a
verification pass (see :mod:`rollserve.sim.profile`); it is counted in ``spec_steps``.

**Prefix cache**, block-granular as vLLM's: requests with the same non-empty ``prefix_id``
share their first ``prefix_len`` prompt tokens. The whole blocks of that prefix (at most up to
the prompt's last token, which is always computed, as in vLLM) are keyed ``(prefix_id, i)``.
On admission the longest run of them already cached is reused (a reference each, counted in
``cached_prompt_tokens``); the others are computed in this step and registered at once, so a
sibling admitted in the same step already hits them (vLLM v1 caches full blocks when it
allocates them). Requests may also share a first part across prompts (``system_id``,
``system_len``: a system prompt): those blocks are keyed ``(system_id, i)`` and the rest of the
prefix ``(prefix_id, i)``. Blocks past the shared prefix are private. A released shared block stays
cached; with no reference left it is evictable, the tail of a prefix before its head.

What the model leaves out: chunked prefill (a long prompt is one step's work), swap-mode
preemption (recompute only), the spread of speculative decoding's accepted tokens (each
sequence advances its mean), caching of blocks outside the declared
shared prefix (vLLM also caches a request's own full blocks, so a preempted request may find
some of them again; here it recomputes them), CPU-GPU overlap and async scheduling, sampling
costs that depend on the sampling parameters, and any randomness: the same calls give the same
results.

**Cost of a step**: O(log n) amortised in the running requests, not O(n) (a fleet-scale sweep
takes hundreds of thousands of steps). Every running request generates one token per step, so
its count is ``steps done - base`` and is never stored step by step; what a step needs is kept
as totals: the attended context is ``sum(prompt_len - base) + running * steps``; a request needs
a new block exactly when ``steps`` meets its residue ``(base - prompt_len) mod block_size``, so
one count per residue says how many blocks a step takes; a heap keyed by the step at which each
request reaches its target yields the finished, in admission order. Only a step that runs out
of blocks walks the running requests one by one (the preemption path, rare), and admission
costs O(prefix blocks) per request tried. ``tests/unit/sim_reference.py`` keeps the
straightforward version; ``test_sim_engine_equivalence.py`` checks both give the same results.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush

from rollserve.sim.profile import CostProfile, SpecDecoding

__all__ = ["EngineStats", "Finished", "SimEngine", "SimRequest", "StepResult"]

_BlockKey = tuple[str, int]  # (prefix_id, index of the block in the prefix)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One sample to generate, with the length it will have (the workload knows it)."""

    request_id: str
    prompt_len: int
    output_len: int  # the engine stops at min(output_len, max_tokens)
    max_tokens: int
    prefix_id: str = ""  # requests with the same non-empty prefix_id share their prefix
    prefix_len: int = 0  # the first prefix_len prompt tokens
    priority: int = 0  # lower first; FCFS within a priority
    # A prefix shared across prompts (a system prompt, few-shot examples): requests with the same
    # non-empty system_id share their first system_len tokens, whatever their prefix_id.
    system_id: str = ""
    system_len: int = 0
    # With speculative decoding in the profile: the mean tokens a verification pass advances
    # this sequence (its drafter's history of its prompt); None: the profile's accept_len. A
    # speculating step takes the mean over its decoding sequences.
    accept_len: float | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    output_tokens: int
    finish_reason: str  # "stop" (reached output_len) | "length" (reached max_tokens) | "abort"
    cached_prompt_tokens: int  # at its first admission
    preemptions: int
    spec_steps: int = 0  # steps in which it decoded and the engine speculated


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float
    finished: tuple[Finished, ...]
    decode_seqs: int
    prefill_tokens: int  # uncached prompt (and recomputed) tokens prefilled in this step
    preempted: tuple[str, ...]


@dataclass
class EngineStats:
    steps: int = 0
    busy_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption or a weight update
    weight_updates: int = 0
    spec_steps: int = 0  # steps that speculated (each a share of a verification pass)
    spec_seq_steps: int = 0  # decoding sequences summed over those steps

    def spec_counters(self, spec: SpecDecoding | None) -> tuple[int, int, int]:
        """vLLM's speculative counters as this engine's speculation would have made them
        (:meth:`SpecDecoding.counters` of all its sequence-steps of speculation)."""
        return (0, 0, 0) if spec is None else spec.counters(self.spec_seq_steps)


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

    def drop_cached(self) -> None:
        """Forgets every cached block; none may be referenced."""
        if len(self.lru) != len(self.refs):
            raise RuntimeError("the prefix cache cannot be dropped while blocks are in use")
        self.free += len(self.lru)
        self.refs.clear()
        self.lru.clear()

    def release(self, shared: Sequence[_BlockKey], private: int) -> None:
        self.free += private
        for key in reversed(shared):  # the tail of a prefix becomes evictable first
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.lru[key] = None


@dataclass(eq=False, slots=True)
class _Seq:
    """A request inside the engine: its progress and the blocks it holds.

    While it runs (``slot >= 0``) its token count is ``engine steps - base`` and ``generated``
    is stale; otherwise ``generated`` holds it. It holds ``_blocks_for(context)`` blocks, the
    ``shared`` ones and the rest private, so the private ones are never counted step by step.
    """

    request: SimRequest
    arrival: int
    target: int  # min(output_len, max_tokens)
    keys: tuple[_BlockKey, ...]  # the shareable blocks of its prefix
    generated: int = 0
    base: int = 0
    slot: int = -1  # admission number while running, -1 otherwise
    shared: list[_BlockKey] = field(default_factory=list)
    admitted: bool = False
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    spec_base: int = 0  # the engine's speculating steps when it last started running
    spec_steps: int = 0  # speculating steps it decoded in, before it last started

    def order(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)

    def outcome(self, reason: str) -> Finished:
        return Finished(
            self.request.request_id,
            self.generated,
            reason,
            self.cached_prompt_tokens,
            self.preemptions,
            self.spec_steps,
        )


class SimEngine:
    """One simulated vLLM engine; see the module docstring for the model."""

    def __init__(self, engine_id: str, profile: CostProfile) -> None:
        self.engine_id = engine_id
        self.profile = profile
        self.stats = EngineStats()
        self._pool = _BlockPool(profile.num_blocks)
        self._running: dict[_Seq, None] = {}  # admission order
        self._waiting: list[_Seq] = []  # (priority, arrival) order
        self._seqs: dict[str, _Seq] = {}
        self._arrivals = 0
        self._admissions = 0
        self._steps = 0  # steps done: a running request has generated steps - base tokens
        self._accept_sum = 0  # running requests' accept_len, millionths (_accept_micro)
        self._per_seq_accept = False  # some request brought its own accept_len
        self._spec_steps = 0  # steps that speculated: a running request decoded in
        # _spec_steps - spec_base of them since it last started
        # Running totals over the running requests:
        self._ends: list[tuple[int, int, _Seq]] = []  # (step count when done, slot, seq); lazy
        self._crossing: dict[int, int] = {}  # (base - prompt_len) % block_size -> requests
        self._offset = 0  # sum of prompt_len - base

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
        if seq is None:
            return 0
        return self._steps - seq.base if seq.slot >= 0 else seq.generated

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
        if request.accept_len is not None:
            spec = self.profile.spec
            top = spec.proposed + 1 if spec is not None else 1.0
            if not (math.isfinite(request.accept_len) and 1 <= request.accept_len <= top):
                raise ValueError(
                    f"{where}: accept_len ({request.accept_len}) must be between 1 and {top:g}"
                )
            self._per_seq_accept = True
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
        seq = _Seq(
            request,
            self._arrivals,
            min(request.output_len, request.max_tokens),
            self._shared_keys(request),
        )
        self._arrivals += 1
        self._seqs[rid] = seq
        insort(self._waiting, seq, key=_Seq.order)

    def abort(self, request_id: str) -> Finished | None:
        """Removes a waiting or running request and frees its blocks; None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.slot >= 0:
            self._stop(seq)
        else:
            self._waiting.remove(seq)
        return seq.outcome("abort")

    def new_weights(self) -> int:
        """New weights are in, as vLLM's reload followed by ``reset_prefix_cache(
        reset_running_requests=True)`` leaves it: every running request gives its blocks up
        and waits again (ahead of later arrivals of its priority), keeping its tokens, which
        it prefills again on re-admission (``recomputed_tokens``); the prefix cache is
        emptied. Returns how many requests were running."""
        running = list(self._running)
        for seq in running:
            self._stop(seq)
            insort(self._waiting, seq, key=_Seq.order)
        self._pool.drop_cached()
        self.stats.weight_updates += 1
        return len(running)

    def step(self) -> StepResult:
        """One engine step: decode the running, admit the waiting, finish the done."""
        if not self.has_work():
            raise RuntimeError(f"engine {self.engine_id}: step() with no request; check has_work()")
        profile = self.profile
        steps = self._steps

        # 1. Decode: the running requests whose context sits on a block boundary take a block.
        preempted: list[str] = []
        if self._running:
            crossing = self._crossing.get(steps % profile.block_size, 0)
            pool = self._pool
            if crossing <= pool.free:  # the common case, allocate() without the call
                pool.free -= crossing
            elif not pool.allocate(crossing):
                self._decode_short_of_blocks(preempted)
        decode_seqs = len(self._running)
        attended = self._offset + decode_seqs * steps
        speculates = profile.spec is not None and profile.spec.applies(decode_seqs)
        accept = None
        if speculates:  # before admitting: this step's new requests do not decode in it
            self._spec_steps += 1
            if self._per_seq_accept:
                accept = self._accept_sum / (1_000_000 * decode_seqs)

        # 2. Admit.
        admitted = 0
        prefill_tokens = 0
        waiting = self._waiting
        if not preempted:
            while waiting and len(self._running) < profile.max_num_seqs:
                seq = waiting[0]
                tokens = self._admit(
                    seq, budget_used=decode_seqs + prefill_tokens, first=admitted == 0
                )
                if tokens is None:
                    break
                waiting.pop(0)
                self._start(seq)
                admitted += 1
                prefill_tokens += tokens

        duration = profile.step_time(decode_seqs, prefill_tokens, attended, accept)
        steps += 1
        self._steps = steps

        # 3. Finish, in admission order (the heap's tie-break).
        finished: list[Finished] = []
        ends = self._ends
        while ends and ends[0][0] <= steps:
            _, slot, seq = heappop(ends)
            if seq.slot != slot:  # preempted or aborted since
                continue
            self._stop(seq)
            del self._seqs[seq.request.request_id]
            reason = "stop" if seq.request.output_len <= seq.request.max_tokens else "length"
            finished.append(seq.outcome(reason))

        self.stats.steps += 1
        if speculates:
            self.stats.spec_steps += 1
            self.stats.spec_seq_steps += decode_seqs
        self.stats.busy_s += duration
        self.stats.generated_tokens += decode_seqs + admitted
        return StepResult(
            duration_s=duration,
            finished=tuple(finished),
            decode_seqs=decode_seqs,
            prefill_tokens=prefill_tokens,
            preempted=tuple(preempted),
        )

    def _decode_short_of_blocks(self, preempted: list[str]) -> None:
        """The decode phase when the blocks to take exceed the free and evictable ones: one
        request at a time in admission order, preempting the most recently admitted when a
        block cannot be had (the reference loop; O(running), only when KV runs out)."""
        block_size = self.profile.block_size
        steps = self._steps
        order = list(self._running)
        index = 0
        while index < len(order):
            seq = order[index]
            crosses = (seq.request.prompt_len + steps - seq.base) % block_size == 0
            if not crosses or self._pool.allocate(1):
                index += 1
                continue
            victim = order.pop()  # the most recently admitted; may be seq itself
            self._stop(victim)
            victim.preemptions += 1
            self.stats.preemptions += 1
            insort(self._waiting, victim, key=_Seq.order)
            preempted.append(victim.request.request_id)

    def _accept_micro(self, seq: _Seq) -> int:
        """The sequence's accept_len in millionths (an integer: the running sum does not
        drift)."""
        spec = self.profile.spec
        accept = seq.request.accept_len
        if accept is None:
            accept = spec.accept_len if spec is not None else 1.0
        return round(accept * 1_000_000)

    def _start(self, seq: _Seq) -> None:
        """Makes an admitted request run: it has ``generated`` tokens now, one more per step."""
        self._accept_sum += self._accept_micro(seq)
        prompt_len = seq.request.prompt_len
        seq.base = base = self._steps - seq.generated
        seq.slot = slot = self._admissions
        seq.spec_base = self._spec_steps
        self._admissions += 1
        self._running[seq] = None
        heappush(self._ends, (base + seq.target, slot, seq))
        residue = (base - prompt_len) % self.profile.block_size
        self._crossing[residue] = self._crossing.get(residue, 0) + 1
        self._offset += prompt_len - base

    def _stop(self, seq: _Seq) -> None:
        """Takes a request out of the running ones (finished, preempted or aborted), fixing its
        token count and releasing its blocks."""
        self._accept_sum -= self._accept_micro(seq)
        prompt_len = seq.request.prompt_len
        base = seq.base
        seq.generated = self._steps - base
        seq.spec_steps += self._spec_steps - seq.spec_base
        seq.slot = -1
        del self._running[seq]
        self._crossing[(base - prompt_len) % self.profile.block_size] -= 1
        self._offset -= prompt_len - base
        blocks = _blocks_for(prompt_len + seq.generated, self.profile.block_size)
        self._pool.release(seq.shared, blocks - len(seq.shared))
        seq.shared = []

    def _shared_keys(self, request: SimRequest) -> tuple[_BlockKey, ...]:
        # The prompt's last token is always computed (vLLM caps a cache hit one token short).
        last, size = request.prompt_len - 1, self.profile.block_size
        system = min(request.system_len, last) // size if request.system_id else 0
        own = min(request.prefix_len, last) // size if request.prefix_id else 0
        return tuple((request.system_id, i) for i in range(system)) + tuple(
            (request.prefix_id, i) for i in range(system, own)
        )

    def _admit(self, seq: _Seq, budget_used: int, first: bool) -> int | None:
        """Gives a waiting request its blocks; returns the tokens it prefills, or None if it
        does not fit in this step (token budget or KV). ``first``: no request was admitted
        into this step yet."""
        profile = self.profile
        pool = self._pool
        block_size = profile.block_size
        keys = seq.keys
        context = seq.request.prompt_len + seq.generated
        # May exceed the budget: alone in the step, or the step's first prefill (chunked).
        over_ok = budget_used == 0 or (first and profile.chunked_prefill)
        blocks = _blocks_for(context + 1, block_size)
        # Cheap bounds first (a blocked head of the queue is tried every step): even with every
        # prefix block cached (and none to pin), the request would not fit.
        if not over_ok and budget_used + context - len(keys) * block_size > (
            profile.max_num_batched_tokens
        ):
            return None
        if blocks - len(keys) > pool.free + len(pool.lru):
            return None
        hit_count = pool.cached_run(keys)
        hits = keys[:hit_count]
        cached = hit_count * block_size
        tokens = context - cached
        if budget_used + tokens > profile.max_num_batched_tokens and not over_ok:
            return None
        need = blocks - hit_count
        if not pool.can_allocate(need, hits):
            return None
        pool.touch(hits)
        pool.allocate(need)
        seq.shared = list(hits)
        for key in keys[hit_count:]:
            if pool.register(key):
                seq.shared.append(key)
        if seq.admitted:
            self.stats.recomputed_tokens += tokens
        else:
            seq.admitted = True
            seq.cached_prompt_tokens = cached
            self.stats.prompt_tokens += seq.request.prompt_len
            self.stats.cached_prompt_tokens += cached
        return tokens
