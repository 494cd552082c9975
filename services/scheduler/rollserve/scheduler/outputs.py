"""Finished outputs of each prompt and which engines hold them, so that a Generate call can
carry the outputs of its prompt that its engine lacks.

An engine that speculates with the ``rollout`` drafter drafts a sample from the earlier
outputs of its prompt that it holds: those it made itself, in earlier epochs or as siblings.
Alone, an engine holds what ran there, and a prompt's groups land on other engines epoch after
epoch. The scheduler sees every output finish, so it keeps the newest of each prompt and hands
an engine (one that says it takes them: Stats' ``takes_earlier_outputs``) those it has not
made nor been given, with the call that starts the prompt's samples there. Drafts never change
a sample's law, only how fast it is made: what is kept here is an optimisation, lost on a
restart, and the runtime keeps nothing while no engine has said it takes such outputs.

Prompts are told apart by their tokens, as the drafter keys its history (the same prompt
across epochs and runs shares it). A sample resumed after a preemption runs with its partial
response in its prompt: its output is kept (under the prompt) but no engine holds it whole,
and a resumed call carries nothing (the drafter drafts it from its own tokens only).

What an engine holds is this class's belief: an engine that restarted, or dropped a prompt's
history for room, lacks outputs counted here until the scheduler forgets it
(:meth:`EarlierOutputs.forget_engine`, when the engine's Stats give a new boot id, or it
gives none and may have restarted, and when it leaves the fleet). Outputs that a refused call
or push carried (refused before the engine took them, or never delivered) are not held
(:meth:`EarlierOutputs.release`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["EarlierOutputs"]


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("i", prompt_token_ids).tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class _Prompt:
    outputs: deque[tuple[int, array[int]]] = field(default_factory=deque)  # (seq, tokens)
    next_seq: int = 0
    tokens: int = 0
    held: dict[str, set[int]] = field(default_factory=dict)  # engine -> seqs it holds


class EarlierOutputs:
    """The newest ``per_prompt`` outputs of each prompt, ``max_tokens`` in all (the prompt
    used least recently goes first), and the ones each engine holds."""

    def __init__(self, *, per_prompt: int, max_tokens: int) -> None:
        if per_prompt < 1 or max_tokens < 1:
            raise ValueError(
                f"per_prompt ({per_prompt}) and max_tokens ({max_tokens}) must be at least 1"
            )
        self.per_prompt = per_prompt
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[bytes, _Prompt] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def finished(
        self, prompt_token_ids: Sequence[int], output: Sequence[int], engine_id: str | None
    ) -> None:
        """A sample of the prompt finished with ``output``, made whole on ``engine_id`` (whose
        drafter kept it), or on none (a sample resumed after a preemption)."""
        if not output:
            return
        key = prompt_digest(prompt_token_ids)
        entry = self._prompts.get(key)
        if entry is None:
            entry = self._prompts[key] = _Prompt()
        self._prompts.move_to_end(key)
        seq = entry.next_seq
        entry.next_seq += 1
        entry.outputs.append((seq, array("i", output)))
        entry.tokens += len(output)
        self.tokens += len(output)
        if engine_id is not None:
            entry.held.setdefault(engine_id, set()).add(seq)
        if len(entry.outputs) > self.per_prompt:
            old, tokens = entry.outputs.popleft()
            entry.tokens -= len(tokens)
            self.tokens -= len(tokens)
            for seqs in entry.held.values():
                seqs.discard(old)
        while self.tokens > self.max_tokens and self._prompts:
            _, dropped = self._prompts.popitem(last=False)
            self.tokens -= dropped.tokens

    def missing(
        self,
        prompt_token_ids: Sequence[int],
        engine_id: str,
        max_tokens: int,
        *,
        max_outputs: int | None = None,
    ) -> list[array[int]]:
        """The prompt's outputs ``engine_id`` does not hold, oldest first, the newest of them
        up to ``max_tokens`` tokens and ``max_outputs`` outputs; counted as held from now on
        (the call carries them)."""
        key = prompt_digest(prompt_token_ids)
        entry = self._prompts.get(key)
        if entry is None:
            return []
        self._prompts.move_to_end(key)
        held = entry.held.setdefault(engine_id, set())
        chosen: list[array[int]] = []
        room = max_tokens
        for seq, tokens in reversed(entry.outputs):
            if max_outputs is not None and len(chosen) >= max_outputs:
                break
            if seq in held or len(tokens) > room:
                continue
            held.add(seq)
            chosen.append(tokens)
            room -= len(tokens)
        chosen.reverse()
        return chosen

    def release(
        self, prompt_token_ids: Sequence[int], engine_id: str, outputs: Sequence[array[int]]
    ) -> None:
        """``outputs`` (as :meth:`missing` gave them) did not reach ``engine_id`` (the call or
        push that carried them was refused before the engine took them): not held after all."""
        entry = self._prompts.get(prompt_digest(prompt_token_ids))
        held = entry.held.get(engine_id) if entry is not None else None
        if entry is None or held is None:
            return
        for seq, tokens in entry.outputs:
            if any(tokens is output for output in outputs):
                held.discard(seq)

    def forget_engine(self, engine_id: str) -> None:
        """The engine holds nothing any more (it restarted, or may have)."""
        for entry in self._prompts.values():
            entry.held.pop(engine_id, None)
