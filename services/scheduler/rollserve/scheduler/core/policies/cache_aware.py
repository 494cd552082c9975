"""cache_aware: per request, prefix affinity while the load is balanced, else least loaded.

A baseline, kept for comparison. It is the algorithm of the SGLang router's
``cache_aware`` policy (sgl-router ``policies/cache_aware.rs``; vllm-router inherits
it), with its default settings. Every sample is one request, as the trainers in front
of such a router send them, so the ``n`` samples of a group are routed one by one.

Algorithm
---------
The router keeps, per engine, an approximate prefix tree of the prompts it sent
there: not the engine's real KV cache, only what the router remembers routing. For
each request (queue in (turn, priority, arrival) order, pending samples in index order):

1. Load: the in-flight requests of each healthy engine, counting what this plan has
   already placed. The load is imbalanced when both
   ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold * min_load``.
2. Imbalanced: send the request to the least loaded engine.
3. Balanced: find the engine whose tree shares the longest prefix with the prompt. If
   ``match_len / prompt_len > cache_threshold``, send it there (it likely holds the
   prefix); otherwise send it to the engine with the smallest tree (SGLang: "the
   smallest tree size", the one with most cache to spare).
4. Insert the prompt into the chosen engine's tree (in both cases) and count the
   request in its load.

Candidates are the healthy engines with a free slot (``free_samples``, less what this
plan placed); when none is left, planning stops and the rest stays queued. Ties go to
the lowest engine id, so the plan is deterministic. The plan holds one ``Assign`` per
(group, engine) pair with the sample indices placed there.

Settings (constructor arguments)
--------------------------------
- ``cache_threshold = 0.5``: least prefix match ratio (matched / prompt tokens) that
  routes a request to the engine holding the match; SGLang's default.
- ``balance_abs_threshold = 32``: least difference of in-flight requests between the
  most and the least loaded engine for the load to count as imbalanced; SGLang's default.
- ``balance_rel_threshold = 1.1``: least ratio between them for the same; SGLang's
  default.
- ``max_tree_tokens = 2**20``: most tokens one engine's tree holds. After each
  planning round, trees over it lose their least recently used leaves until they fit.
  SGLang evicts the same way, in a background cycle (every 30 s by default, to a
  ``max_tree_size`` counted in characters); here one cycle runs per ``plan`` call,
  since a policy reads no clock.

Where it differs from SGLang: the tree holds token ids, not characters (the scheduler
sees token ids; a group without them is matched on a pseudo-prompt of ``prompt_len``
copies of one id derived from its ``prompt_key``, so identical prompts still match).
SGLang's router has no slot limit (engines queue what they get); here a full engine is
no candidate. SGLang keeps one shared multi-tenant tree and, on a match, takes the first
tenant at the deepest matched node; here each engine has its own tree and the longest
match wins, ties to the lowest engine id. Trees of engines that leave the snapshot are
dropped, as SGLang drops a removed worker's tenant.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

from rollserve.scheduler.core.policy import sample_plan
from rollserve.scheduler.core.snapshot import Plan, QueuedGroup, Snapshot

CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.1
MAX_TREE_TOKENS = 2**20


@dataclass(eq=False, slots=True)
class _Node:
    label: tuple[int, ...]  # the tokens on the edge from the parent to this node
    parent: _Node | None
    last_used: int = 0  # logical time of the latest insert through this node
    children: dict[int, _Node] = field(default_factory=dict)  # by first token of the label


class _PrefixTree:
    """The prompts sent to one engine, as a token-level radix tree."""

    def __init__(self) -> None:
        self._root = _Node((), None)
        self.size = 0  # tokens held: the sum of the labels

    def match(self, tokens: tuple[int, ...]) -> int:
        """Length of the longest prefix of ``tokens`` the tree holds."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            shared = _shared_prefix(child.label, tokens, i)
            i += shared
            if shared < len(child.label):
                break
            node = child
        return i

    def insert(self, tokens: tuple[int, ...], now: int) -> None:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tokens[i:], node, now)
                self.size += len(tokens) - i
                return
            shared = _shared_prefix(child.label, tokens, i)
            if shared < len(child.label):
                child = _split(child, shared)
            child.last_used = now
            node, i = child, i + shared

    def evict(self, max_tokens: int) -> None:
        """Drop least recently used leaves until the tree holds at most ``max_tokens``."""
        if self.size <= max_tokens:
            return
        order = 0  # a tie-break that keeps nodes out of the heap's comparisons
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self._root:
                heap.append((node.last_used, order, node))
                order += 1
        heapq.heapify(heap)
        while self.size > max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # a leaf is never the root
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last_used, order, parent))
                order += 1


def _shared_prefix(label: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``label`` equal ``tokens[start:]``."""
    if tokens[start : start + len(label)] == label:
        return len(label)
    shared = 0
    for a, b in zip(label, tokens[start:], strict=False):
        if a != b:
            break
        shared += 1
    return shared


def _split(node: _Node, at: int) -> _Node:
    """Cut ``node``'s edge after ``at`` tokens; return the new node in the middle."""
    parent = node.parent
    assert parent is not None  # the root has no edge to cut
    head = _Node(node.label[:at], parent, node.last_used)
    parent.children[head.label[0]] = head
    node.label = node.label[at:]
    node.parent = head
    head.children[node.label[0]] = node
    return head


def _request_tokens(group: QueuedGroup) -> tuple[int, ...]:
    """The prompt as the router sees it; a pseudo-prompt when the edge left it out."""
    if group.prompt_token_ids:
        return group.prompt_token_ids
    identity = (group.prompt_key or group.key).encode()
    digest = hashlib.blake2b(identity, digest_size=8).digest()
    marker = -1 - int.from_bytes(digest, "big")  # negative: never a real token id
    return (marker,) * max(1, group.prompt_len)


class CacheAware:
    name = "cache_aware"
    whole_groups = False
    moves_running = False
    uses_predictions = False

    def __init__(
        self,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        max_tree_tokens: int = MAX_TREE_TOKENS,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold ({cache_threshold}) must be within [0, 1]")
        if balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold ({balance_abs_threshold}) must be 0 or more requests"
            )
        if balance_rel_threshold <= 0:
            raise ValueError(
                f"balance_rel_threshold ({balance_rel_threshold}) must be a positive ratio"
            )
        if max_tree_tokens < 1:
            raise ValueError(f"max_tree_tokens ({max_tree_tokens}) must be at least 1")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self._trees: dict[str, _PrefixTree] = {}
        self._clock = 0  # logical time: one tick per routed request

    def plan(self, snapshot: Snapshot) -> Plan:
        present = {e.engine_id for e in snapshot.engines}
        for engine_id in [e for e in self._trees if e not in present]:
            del self._trees[engine_id]
        healthy = sorted((e for e in snapshot.engines if e.healthy), key=lambda e: e.engine_id)
        load = {e.engine_id: e.inflight_samples for e in healthy}
        free = {e.engine_id: e.free_samples for e in healthy}
        placed: dict[tuple[str, str], list[int]] = {}
        for group in sorted(snapshot.queue, key=lambda g: (g.turn, g.priority, g.seq)):
            prompt = _request_tokens(group)
            for index in group.pending:
                candidates = [engine_id for engine_id, slots in free.items() if slots > 0]
                if not candidates:
                    return self._finish(placed)
                target = self._route(prompt, candidates, load)
                self._clock += 1
                self._tree(target).insert(prompt, self._clock)
                load[target] += 1
                free[target] -= 1
                placed.setdefault((group.key, target), []).append(index)
        return self._finish(placed)

    def _route(self, prompt: tuple[int, ...], candidates: list[str], load: dict[str, int]) -> str:
        """The engine for one request; ``candidates`` are in engine id order."""
        max_load, min_load = max(load.values()), min(load.values())
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            return min(candidates, key=lambda e: load[e])
        matched = {e: self._tree(e).match(prompt) for e in candidates}
        best = max(candidates, key=lambda e: matched[e])  # first of the ties: lowest id
        if matched[best] / len(prompt) > self.cache_threshold:
            return best
        return min(candidates, key=lambda e: self._tree(e).size)

    def _tree(self, engine_id: str) -> _PrefixTree:
        tree = self._trees.get(engine_id)
        if tree is None:
            tree = self._trees[engine_id] = _PrefixTree()
        return tree

    def _finish(self, placed: dict[tuple[str, str], list[int]]) -> Plan:
        for tree in self._trees.values():
            tree.evict(self.max_tree_tokens)
        return sample_plan(placed)
