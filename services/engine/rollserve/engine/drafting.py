"""Model-free drafts for speculative decoding, from a rollout's own tokens, its group's
siblings and earlier responses to the same prompt. Python and numpy: no vLLM here.

An RL rollout asks for n samples of one prompt at once and asks for the same prompt again in
later epochs; the samples of a prompt repeat each other's phrases far more than a sample
repeats itself. vLLM's ``ngram`` drafter looks only at the sample's own prompt and output.
:class:`PromptCorpus` holds every sequence an engine has of one prompt (the prompt, each
running sample so far, finished samples of this and earlier rounds) with where each n-gram of
them ends, and drafts for one sample from all of them: the longest suffix of the sample that
occurs anywhere with a continuation (found by its last ``min_n`` to ``max_n`` tokens, then
followed back as far as ``max_match`` tokens, as a suffix tree of that depth would), then the
continuation most of the occurrences of that longest match take, token by token (a tie goes to
the occurrence in the earliest sequence, then the earliest position). Of the occurrences of a
suffix only the newest ``max_occurrences`` are examined: a sample that loops (the long tail of
RL rollouts is rich in them), with its siblings looping alike, has its last tokens at every
turn of the loop, and examining every one made a match cost 43 ms at 1,024 tokens and 183 ms at
4,096 with 33 such sequences. Following matches back is what lets an earlier sample of the same
prompt, which matches the whole context, outvote the many short repeats inside a sample's own
output. On the sample's own tokens alone, with ``max_match`` = ``max_n``, this is vLLM's ngram
drafter save for the vote (vLLM takes the earliest occurrence).

Used by the engine's drafter (:mod:`rollserve.engine.drafter`, speculative method
``rollout``) and by ``rollserve bench drafts`` (its ``rollout`` row walks this very code).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "NO_MATCH",
    "DraftSettings",
    "History",
    "Match",
    "PreparedSamples",
    "PromptCorpus",
    "vote",
]


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


BULK_TOKENS = 4096
"""An extend of at least this many tokens is indexed at once, as a sorted block (numpy);
shorter ones, a running sample's few tokens a step, go to a dict. Below it a corpus has no
block: a block costs each match about 3 µs of lookups, more than the dict saves on a small
corpus (short rollouts: 2.9 µs a match, against 9.8 µs with a block at 256)."""
FLUSH_ENTRIES = 1 << 16
"""The dict is moved into a sorted block when it holds this many occurrences: a dict entry
takes about ten times the memory of a block's (16 bytes)."""
_MUL = 0x9E3779B97F4A7C15  # odd: multiplying by it mixes the bits
_MASK = (1 << 64) - 1
_SEQ_SHIFT = 32  # an occurrence is one int: seq << 32 | end
_CHUNK = 64  # occurrences read from a block at a time, newest first


def _ngram_salt(n: int) -> int:
    """Tells the n-grams of one length from another's with the same polynomial."""
    return (n * 0xD6E8FEB86659FD93) & _MASK


@dataclass(frozen=True, slots=True)
class PreparedSamples:
    """Finished samples indexed off the corpus's thread (:meth:`PromptCorpus.prepare`)."""

    seqs: range  # their ids, reserved in the corpus
    tokens: list[list[int]]  # each one's sequence: the prompt's boundary, then its output
    keys: np.ndarray  # sorted n-gram keys, the prompt's too when it was not indexed
    occurrences: np.ndarray


class PromptCorpus:
    """Every sequence of one prompt, and where each n-gram (``min_n`` to ``max_n`` long) of
    them ends, in the order they were added.

    Sequence 0 is the prompt. Each sample is a sequence of its own that starts with the
    prompt's last ``max_n`` tokens, so that n-grams across the prompt's end are found in it
    with the sample's first tokens as their continuation; a sample's context (prompt and output
    so far) is therefore the prompt's sequence followed by its own. Samples only grow.

    The index maps an n-gram's 64-bit polynomial hash (its length mixed in) to where it ends.
    Occurrences added a few tokens at a time go to a dict (key -> ends, in the order added);
    an extend of :data:`BULK_TOKENS` or more (a finished sample, an earlier epoch's outputs, a
    running sample seen for the first time in the tail) moves the dict's into a block and is
    hashed with numpy into a block of its own: keys sorted, each key's ends in the order
    added, 16 bytes an occurrence. Blocks merge so that there are O(log n) of them; a lookup
    reads the dict, then the blocks newest first. Indexing in Python cost about 16 µs and
    950 bytes a token; a bulk extend costs 0.5-0.7 µs and about 72 bytes a token. Two
    different n-grams of one hash (a chance of about 1e-13 a lookup) would cost a wrong draft,
    which the target model's verification rejects, never a wrong output.
    """

    PROMPT = 0

    def __init__(
        self, prompt: Sequence[int], settings: DraftSettings, *, index_prompt: bool = True
    ) -> None:
        """``index_prompt`` False leaves the prompt's n-grams to :meth:`prepare`'s block (a
        history indexed off the engine's step): until it is adopted nothing matches in the
        prompt."""
        self.settings = settings
        self.prompt_len = len(prompt)
        self._boundary = list(prompt[max(0, len(prompt) - settings.max_n) :])
        self._seqs: list[list[int]] = []
        self._recent: dict[int, list[int]] = {}  # n-gram key -> occurrences, in order added
        self._recent_entries = 0
        self._blocks: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted keys, occurrences)
        self._pows = [pow(_MUL, j, 1 << 64) for j in range(settings.max_n)]
        self._salts = [_ngram_salt(n) for n in range(settings.max_n + 1)]
        self._prompt_indexed = index_prompt
        self._append([])
        if index_prompt:
            self.extend(self.PROMPT, prompt)
        else:
            self._seqs[self.PROMPT].extend(prompt)

    def _append(self, tokens: list[int]) -> int:
        self._seqs.append(tokens)
        return len(self._seqs) - 1

    def add_sample(self, output: Iterable[int] = ()) -> int:
        """A new sample (running or finished) with the output it has; its sequence id."""
        seq = self._append([])
        self.extend(seq, [*self._boundary, *output])
        return seq

    def add_samples(self, outputs: Iterable[Sequence[int]]) -> list[int]:
        """Finished samples (an earlier epoch's, say), indexed together (as one block if they
        hold :data:`BULK_TOKENS` or more); their ids."""
        outputs = list(outputs)
        if sum(len(o) for o in outputs) < BULK_TOKENS:
            return [self.add_sample(output) for output in outputs]
        seqs = [self._append([*self._boundary, *output]) for output in outputs]
        self._index_bulk([(seq, 0) for seq in seqs])
        return seqs

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        tokens_of = self._seqs[seq]
        start = len(tokens_of)
        tokens_of.extend(tokens)
        if len(tokens_of) - start >= BULK_TOKENS:
            self._index_bulk([(seq, start)])
            return
        recent, pows, salts = self._recent, self._pows, self._salts
        lo, hi = self.settings.min_n, self.settings.max_n
        base = seq << _SEQ_SHIFT
        added = 0
        for end in range(start + 1, len(tokens_of) + 1):
            h = 0
            occurrence = base | end
            for n in range(1, min(hi, end) + 1):
                h = (h + tokens_of[end - n] * pows[n - 1]) & _MASK
                if n >= lo:
                    key = h ^ salts[n]
                    found = recent.get(key)
                    if found is None:
                        recent[key] = [occurrence]
                    else:
                        found.append(occurrence)
                    added += 1
        self._recent_entries += added
        if self._recent_entries >= FLUSH_ENTRIES:
            self._flush()

    def _keys(self, seq: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and occurrences of every n-gram of ``seq`` that ends after ``start``."""
        tokens_of = self._seqs[seq]
        offset = max(0, start - self.settings.max_n)
        return self._keys_of(np.asarray(tokens_of[offset:], dtype=np.uint64), offset, seq, start)

    def _keys_of(
        self, window: np.ndarray, offset: int, seq: int, start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The keys and occurrences of every n-gram of sequence ``seq``, whose tokens from
        ``offset`` on are ``window``, that ends after ``start``. Each key's occurrences come
        in the order :meth:`extend` adds them (by end: one n-gram length's keys never equal
        another's but by a hash collision). Reads only what a corpus never changes: safe on
        another thread."""
        ends = np.arange(start + 1, offset + len(window) + 1, dtype=np.int64)
        h = np.zeros(len(ends), dtype=np.uint64)
        keys: list[np.ndarray] = []
        occurrences: list[np.ndarray] = []
        for n in range(1, self.settings.max_n + 1):
            valid = ends >= n
            h = h + window[np.where(valid, ends - n - offset, 0)] * np.uint64(self._pows[n - 1])
            if n >= self.settings.min_n:
                keys.append((h ^ np.uint64(self._salts[n]))[valid])
                occurrences.append(((seq << _SEQ_SHIFT) | ends)[valid])
        return np.concatenate(keys), np.concatenate(occurrences)

    def reserve(self, count: int) -> range:
        """Ids for ``count`` samples whose tokens and index :meth:`prepare` makes elsewhere
        and :meth:`adopt` brings in; they hold nothing until then."""
        first = len(self._seqs)
        for _ in range(count):
            self._append([])
        return range(first, first + count)

    def prepare(self, outputs: Sequence[Sequence[int]], seqs: range) -> PreparedSamples:
        """The sequences and the sorted block of finished samples ``outputs`` as the samples
        ``seqs`` (:meth:`reserve`), and of the prompt if it is not indexed yet. Reads only
        what the corpus never changes, so it may run on another thread while the corpus is
        used (numpy's hashing and sorting there release the interpreter's lock)."""
        if len(outputs) != len(seqs):
            raise ValueError(f"{len(outputs)} outputs for {len(seqs)} reserved samples")
        boundary = np.asarray(self._boundary, dtype=np.uint64)
        made = []
        if not self._prompt_indexed:
            prompt = np.asarray(self._seqs[self.PROMPT], dtype=np.uint64)
            made.append(self._keys_of(prompt, 0, self.PROMPT, 0))
        tokens: list[list[int]] = []
        for seq, output in zip(seqs, outputs, strict=True):
            window = np.concatenate([boundary, np.asarray(output, dtype=np.uint64)])
            made.append(self._keys_of(window, 0, seq, 0))
            tokens.append([*self._boundary, *output])
        if not made:
            keys, occurrences = np.zeros(0, np.uint64), np.zeros(0, np.int64)
        else:
            keys = np.concatenate([k for k, _ in made])
            occurrences = np.concatenate([o for _, o in made])
            order = np.argsort(keys, kind="stable")
            keys, occurrences = keys[order], occurrences[order]
        return PreparedSamples(seqs, tokens, keys, occurrences)

    def adopt(self, prepared: PreparedSamples) -> None:
        """Brings in what :meth:`prepare` made, as the corpus's oldest block: each n-gram's
        occurrences are then found in the order they would have been had the samples been
        added (:meth:`add_samples`) when their ids were reserved. Cheap: no sort here."""
        for seq, tokens in zip(prepared.seqs, prepared.tokens, strict=True):
            if self._seqs[seq]:
                raise ValueError(f"sample {seq} was not reserved or is adopted already")
            self._seqs[seq] = tokens
        self._prompt_indexed = True
        if len(prepared.keys):
            self._blocks.insert(0, (prepared.keys, prepared.occurrences))

    def _index_bulk(self, parts: Sequence[tuple[int, int]]) -> None:
        """Indexes every n-gram of each ``(seq, start)`` that ends after ``start`` as a block
        (the dict's occurrences, added before them, go first)."""
        self._flush()
        made = [self._keys(seq, start) for seq, start in parts]
        self._add_block(np.concatenate([k for k, _ in made]), np.concatenate([o for _, o in made]))

    def _flush(self) -> None:
        """Moves the dict's occurrences into a block, each key's in the order added."""
        if not self._recent:
            return
        keys = np.fromiter(
            (key for key, found in self._recent.items() for _ in found),
            dtype=np.uint64,
            count=self._recent_entries,
        )
        occurrences = np.fromiter(
            (o for found in self._recent.values() for o in found),
            dtype=np.int64,
            count=self._recent_entries,
        )
        self._recent = {}
        self._recent_entries = 0
        self._add_block(keys, occurrences)

    def _add_block(self, keys: np.ndarray, occurrences: np.ndarray) -> None:
        """A block of keys (in the order added) joins the newest end; the two newest merge
        while the newer is at least half the older, so blocks stay O(log n) (a stable sort
        keeps each key's occurrences in the order added)."""
        if len(keys) == 0:
            return
        blocks = self._blocks
        blocks.append((keys, occurrences))
        while len(blocks) > 1 and 2 * len(blocks[-1][0]) >= len(blocks[-2][0]):
            (k1, o1), (k2, o2) = blocks[-2], blocks[-1]
            blocks[-2:] = [(np.concatenate([k1, k2]), np.concatenate([o1, o2]))]
        keys, occurrences = blocks[-1]
        if len(keys) > 1 and not bool(np.all(keys[:-1] <= keys[1:])):
            order = np.argsort(keys, kind="stable")
            blocks[-1] = (keys[order], occurrences[order])

    def _block_ranges(self, keys: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """For each block, newest first, where each of ``keys`` starts and ends in it (two
        numpy calls a block for all of a match's lookups)."""
        if not self._blocks:
            return []
        wanted = np.asarray(keys, dtype=np.uint64)
        return [
            (
                block.searchsorted(wanted, "left").tolist(),
                block.searchsorted(wanted, "right").tolist(),
            )
            for block, _ in reversed(self._blocks)
        ]

    def _occurrences(
        self, key: int, index: int, ranges: Sequence[tuple[list[int], list[int]]]
    ) -> Iterable[int]:
        """Where the n-gram of ``key`` ends, the newest first: seq << 32 | end (``index``: its
        place in the keys ``ranges`` were found for)."""
        found = self._recent.get(key)
        if not ranges:  # no block: the dict's list as it is (no generator in the way)
            return reversed(found) if found else ()
        return self._with_blocks(found, index, ranges)

    def _with_blocks(
        self,
        found: list[int] | None,
        index: int,
        ranges: Sequence[tuple[list[int], list[int]]],
    ) -> Iterator[int]:
        if found:
            yield from reversed(found)
        for (_, occurrences), (los, his) in zip(reversed(self._blocks), ranges, strict=True):
            lo, hi = los[index], his[index]
            while hi > lo:  # from the newest end, a few at a time: a loop's run is long
                start = max(lo, hi - _CHUNK)
                yield from reversed(occurrences[start:hi].tolist())
                hi = start

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
        keys = [0] * (settings.max_n + 1)  # the keys of the context's last n tokens, by n
        h = 0
        for n in range(1, min(settings.max_n, len(own)) + 1):
            h = (h + own[len(own) - n] * self._pows[n - 1]) & _MASK
            keys[n] = h ^ self._salts[n]
        low = (1 << _SEQ_SHIFT) - 1
        ranges = self._block_ranges(keys)
        for n in range(min(settings.max_n, len(own)), settings.min_n - 1, -1):
            chosen: list[tuple[int, int, int]] = []  # (seq, end, available)
            for code in self._occurrences(keys[n], n, ranges):  # the newest first
                other, end = code >> _SEQ_SHIFT, code & low
                available = len(seqs[other])
                if limits is not None:
                    available = min(available, limits.get(other, available))
                if end < available:
                    chosen.append((other, end, available))
                    if len(chosen) == settings.max_occurrences:
                        break
            if not chosen:
                continue
            chosen.sort()  # by sequence and position, for the vote's ties
            sources = [other for other, _, _ in chosen]
            occurrences = [(seqs[other], end, available) for other, end, available in chosen]
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
    4-byte integers (a tuple of Python ints takes about nine times that), and a prompt by a
    16-byte digest of its tokens, which counts as its tokens (its tuple, kept as the key,
    took some 36 bytes a token uncounted)."""

    def __init__(self, *, max_tokens: int, max_per_prompt: int) -> None:
        if max_tokens < 1 or max_per_prompt < 1:
            raise ValueError(
                f"max_tokens ({max_tokens}) and max_per_prompt ({max_per_prompt}) must be "
                "at least 1"
            )
        self.max_tokens = max_tokens
        self.max_per_prompt = max_per_prompt
        # digest of the prompt -> (its length in tokens, its outputs)
        self._by_prompt: OrderedDict[bytes, tuple[int, deque[array[int]]]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._by_prompt)

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        key = _digest(prompt)
        entry = self._by_prompt.get(key)
        if entry is None:
            entry = self._by_prompt[key] = (len(prompt), deque())
            self.tokens += len(prompt)
        self._by_prompt.move_to_end(key)
        outputs = entry[1]
        outputs.append(array("i", output))
        self.tokens += len(output)
        if len(outputs) > self.max_per_prompt:
            self.tokens -= len(outputs.popleft())
        while self.tokens > self.max_tokens and self._by_prompt:
            _, (prompt_len, old) = self._by_prompt.popitem(last=False)
            self.tokens -= prompt_len + sum(len(o) for o in old)

    def outputs(self, prompt: Sequence[int]) -> Sequence[Sequence[int]]:
        """The outputs kept for ``prompt``, oldest first (the prompt counts as used)."""
        key = _digest(prompt)
        entry = self._by_prompt.get(key)
        if entry is None:
            return ()
        self._by_prompt.move_to_end(key)
        return tuple(entry[1])


def _digest(prompt: Sequence[int]) -> bytes:
    """A prompt's key: its tokens as 4-byte integers, hashed (a collision, at 128 bits, is
    not met in practice, and would only give a prompt another's drafts: a slower sample,
    never a different one)."""
    return hashlib.blake2b(array("i", prompt).tobytes(), digest_size=16).digest()
