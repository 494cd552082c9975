"""The ``rollout`` drafter: drafts from a sample's own tokens, its siblings and earlier samples
of the same prompt (``rollserve.engine.drafting``), and the vLLM-facing proposer around it
(``rollserve.engine.drafter``). Faked edge: vLLM's input batch (a few numpy arrays with the
fields vLLM's model runner gives a proposer) and its config; the hooks into vLLM's real model
runner class are checked against it at the end."""

from __future__ import annotations

import inspect
import json
import random
from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from rollserve.engine import drafting
from rollserve.engine.drafter import (
    ADD_OUTPUTS_METHOD,
    DRAFTER_ENV,
    DrafterConfig,
    RolloutDrafter,
    RolloutWorkerExtension,
)
from rollserve.engine.drafting import NO_MATCH, DraftSettings, History, Match, PromptCorpus

S = DraftSettings(k=4, min_n=2, max_n=5)


def test_a_sample_drafts_from_its_prompt_like_vllms_ngram() -> None:
    corpus = PromptCorpus([1, 2, 3, 4, 5, 9, 1, 2, 3], S)
    seq = corpus.add_sample()
    # the context ends "1 2 3" (the 5- and 4-grams occur only at the end): what followed it
    assert corpus.match(seq, 4).length == 3
    assert corpus.match(seq, 4).draft == (4, 5, 9, 1)
    assert corpus.match(seq, 2).draft == (4, 5)
    corpus.extend(seq, [4, 5])  # now "9 1 2 3 4 5"... ends "2 3 4 5": earlier at 1..4
    assert corpus.match(seq, 4).length == 5
    assert corpus.match(seq, 4).draft == (9, 1, 2, 3)


def test_no_draft_without_a_match_of_min_n_tokens() -> None:
    corpus = PromptCorpus([1, 2, 3, 4], S)
    seq = corpus.add_sample([5, 1])  # "5 1": no 2-gram repeats; the 1-gram "1" does
    assert corpus.match(seq, 4) is NO_MATCH
    assert corpus.match(seq, 0) is NO_MATCH


def test_a_sample_drafts_what_its_sibling_wrote_after_the_same_prompt() -> None:
    corpus = PromptCorpus([7, 8, 9], S)
    first = corpus.add_sample([20, 21, 22, 23, 24, 25])
    second = corpus.add_sample()
    # right after the prompt: the prompt's end occurs in the first sample with its output next
    assert corpus.match(second, 4).draft == (20, 21, 22, 23)
    corpus.extend(second, [20, 21, 22])
    assert corpus.match(second, 4).draft == (23, 24, 25)  # no further than the sibling went
    assert corpus.output_len(second) == 3
    assert corpus.output_len(first) == 6
    assert corpus.samples == 2
    # a sibling only as far as it has got (the walk in ``bench drafts``)
    limited = corpus.match(second, 4, limits={first: len([7, 8, 9]) + 4})
    assert limited.draft == (23,)


def test_the_continuation_most_occurrences_take_wins_token_by_token() -> None:
    corpus = PromptCorpus([1, 2], S)
    corpus.add_sample([5, 6, 7, 8])
    corpus.add_sample([5, 6, 9, 9])
    corpus.add_sample([5, 6, 9, 10])
    seq = corpus.add_sample([5, 6])
    # after "5 6": 7 once, 9 twice; after "5 6 9": 9 once, 10 once (the first met wins)
    assert corpus.match(seq, 4).draft == (9, 9)
    tie = PromptCorpus([1, 2], S)
    tie.add_sample([3, 4])
    tie.add_sample([3, 5])
    assert tie.match(tie.add_sample(), 2).draft == (3, 4)


def test_the_longest_matching_suffix_drafts_even_if_shorter_ones_occur_more() -> None:
    corpus = PromptCorpus([0], S)
    corpus.add_sample([1, 2, 3, 4, 50])
    for _ in range(3):
        corpus.add_sample([9, 3, 4, 60])
    seq = corpus.add_sample([1, 2, 3, 4])
    assert corpus.match(seq, 1).length == 5  # the prompt's "0" starts it
    assert corpus.match(seq, 1).draft == (50,)


def _brute_force(
    prompt: list[int], outputs: list[list[int]], seq: int, k: int, settings: DraftSettings
) -> tuple[int, tuple[int, ...]]:
    """The same drafting by scanning every position of every sequence. Sequence 0 is the
    prompt, sequence i the prompt and output i - 1; an occurrence is a position with a token
    after it, found (as the index finds it) only by the n-gram inside its stored tokens (a
    sample stores the prompt's last max_n tokens and its output), then followed back through
    the prompt."""
    skipped = max(0, len(prompt) - settings.max_n)
    full = [prompt] + [prompt + o for o in outputs]
    first_stored = [0] + [skipped] * len(outputs)  # where each sequence's stored part starts
    context = full[seq]

    def back(tokens: list[int], end: int) -> int:
        m = 0
        while (
            m < min(end, len(context), settings.max_match)
            and tokens[end - m - 1] == context[len(context) - m - 1]
        ):
            m += 1
        return m

    occ: list[tuple[list[int], int, int, int]] = []  # (tokens, end, looked up, followed)
    for i, tokens in enumerate(full):
        for end in range(first_stored[i] + 1, len(tokens)):
            m = back(tokens, end)
            looked_up = min(m, end - first_stored[i], settings.max_n)
            if looked_up >= settings.min_n:
                occ.append((tokens, end, looked_up, m))
    if not occ:
        return 0, ()
    n = max(o[2] for o in occ)
    occ = [o for o in occ if o[2] == n][-settings.max_occurrences :]  # the newest
    if n == settings.max_n and len(occ) > 1:
        n = max(o[3] for o in occ)
        occ = [o for o in occ if o[3] == n]
    draft: list[int] = []
    pairs = [(t, e) for t, e, _, _ in occ]
    if settings.spec_factor > 0:
        k = min(k, max(1, int(settings.spec_factor * n)))
    confidence = 1.0
    for j in range(k):
        options = [(t[e + j], i) for i, (t, e) in enumerate(pairs) if e + j < len(t)]
        if not options:
            break
        counts: dict[int, int] = {}
        for token, _ in options:
            counts[token] = counts.get(token, 0) + 1
        best = max(counts, key=lambda t: (counts[t], -min(i for x, i in options if x == t)))
        if len(pairs) > 1:  # one occurrence left: its tokens, as they are
            confidence *= counts[best] / len(options)
        if confidence < settings.min_share:
            break
        draft.append(best)
        pairs = [(t, e) for t, e in pairs if e + j < len(t) and t[e + j] == best]
    return n, tuple(draft)


def _turns(
    rng: random.Random, outputs: list[list[int]]
) -> Iterator[tuple[int, tuple[int, int, int]]]:
    """Running samples grown a few tokens at a time in random turns: (tokens grown before,
    (sample, start, stop)), until every output is whole."""
    done = [0] * len(outputs)
    grown = 0
    while left := [j for j, o in enumerate(outputs) if done[j] < len(o)]:
        i = rng.choice(left)
        step = min(rng.randint(1, 5), len(outputs[i]) - done[i])
        yield grown, (i, done[i], done[i] + step)
        done[i] += step
        grown += step


def _same_drafts(
    a: PromptCorpus, b: PromptCorpus, seqs: list[tuple[int, int]], k: int, label: str
) -> None:
    """Every sample drafts alike in the two corpora (its id in each: ``seqs``)."""
    for in_a, in_b in seqs:
        assert b.match(in_b, k) == a.match(in_a, k), label


# The index's two halves under four mixes: as shipped, everything in numpy blocks, and small
# thresholds that send extends to blocks and flush the dict often.
INDEX_MIXES = pytest.mark.parametrize(
    ("bulk", "flush"),
    [(drafting.BULK_TOKENS, drafting.FLUSH_ENTRIES), (1, 1 << 16), (4, 8), (3, 2)],
    ids=["as-shipped", "all-in-blocks", "mixed", "mixed-flushed"],
)


@INDEX_MIXES
def test_drafts_equal_a_brute_force_scan_on_random_rollouts(
    bulk: int, flush: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index's two halves (a dict for a few tokens at a time, sorted numpy blocks for
    # bulk extends and the dict's occurrences moved there) must find what a scan finds.
    monkeypatch.setattr(drafting, "BULK_TOKENS", bulk)
    monkeypatch.setattr(drafting, "FLUSH_ENTRIES", flush)
    rng = random.Random(7)
    for case in range(400):
        how = rng.choice(["one by one", "together", "grown", "deferred"])
        max_n = rng.randint(2, 5)
        settings = DraftSettings(
            k=rng.randint(1, 5),
            min_n=rng.randint(1, max_n),
            max_n=max_n,
            max_match=rng.choice([max_n, 8, 24]),
            # Samples grown in turns add their occurrences out of (sample, position) order,
            # which is the order the scan's cap goes by: no cap there.
            max_occurrences=1000 if how in ("grown", "deferred") else rng.choice([64, 1, 2, 5]),
            spec_factor=rng.choice([0.0, 0.0, 0.5, 1.0, 2.0]),
            min_share=rng.choice([0.0, 0.0, 0.3, 0.6]),
        )
        vocab = rng.randint(2, 5)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        corpus = PromptCorpus(prompt, settings, index_prompt=how != "deferred")
        outputs = [
            [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
            for _ in range(rng.randint(1, 4))
        ]
        if how == "deferred":  # earlier epochs' outputs indexed aside, running samples meanwhile
            history = rng.randint(0, len(outputs))
            prepared: drafting.PreparedSamples | None = corpus.prepare(
                outputs[:history], corpus.reserve(history)
            )
            running = outputs[history:]
            seqs = [corpus.add_sample() for _ in running]
            adopt_at = rng.randint(0, sum(len(o) for o in running))
            for grown, (i, start, stop) in _turns(rng, running):
                if grown >= adopt_at and prepared is not None:
                    corpus.adopt(prepared)
                    prepared = None
                corpus.extend(seqs[i], running[i][start:stop])
            if prepared is not None:
                corpus.adopt(prepared)
        elif how == "together":  # as earlier epochs' outputs join a new corpus
            corpus.add_samples(outputs)
        elif how == "one by one":
            for output in outputs:
                corpus.add_sample(output)
        else:  # running samples, a few tokens a step each, in turns
            seqs = [corpus.add_sample() for _ in outputs]
            done = [0] * len(outputs)
            while any(d < len(o) for d, o in zip(done, outputs, strict=True)):
                i = rng.randrange(len(outputs))
                step = rng.randint(1, 5)
                corpus.extend(seqs[i], outputs[i][done[i] : done[i] + step])
                done[i] = min(len(outputs[i]), done[i] + step)
        seq = rng.randint(1, len(outputs))
        got = corpus.match(seq, settings.k)
        want = _brute_force(prompt, outputs, seq, settings.k, settings)
        assert (got.length, got.draft) == want, f"case {case}: {settings} {prompt} {outputs}"


@INDEX_MIXES
def test_a_history_indexed_aside_drafts_as_one_indexed_in_the_step(
    bulk: int, flush: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drafter indexes a long history on a thread (prepare) and adopts it later: from then
    # on every draft is the one the history indexed at once (add_samples) gives, caps on the
    # occurrences examined included, whenever the adoption came.
    monkeypatch.setattr(drafting, "BULK_TOKENS", bulk)
    monkeypatch.setattr(drafting, "FLUSH_ENTRIES", flush)
    rng = random.Random(11)
    for case in range(300):
        max_n = rng.randint(2, 5)
        settings = DraftSettings(
            k=rng.randint(1, 5),
            min_n=rng.randint(1, max_n),
            max_n=max_n,
            max_occurrences=rng.choice([1, 2, 5, 64]),
        )
        vocab = rng.randint(2, 4)  # few tokens: n-grams occur many times, the caps bind
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        history = [
            [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            for _ in range(rng.randint(0, 5))
        ]
        running = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(3)]
        at_once = PromptCorpus(prompt, settings)
        at_once.add_samples(history)
        aside = PromptCorpus(prompt, settings, index_prompt=False)
        prepared: drafting.PreparedSamples | None = aside.prepare(
            history, aside.reserve(len(history))
        )
        seqs = [(at_once.add_sample(), aside.add_sample()) for _ in running]
        adopt_at = rng.randint(0, sum(map(len, running)))

        for grown, (i, start, stop) in _turns(rng, running):
            if grown >= adopt_at and prepared is not None:
                aside.adopt(prepared)
                prepared = None
            if prepared is None:
                _same_drafts(at_once, aside, seqs, settings.k, f"case {case}: {settings}")
            for corpus, seq in zip((at_once, aside), seqs[i], strict=True):
                corpus.extend(seq, running[i][start:stop])
        if prepared is not None:
            aside.adopt(prepared)
        _same_drafts(at_once, aside, seqs, settings.k, f"case {case}: {settings}")
    with pytest.raises(ValueError, match="outputs for"):
        aside.prepare([[1]], aside.reserve(2))
    with pytest.raises(ValueError, match="adopted already"):
        aside.adopt(_taken(aside))


def _taken(corpus: PromptCorpus) -> drafting.PreparedSamples:
    """A prepared sample whose id is taken: sequence 1, the first sample, holds tokens."""
    made = corpus.prepare([[1, 2]], corpus.reserve(1))
    return drafting.PreparedSamples(range(1, 2), made.tokens, made.keys, made.occurrences)


def test_a_long_match_in_an_earlier_sample_outvotes_short_repeats_of_its_own() -> None:
    settings = DraftSettings(k=2, min_n=2, max_n=3, max_match=24)
    corpus = PromptCorpus([50, 51, 52], settings)
    corpus.add_sample([1, 1, 1, 1, 2, 2])  # an earlier sample of the prompt
    seq = corpus.add_sample([1, 1, 1, 1])
    # "1 1 1" recurs in the sample's own output followed by 1; the earlier sample matches
    # the whole context and went on with 2 2
    assert corpus.match(seq, 2) == Match(7, (2, 2))
    short = PromptCorpus([50, 51, 52], DraftSettings(k=2, min_n=2, max_n=3, max_match=3))
    short.add_sample([1, 1, 1, 1, 2, 2])
    assert short.match(short.add_sample([1, 1, 1, 1]), 2).draft == (1, 2)  # 1 by 2 votes to 1


def test_a_match_examines_at_most_the_newest_max_occurrences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 33 samples of one prompt looping the same 7 tokens (a greedy model stuck in a loop):
    # the suffix occurs at every turn of every loop, 33 x 73 times.
    loop = [11, 12, 13, 14, 15, 16, 17] * 73
    corpus = PromptCorpus([1, 2, 3], DraftSettings(max_occurrences=16))
    seqs = [corpus.add_sample(loop) for _ in range(33)]
    followed: list[tuple[int, int]] = []
    match_back = PromptCorpus._match_back

    def counted(self: PromptCorpus, seq: int, other: int, end: int, n: int) -> int:
        followed.append((other, end))
        return match_back(self, seq, other, end, n)

    monkeypatch.setattr(PromptCorpus, "_match_back", counted)
    assert corpus.match(seqs[0], 4) == Match(24, (11, 12, 13, 14))
    assert len(followed) == 16  # not 33 x 73
    # the newest: the last sample's last turns of the loop
    assert {other for other, _ in followed} == {seqs[-1]}
    with pytest.raises(ValueError, match=r"max_occurrences \(0\) must be at least 1"):
        DraftSettings(max_occurrences=0)


def test_short_matches_and_split_votes_draft_less_when_asked() -> None:
    corpus = PromptCorpus([0], DraftSettings(k=4, min_n=2, max_n=5, spec_factor=1.0))
    corpus.add_sample([1, 2, 3, 4, 5, 6])
    seq = corpus.add_sample([9, 1, 2])  # "1 2": a match of 2 tokens drafts 2
    assert corpus.match(seq, 4) == Match(2, (3, 4))
    half = PromptCorpus([0], DraftSettings(k=4, min_n=2, max_n=5, spec_factor=0.5))
    half.add_sample([1, 2, 3, 4, 5, 6])
    assert half.match(half.add_sample([9, 1, 2]), 4).draft == (3,)

    def split(min_share: float) -> tuple[int, ...]:
        c = PromptCorpus([0], DraftSettings(k=4, min_n=2, max_n=5, min_share=min_share))
        for output in ([1, 2, 7, 8, 9], [1, 2, 7, 5, 5], [1, 2, 6, 6, 6]):
            c.add_sample(output)
        # after "1 2": 7 by 2 of 3 (0.67), then 8 or 5 by 1 of 2 (0.33 in all), then 9 alone
        return c.match(c.add_sample([1, 2]), 4).draft

    assert split(0.0) == (7, 8, 9)
    assert split(0.3) == (7, 8, 9)
    assert split(0.5) == (7,)
    assert split(0.7) == ()


def _outputs(history: History, prompt: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(o) for o in history.outputs(prompt)]


def test_history_keeps_the_newest_outputs_within_its_budgets() -> None:
    history = History(max_tokens=20, max_per_prompt=2)
    history.add((1, 2), [10, 11])
    history.add((1, 2), [12])
    history.add((1, 2), [13, 14, 15])  # the oldest output of the prompt goes
    assert _outputs(history, (1, 2)) == [(12,), (13, 14, 15)]
    assert history.tokens == 2 + 1 + 3
    history.add((3,) * 5, [4] * 6)
    assert history.tokens == 6 + 11
    history.outputs((1, 2))  # used: the other prompt is now the least recent
    history.add((8,), [9, 9, 9])  # 21 tokens: the least recently used prompt goes
    assert _outputs(history, (3,) * 5) == []
    assert _outputs(history, (1, 2)) == [(12,), (13, 14, 15)]
    assert len(history) == 2
    with pytest.raises(ValueError, match="max_tokens"):
        History(max_tokens=0, max_per_prompt=1)


def test_history_tells_prompts_apart_by_their_tokens_alone() -> None:
    """A prompt is keyed by a digest of its tokens: the same tokens as a list, a tuple or an
    array are one prompt; a prompt that is another's prefix, or the same tokens in another
    order, is another."""
    history = History(max_tokens=1 << 20, max_per_prompt=8)
    prompt = list(range(300, 800))  # (ids past the small ints Python shares)
    history.add(prompt, [1])
    history.add(tuple(prompt), [2])
    history.add(array("i", prompt), [3])
    assert len(history) == 1 and _outputs(history, tuple(prompt)) == [(1,), (2,), (3,)]
    assert history.tokens == len(prompt) + 3
    history.add(prompt[:-1], [4])
    history.add(prompt[::-1], [5])
    assert len(history) == 3
    assert _outputs(history, tuple(prompt[:-1])) == [(4,)]
    assert _outputs(history, tuple(prompt[::-1])) == [(5,)]


class _Batch:
    """The fields of vLLM's input batch that a proposer reads."""

    def __init__(self, max_len: int = 64) -> None:
        self.max_len = max_len
        self.req_ids: list[str] = []
        self.token_ids_cpu = np.zeros((8, max_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(8, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(8, dtype=np.int32)

    def set(self, rows: list[tuple[str, list[int], list[int]]]) -> None:
        self.req_ids = [req_id for req_id, _, _ in rows]
        for row, (_, prompt, output) in enumerate(rows):
            tokens = prompt + output
            self.token_ids_cpu[row, : len(tokens)] = tokens
            self.num_tokens_no_spec[row] = len(tokens)
            self.num_prompt_tokens[row] = len(prompt)


def _drafter(k: int = 4, max_model_len: int = 64, **config: Any) -> RolloutDrafter:
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )
    return RolloutDrafter(vllm_config, DrafterConfig(**config), install_hooks=False)


PROMPT = [1, 2, 3, 4, 5, 6]


def test_the_drafter_drafts_a_request_from_a_sibling_that_finished() -> None:
    drafter = _drafter()
    batch = _Batch()
    batch.set([("g/0", PROMPT, [20, 21]), ("g/1", PROMPT, [30])])
    assert drafter.propose_rows(4, batch, [[21], [30]]) == [[], []]  # nothing to match yet
    assert (drafter.live_requests, drafter.live_prompts) == (2, 1)
    drafter.finished("g/0", PROMPT, [20, 21, 22, 23, 24, 25, 26])
    # g/1 took 20 21 where g/0 took them: it drafts what g/0 went on with
    batch.set([("g/1", PROMPT, [30, 20, 21])])
    assert drafter.propose_rows(4, batch, [[20, 21]]) == [[22, 23, 24, 25]]
    assert drafter.propose_rows(2, batch, [[20, 21]]) == [[22, 23]]  # the step's k
    drafter.finished("g/1", PROMPT, [30, 20, 21, 22])
    assert (drafter.live_requests, drafter.live_prompts) == (0, 0)


def test_a_later_round_of_the_prompt_drafts_from_the_earlier_ones() -> None:
    drafter = _drafter()
    drafter.finished("e0/0", PROMPT, [40, 41, 42, 43, 44])  # never drafted: history only
    drafter.finished("e0/1", PROMPT, [40, 41, 42, 50, -1])  # -1: a placeholder, dropped
    assert _outputs(drafter.history, tuple(PROMPT)) == [(40, 41, 42, 43, 44), (40, 41, 42, 50)]
    batch = _Batch()
    batch.set([("e1/0", PROMPT, [40]), ("other", [9, 9, 8], [7])])
    assert drafter.propose_rows(4, batch, [[40], [7]]) == [[41, 42, 43, 44], []]
    # another prompt does not draft from it
    assert drafter.live_prompts == 2


def test_outputs_made_elsewhere_draft_later_and_running_samples() -> None:
    """The scheduler hands an engine a prompt's outputs from other engines: a sample that
    starts later drafts from them, and so do the prompt's samples already running."""
    drafter = _drafter()
    drafter.add_outputs(PROMPT, [[40, 41, 42, 43, 44]])
    assert _outputs(drafter.history, tuple(PROMPT)) == [(40, 41, 42, 43, 44)]
    batch = _Batch()
    batch.set([("a/0", PROMPT, [40])])
    assert drafter.propose_rows(4, batch, [[40]]) == [[41, 42, 43, 44]]
    batch.set([("a/0", PROMPT, [40, 41, 60])])
    assert drafter.propose_rows(4, batch, [[41, 60]]) == [[]]  # nothing went on from 60
    drafter.add_outputs(PROMPT, [[70, 71], [41, 60, 61, 62, 63, 64]])  # while a/0 runs
    assert drafter.propose_rows(4, batch, [[41, 60]]) == [[61, 62, 63, 64]]
    assert len(_outputs(drafter.history, tuple(PROMPT))) == 3
    drafter.add_outputs([9, 9], [[80, 81, 82]])  # another prompt's: not drafted from here
    batch.set([("a/0", PROMPT, [40, 41, 60, 61, 80, 81])])
    assert drafter.propose_rows(4, batch, [[80, 81]]) == [[]]


def test_the_worker_extension_reaches_the_rollout_drafter_only() -> None:
    worker = RolloutWorkerExtension()
    assert worker.rollserve_add_earlier_outputs([(PROMPT, [[1, 2]])]) == 0  # no model runner
    worker.model_runner = SimpleNamespace(drafter=object())  # type: ignore[attr-defined]
    assert worker.rollserve_add_earlier_outputs([(PROMPT, [[1, 2]])]) == 0  # another drafter
    drafter = _drafter()
    worker.model_runner = SimpleNamespace(drafter=drafter)  # type: ignore[attr-defined]
    other = [9, 9]
    assert worker.rollserve_add_earlier_outputs([(PROMPT, [[1, 2], [3]]), (other, [[4]])]) == 3
    assert _outputs(drafter.history, tuple(PROMPT)) == [(1, 2), (3,)]
    assert _outputs(drafter.history, tuple(other)) == [(4,)]
    assert hasattr(RolloutWorkerExtension, ADD_OUTPUTS_METHOD)


def test_no_drafts_in_steps_vllm_does_not_speculate_nor_past_the_model_length() -> None:
    drafter = _drafter(max_model_len=12)
    drafter.finished("a", PROMPT, [40, 41, 42, 43, 44])
    batch = _Batch()
    batch.set([("b", PROMPT, [40])])
    assert drafter.propose_rows(0, batch, [[40]]) == [[]]
    assert drafter.live_requests == 0  # a step without drafts costs nothing
    assert drafter.propose_rows(4, batch, [[]]) == [[]]  # a row that sampled nothing
    assert drafter.propose_rows(4, batch, [[40]]) == [[41, 42, 43, 44]]
    batch.set([("b", PROMPT, [40, 41, 42])])  # 9 tokens of 12: room for 2 drafts
    assert drafter.propose_rows(4, batch, [[41, 42]]) == [[43, 44]]
    batch.set([("b", PROMPT, [40, 41, 42, 43, 44])])  # 11 of 12: none
    assert drafter.propose_rows(4, batch, [[43, 44]]) == [[]]


def test_a_request_whose_prompt_vllm_replaced_drafts_as_a_new_sample() -> None:
    drafter = _drafter()
    drafter.finished("a", [*PROMPT, 40], [41, 42, 43, 44])
    batch = _Batch()
    batch.set([("s", PROMPT, [40, 41])])
    assert drafter.propose_rows(4, batch, [[41]]) == [[]]
    # a streaming session folds the output into the prompt: same id, another prompt
    batch.set([("s", [*PROMPT, 40], [41])])
    assert drafter.propose_rows(4, batch, [[41]]) == [[42, 43, 44]]
    assert (drafter.live_requests, drafter.live_prompts) == (1, 1)


def test_settings_reach_the_drafter_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = DrafterConfig(min_n=3, max_n=7, history_tokens=100, history_per_prompt=5)
    monkeypatch.setenv(DRAFTER_ENV, config.to_env())
    assert DrafterConfig.from_env() == config
    monkeypatch.delenv(DRAFTER_ENV)
    assert DrafterConfig.from_env() == DrafterConfig()
    monkeypatch.setenv(DRAFTER_ENV, json.dumps({"min_n": 4, "max_n": 3}))
    with pytest.raises(ValueError, match="min_n"):
        DrafterConfig.from_env()
    with pytest.raises(ValueError, match="history_tokens"):
        DrafterConfig(history_tokens=0)


def test_the_plain_custom_proposer_call_is_refused() -> None:
    with pytest.raises(RuntimeError, match="request ids"):
        _drafter().propose([[1]], np.zeros(1), np.zeros((1, 4)))


def test_the_hooks_wrap_vllms_model_runner_methods_as_they_are() -> None:
    """vLLM 0.32's model runner methods the drafter wraps exist with the arguments it passes
    on; a vLLM upgrade that renames them fails here, not in a running engine."""
    pytest.importorskip("vllm")
    from rollserve.engine.drafter import install_runner_hooks
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    install_runner_hooks()
    install_runner_hooks()  # once a process
    wrapped = inspect.signature(GPUModelRunner.propose_draft_token_ids.__wrapped__)
    assert list(wrapped.parameters)[:3] == ["self", "scheduler_output", "sampled_token_ids"]
    removed = inspect.signature(GPUModelRunner._on_request_state_removed.__wrapped__)
    assert list(removed.parameters) == ["self", "req_id", "req_state"]

    class _Runner:
        propose_draft_token_ids = GPUModelRunner.propose_draft_token_ids
        _on_request_state_removed = GPUModelRunner._on_request_state_removed

        def __init__(self) -> None:
            self.drafter = _drafter()
            self.input_batch = _Batch()
            self._draft_probs: object = "stale"

    runner = _Runner()
    runner.drafter.finished("a", PROMPT, [40, 41, 42, 43])
    runner.input_batch.set([("b", PROMPT, [40])])
    out = runner.propose_draft_token_ids(SimpleNamespace(num_spec_tokens_to_schedule=4), [[40]])
    assert out == [[41, 42, 43]]
    assert runner._draft_probs is None
    runner._on_request_state_removed(
        "b", SimpleNamespace(prompt_token_ids=PROMPT, output_token_ids=[40, 41])
    )
    assert runner.drafter.live_requests == 0
    assert _outputs(runner.drafter.history, tuple(PROMPT))[-1] == (40, 41)

    def broken(*args: Any) -> list[list[int]]:
        raise IndexError("a drafting bug")

    runner.drafter.propose_rows = broken  # type: ignore[method-assign,assignment]
    step = SimpleNamespace(num_spec_tokens_to_schedule=4)
    assert runner.propose_draft_token_ids(step, [[40], [7]]) == [[], []]  # the engine goes on
    assert runner.drafter.failures == 1


def test_a_long_history_is_indexed_on_a_thread_and_drafts_once_adopted() -> None:
    drafter = _drafter(background_tokens=8)
    drafter.finished("e0/0", PROMPT, [40, 41, 42, 43, 44])
    drafter.finished("e0/1", PROMPT, [40, 41, 42, 43, 45])  # 10 tokens: at the threshold
    batch = _Batch()
    batch.set([("e1/0", PROMPT, [40])])
    # The first step starts the indexing and does not wait for it: no draft from the history
    # (nor from the prompt, indexed with it).
    assert drafter.propose_rows(4, batch, [[40]]) == [[]]
    drafter.settle(timeout=30)
    assert drafter.background_builds == 1
    batch.set([("e1/0", PROMPT, [40, 41])])
    assert drafter.propose_rows(4, batch, [[41]]) == [[42, 43, 44]]  # a tie: the earliest
    # A shorter history is indexed in the step, as before.
    other = (7, 8, 9)
    drafter.finished("x/0", list(other), [1, 2, 3])
    batch.set([("x/1", list(other), [1])])
    assert drafter.propose_rows(4, batch, [[1]]) == [[2, 3]]
    assert drafter.background_builds == 1 and drafter.failures == 0


def test_a_prompt_done_before_its_history_is_indexed_drops_it() -> None:
    drafter = _drafter(background_tokens=1)
    drafter.finished("e0/0", PROMPT, [40, 41, 42, 43, 44])
    batch = _Batch()
    batch.set([("e1/0", PROMPT, [40])])
    assert drafter.propose_rows(4, batch, [[40]]) == [[]]
    drafter.finished("e1/0", PROMPT, [40, 41, 42])  # its last sample: the corpus goes
    assert drafter.live_prompts == 0
    drafter.settle(timeout=30)
    assert drafter.background_builds == 0  # nothing left to adopt it
    batch.set([("e2/0", PROMPT, [40, 41])])  # a later round indexes the history anew
    drafter.propose_rows(4, batch, [[41]])
    drafter.settle(timeout=30)
    assert drafter.propose_rows(4, batch, [[41]]) == [[42, 43, 44]]  # e0/0 goes on
    assert drafter.background_builds == 1 and drafter.failures == 0
    with pytest.raises(ValueError, match="background_tokens"):
        DrafterConfig(background_tokens=-1)
