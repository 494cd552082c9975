"""Model-free drafts for speculative decoding, from a rollout's own tokens, its group's
siblings and earlier responses to the same prompt. Pure Python: no vLLM here.

An RL rollout asks for n samples of one prompt at once and asks for the same prompt again in
later epochs; the samples of a prompt repeat each other's phrases far more than a sample
repeats itself. vLLM's ``ngram`` drafter looks only at the sample's own prompt and output.
:class:`PromptCorpus` holds every sequence an engine has of one prompt (the prompt, each
running sample so far, finished samples of this and earlier rounds) with where each n-gram of
them ends, and drafts for one sample from all of them: the longest suffix of the sample that
occurs anywhere with a continuation (found by its last ``min_n`` to ``max_n`` tokens, then
followed back as far as ``max_match`` tokens, as a suffix tree of that depth would), then the
continuation most of the occurrences of that longest match take, token by token (a tie goes to
the occurrence met first). Of the occurrences of a suffix only the newest ``max_occurrences``
are examined: a sample that loops (the long tail of RL rollouts is rich in them), with its
siblings looping alike, has its last tokens at every turn of the loop, and examining every one
made a match cost 43 ms at 1,024 tokens and 183 ms at 4,096 with 33 such sequences. Following
matches back is what lets an earlier sample of the same prompt, which matches the whole
context, outvote the many short repeats inside a sample's own output. On the sample's own
tokens alone, with ``max_match`` = ``max_n``, this is vLLM's ngram drafter save for the vote
(vLLM takes the earliest occurrence).

Used by the engine's drafter (:mod:`rollserve.engine.drafter`, speculative method
``rollout``) and by ``rollserve bench drafts`` (its ``rollout`` row walks this very code).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["NO_MATCH", "DraftSettings", "History", "Match", "PromptCorpus", "vote"]


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How a drafter matches and how much it proposes; vLLM's ngram defaults here."""

    k: int = 4  # draft tokens a pass (vLLM: num_speculative_tokens)
    min_n: int = 2  # shortest suffix matched (prompt_lookup_min)
    max_n: int = 5  # longest suffix looked up (prompt_lookup_max)
    max_match: int = 24  # a match of max_n tokens is followed back this far at most
    max_occurrences: int = 64  # occurrences of a suffix examined at most, the newest
    # Shorter drafts where they are less likely to be taken (suffix decoding's two knobs):
    spec_factor: float = 0.0  # at most this many tokens per matched token (0: up to k)
    min_share: float = 0.0  # stop where the agreeing occurrences' share falls below this

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k ({self.k}) must be at least 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"min_n ({self.min_n}) and max_n ({self.max_n}) need 1 <= min_n <= max_n"
            )
        if self.max_match < self.max_n:
            raise ValueError(f"max_match ({self.max_match}) must be at least max_n ({self.max_n})")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences ({self.max_occurrences}) must be at least 1")
        if self.spec_factor < 0:
            raise ValueError(f"spec_factor ({self.spec_factor}) must be at least 0")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"min_share ({self.min_share}) must be between 0 and 1")

    def draft_len(self, k: int, matched: int) -> int:
        """Tokens to draft at most after a match of ``matched`` tokens, ``k`` allowed."""
        if self.spec_factor > 0:
            k = min(k, max(1, int(self.spec_factor * matched)))
        return k


@dataclass(frozen=True, slots=True)
class Match:
    length: int  # the matched suffix's length (0: none)
    draft: tuple[int, ...]


NO_MATCH = Match(0, ())


class PromptCorpus:
    """Every sequence of one prompt, and where each n-gram (``min_n`` to ``max_n`` long) of
    them ends, in the order they were added.

    Sequence 0 is the prompt. Each sample is a sequence of its own that starts with the
    prompt's last ``max_n`` tokens, so that n-grams across the prompt's end are found in it
    with the sample's first tokens as their continuation; a sample's context (prompt and output
    so far) is therefore the prompt's sequence followed by its own. Samples only grow.
    """

    PROMPT = 0

    def __init__(self, prompt: Sequence[int], settings: DraftSettings) -> None:
        self.settings = settings
        self.prompt_len = len(prompt)
        self._boundary = list(prompt[max(0, len(prompt) - settings.max_n) :])
        self._seqs: list[list[int]] = []
        self._ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (seq, end)
        self._append([])
        self.extend(self.PROMPT, prompt)

    def _append(self, tokens: list[int]) -> int:
        self._seqs.append(tokens)
        return len(self._seqs) - 1

    def add_sample(self, output: Iterable[int] = ()) -> int:
        """A new sample (running or finished) with the output it has; its sequence id."""
        seq = self._append([])
        self.extend(seq, self._boundary)
        self.extend(seq, output)
        return seq

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        tokens_of = self._seqs[seq]
        ends = self._ends
        lo, hi = self.settings.min_n, self.settings.max_n
        for token in tokens:
            tokens_of.append(token)
            end = len(tokens_of)
            for n in range(lo, min(hi, end) + 1):
                key = tuple(tokens_of[end - n : end])
                found = ends.get(key)
                if found is None:
                    ends[key] = [(seq, end)]
                else:
                    found.append((seq, end))

    @property
    def boundary_len(self) -> int:
        """Prompt tokens a sample's sequence starts with."""
        return len(self._boundary)

    def output_len(self, seq: int) -> int:
        """Output tokens the sample ``seq`` has here."""
        return len(self._seqs[seq]) - len(self._boundary)

    @property
    def samples(self) -> int:
        return len(self._seqs) - 1

    def match(self, seq: int, k: int, limits: Mapping[int, int] | None = None) -> Match:
        """The draft (at most ``k`` tokens) for sample ``seq`` from every sequence here.

        ``limits`` caps how many tokens of some sequences exist yet (a sequence id to its
        length, boundary included): ``rollserve bench drafts`` walks a finished rollout and
        lets each sibling have made no more than the sample itself."""
        own = self._seqs[seq]
        settings = self.settings
        if k < 1 or len(own) < settings.min_n:
            return NO_MATCH
        seqs = self._seqs
        for n in range(min(settings.max_n, len(own)), settings.min_n - 1, -1):
            found = self._ends.get(tuple(own[len(own) - n :]))
            if not found:
                continue
            occurrences: list[tuple[list[int], int, int]] = []  # (tokens, next, available)
            sources: list[int] = []
            for other, end in reversed(found):  # the newest first
                available = len(seqs[other])
                if limits is not None:
                    available = min(available, limits.get(other, available))
                if end < available:
                    occurrences.append((seqs[other], end, available))
                    sources.append(other)
                    if len(occurrences) == settings.max_occurrences:
                        break
            if not occurrences:
                continue
            occurrences.reverse()  # in the order met, for the vote's ties
            sources.reverse()
            matched = n
            if n == settings.max_n and settings.max_match > n and len(occurrences) > 1:
                lengths = [
                    self._match_back(seq, other, end, n)
                    for other, (_, end, _) in zip(sources, occurrences, strict=True)
                ]
                matched = max(lengths)
                occurrences = [o for o, m in zip(occurrences, lengths, strict=True) if m == matched]
            k = settings.draft_len(k, matched)
            return Match(matched, vote(occurrences, k, settings.min_share))
        return NO_MATCH

    def _match_back(self, seq: int, other: int, end: int, n: int) -> int:
        """How many tokens before ``end`` in sequence ``other`` equal the last ones of sample
        ``seq``'s context, at most ``max_match``, given that the last ``n`` do. A sample's
        tokens before its boundary are the prompt's."""
        a = len(self._seqs[seq]) + self._skipped(seq)  # logical ends: the context's and
        b = end + self._skipped(other)  # the occurrence's
        good, bad = n, min(self.settings.max_match, a, b) + 1  # lengths known (un)equal
        # Suffixes that agree over some length agree over every shorter one: a binary search,
        # each probe one comparison of two slices (in C, not token by token in Python). The
        # first probes are the likeliest ends: one token more (most matches in varied text
        # stop there) and the whole length (a loop, or an earlier answer to the prompt).
        probe = good + 1
        while bad - good > 1:
            if self._span(seq, a - probe, a) == self._span(other, b - probe, b):
                good = probe
                probe = bad - 1 if probe == n + 1 else (good + bad) // 2
            else:
                bad = probe
                probe = (good + bad) // 2
        return good

    def _skipped(self, seq: int) -> int:
        """Prompt tokens before sequence ``seq``'s first (a sample starts at its boundary)."""
        return 0 if seq == self.PROMPT else self.prompt_len - len(self._boundary)

    def _span(self, seq: int, start: int, stop: int) -> list[int]:
        """Tokens ``start`` to ``stop`` of sequence ``seq``'s whole context (prompt included)."""
        skipped = self._skipped(seq)
        tokens = self._seqs[seq]
        if start >= skipped:
            return tokens[start - skipped : stop - skipped]
        prompt = self._seqs[self.PROMPT]
        return prompt[start : min(stop, skipped)] + tokens[: max(0, stop - skipped)]


def vote(
    occurrences: Sequence[tuple[Sequence[int], int, int]], k: int, min_share: float = 0.0
) -> tuple[int, ...]:
    """Token by token, the continuation most occurrences take (a tie: the one met first),
    keeping only the occurrences that agree so far; it stops where the product of the
    winners' shares (their votes over the occurrences that go on) falls below ``min_share``.
    An occurrence is (tokens, where its continuation starts, how many of its tokens exist)."""
    draft: list[int] = []
    confidence = 1.0
    for j in range(k):
        if len(occurrences) == 1:
            tokens, end, available = occurrences[0]
            draft.extend(tokens[end + j : min(end + k, available)])
            break
        counts: dict[int, int] = {}
        for tokens, end, available in occurrences:
            if end + j < available:
                token = tokens[end + j]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        best, votes = -1, 0
        for token, count in counts.items():  # in the order first met
            if count > votes:
                best, votes = token, count
        confidence *= votes / sum(counts.values())
        if confidence < min_share:
            break
        draft.append(best)
        occurrences = [o for o in occurrences if o[1] + j < o[2] and o[0][o[1] + j] == best]
    return tuple(draft)


class History:
    """Finished samples' outputs by prompt, for drafting later samples of the same prompt.

    At most ``max_per_prompt`` outputs a prompt (the newest) and ``max_tokens`` tokens in all
    (prompts and outputs): the prompt used least recently goes first. Outputs are kept as
    4-byte integers (a tuple of Python ints takes about nine times that)."""

    def __init__(self, *, max_tokens: int, max_per_prompt: int) -> None:
        if max_tokens < 1 or max_per_prompt < 1:
            raise ValueError(
                f"max_tokens ({max_tokens}) and max_per_prompt ({max_per_prompt}) must be "
                "at least 1"
            )
        self.max_tokens = max_tokens
        self.max_per_prompt = max_per_prompt
        self._by_prompt: OrderedDict[tuple[int, ...], deque[array[int]]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._by_prompt)

    def add(self, prompt: tuple[int, ...], output: Sequence[int]) -> None:
        outputs = self._by_prompt.get(prompt)
        if outputs is None:
            outputs = self._by_prompt[prompt] = deque()
            self.tokens += len(prompt)
        self._by_prompt.move_to_end(prompt)
        outputs.append(array("i", output))
        self.tokens += len(output)
        if len(outputs) > self.max_per_prompt:
            self.tokens -= len(outputs.popleft())
        while self.tokens > self.max_tokens and self._by_prompt:
            old_prompt, old = self._by_prompt.popitem(last=False)
            self.tokens -= len(old_prompt) + sum(len(o) for o in old)

    def outputs(self, prompt: tuple[int, ...]) -> Sequence[Sequence[int]]:
        """The outputs kept for ``prompt``, oldest first (the prompt counts as used)."""
        outputs = self._by_prompt.get(prompt)
        if outputs is None:
            return ()
        self._by_prompt.move_to_end(prompt)
        return tuple(outputs)
